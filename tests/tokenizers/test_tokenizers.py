import json

import numpy as np
import pytest

from decoderlm import (
    ByteTokenizer,
    CharTokenizer,
    UnknownCharacterError,
    load_tokenizer,
    make_tokenizer,
)
from decoderlm.data.prepare import token_dtype
from decoderlm.tokenizers import DEFAULT_UNK_TOKEN


def test_char_vocabulary_is_sorted_code_points_and_round_trips():
    # the vocabulary of "hello world\n" is its 9 distinct characters in code-point order, and
    # text made of them round-trips
    tok = CharTokenizer.from_text("hello world\n")
    assert tok.chars == ["\n", " ", "d", "e", "h", "l", "o", "r", "w"]
    assert tok.vocab_size == 9
    assert tok.encode("hold") == [4, 6, 5, 2]
    assert tok.decode(tok.encode("hold")) == "hold"


def test_unknown_characters_are_named_with_positions_not_a_key_error():
    tok = CharTokenizer.from_text("hello world\n")
    with pytest.raises(ValueError) as err:
        tok.encode("help!p")
    assert not isinstance(err.value, KeyError)
    assert isinstance(err.value, UnknownCharacterError)
    assert err.value.unknown == [("p", 3), ("!", 4)]
    assert "'p' at position 3" in str(err.value) and "'!' at position 4" in str(err.value)


def test_tokenizer_save_load_and_decode_errors(tmp_path):
    tok = CharTokenizer.from_text("The cat, the hat. é—ü")
    tok.save_pretrained(tmp_path)
    again = CharTokenizer.from_pretrained(tmp_path)
    assert again.chars == tok.chars
    assert load_tokenizer(tmp_path).encode("é—ü") == tok.encode("é—ü")
    with pytest.raises(ValueError, match="outside"):
        tok.decode([0, tok.vocab_size])
    (tmp_path / "decoderlm_tokenizer.json").write_text('{"type": "bpe"}')
    with pytest.raises(ValueError, match="unknown or malformed tokenizer"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "nowhere")


def test_byte_tokenizer_is_utf8_bytes_and_decodes_with_replacement(tmp_path):
    tok = ByteTokenizer()
    text = "naïve — 東京 🙂\n"
    assert tok.vocab_size == 256 and tok.kind == "byte"
    assert tok.encode(text) == list(text.encode("utf-8"))
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([0x68, 0xC3]) == "h\ufffd"  # a character cut in half
    with pytest.raises(ValueError, match="outside"):
        tok.decode([256])
    tok.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "decoderlm_tokenizer.json").read_text()) == {"type": "byte"}
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)


def test_char_unknown_token_is_appended_and_optional(tmp_path):
    plain = CharTokenizer.from_text("hello world\n")
    tok = CharTokenizer.from_text("hello world\n", unk_token=DEFAULT_UNK_TOKEN)
    assert tok.chars == plain.chars + ["\ufffd"] and tok.unk_id == plain.vocab_size
    assert plain.unk_id is None and plain.unk_token is None
    assert tok.encode("hold") == plain.encode("hold")  # known characters keep their ids
    with pytest.raises(UnknownCharacterError) as err:
        tok.encode("help!")  # strict unless asked
    assert err.value.unknown == [("p", 3), ("!", 4)]
    assert tok.encode("help!", unknown="unk") == plain.encode("hel") + [tok.unk_id] * 2
    assert tok.count_unknown("help!p") == 3
    with pytest.raises(UnknownCharacterError, match="no unknown token"):
        plain.encode("help", unknown="unk")
    with pytest.raises(ValueError, match="'error' or 'unk'"):
        tok.encode("h", unknown="skip")
    # a text that holds U+FFFD keeps it in its sorted place, as the unknown token
    inside = CharTokenizer.from_text("b\ufffda", unk_token=DEFAULT_UNK_TOKEN)
    assert inside.chars == ["a", "b", "\ufffd"] and inside.unk_id == 2
    with pytest.raises(ValueError, match="not in the vocabulary"):
        CharTokenizer(["a"], unk_token="b")
    tok.save_pretrained(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again.chars == tok.chars and again.unk_token == "\ufffd"
    # a first-format run directory: no decoderlm_tokenizer.json, and {"type": ...} without
    # unk_token in tokenizer.json
    (tmp_path / "decoderlm_tokenizer.json").unlink()
    (tmp_path / "tokenizer.json").write_text(json.dumps({"type": "char", "chars": ["a", "b"]}))
    assert load_tokenizer(tmp_path).unk_token is None


def test_make_tokenizer_kinds():
    assert make_tokenizer("char", iter(["ba", "c"])).chars == ["a", "b", "c", "\ufffd"]
    assert make_tokenizer("char", "ba", unk_token=None).chars == ["a", "b"]
    assert make_tokenizer("byte").vocab_size == 256
    assert make_tokenizer("gpt2").encode("Hello world") == [15496, 995]
    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        make_tokenizer("wordpiece")
    with pytest.raises(ValueError, match="pass text"):
        make_tokenizer("char")
    assert token_dtype(65_536) == np.uint16 and token_dtype(65_537) == np.uint32


# --- special tokens, as tiktoken treats them -----------------------------------------------

SPECIAL_TEXTS = ["plain text", "a<|endoftext|>b", "<|endoftext|><|endoftext|>", "x<|endoftext", ""]
SPECIAL_MODES = [
    {},
    {"allowed_special": "all"},
    {"allowed_special": {"<|endoftext|>"}},
    {"allowed_special": {"<|other|>"}},
    {"disallowed_special": ()},
    {"allowed_special": set(), "disallowed_special": ()},
    {"allowed_special": "all", "disallowed_special": "all"},
    {"disallowed_special": {"<|endoftext|>"}},
    {"disallowed_special": {"text"}},
]


def _same_as_tiktoken(tok, oracle, texts=SPECIAL_TEXTS):
    """Every text under every mode: the same ids as tiktoken, or the same error."""
    for text in texts:
        for mode in SPECIAL_MODES:
            try:
                want = oracle.encode(text, **mode)
            except ValueError as e:
                with pytest.raises(ValueError) as err:
                    tok.encode(text, **mode)
                assert str(err.value) == str(e), (text, mode)
                continue
            assert tok.encode(text, **mode) == want, (text, mode)
        assert tok.encode_ordinary(text) == oracle.encode_ordinary(text)


def _tiktoken_of(pieces: dict[bytes, int], special: dict[str, int]):
    """A tiktoken Encoding whose pre-tokens are single characters and whose ranks are
    `pieces`: the independent oracle for the byte and char tokenizers."""
    import tiktoken

    return tiktoken.Encoding(
        "oracle", pat_str=r"[\s\S]", mergeable_ranks=pieces, special_tokens=special
    )


def test_gpt2_special_tokens_follow_tiktoken():
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    from decoderlm import GPT2Tokenizer
    from decoderlm.tokenizers import GPT2_BPE_DIR

    ranks = data_gym_to_mergeable_bpe_ranks(
        str(GPT2_BPE_DIR / "vocab.bpe"), str(GPT2_BPE_DIR / "encoder.json")
    )
    oracle = tiktoken.Encoding(
        "gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 50256}
    )
    tok = GPT2Tokenizer()
    assert tok.eot_token == 50256 and tok.special_tokens == {"<|endoftext|>": 50256}
    assert tok.encode("a<|endoftext|>b", allowed_special="all") == [64, 50256, 65]
    with pytest.raises(ValueError, match="disallowed special token"):
        tok.encode("a<|endoftext|>b")  # tiktoken's default: an error, not the separator
    _same_as_tiktoken(tok, oracle)


def test_byte_tokenizer_end_of_text_follows_tiktoken(tmp_path):
    from decoderlm.tokenizers import END_OF_TEXT

    plain = ByteTokenizer()
    assert plain.eot_token is None and plain.special_tokens == {}
    tok = ByteTokenizer([END_OF_TEXT])
    assert tok.vocab_size == 257 and tok.eot_token == 256
    oracle = _tiktoken_of({bytes([b]): b for b in range(256)}, {END_OF_TEXT: 256})
    _same_as_tiktoken(tok, oracle, [*SPECIAL_TEXTS, "é<|endoftext|>東京"])
    ids = tok.encode("é<|endoftext|>x", allowed_special="all")
    assert tok.decode(ids) == "é<|endoftext|>x" and ids[2] == 256
    # without a special token there is nothing to disallow: the string is ordinary bytes
    assert plain.encode("a<|endoftext|>") == list(b"a<|endoftext|>")
    tok.save_pretrained(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again.special_tokens == {END_OF_TEXT: 256} and again.vocab_size == 257


def test_char_tokenizer_end_of_text_only_when_asked_and_follows_tiktoken(tmp_path):
    text = "a<|endoftext|>b plain text x"
    default = make_tokenizer("char", text)
    assert default.eot_token is None and default.special_tokens == {}
    # without special tokens the saved fields are chars and unk_token alone
    assert "special_tokens" not in default.to_dict()
    tok = make_tokenizer("char", text, eot=True)
    assert tok.chars == default.chars and tok.eot_token == default.vocab_size
    assert tok.vocab_size == default.vocab_size + 1
    ascii_chars = {c.encode(): i for i, c in enumerate(tok.chars) if c.isascii()}
    oracle = _tiktoken_of(ascii_chars, {"<|endoftext|>": tok.eot_token})
    _same_as_tiktoken(tok, oracle)
    ids = tok.encode("ab<|endoftext|>", allowed_special="all")
    assert ids == tok.encode("ab") + [tok.eot_token]
    assert tok.decode(ids) == "ab<|endoftext|>"
    tok.save_pretrained(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again.special_tokens == tok.special_tokens and again.chars == tok.chars
    with pytest.raises(ValueError, match="duplicates"):
        CharTokenizer(["a"], special_tokens=["<s>", "<s>"])
    with pytest.raises(UnknownCharacterError) as err:  # positions count in the whole text
        tok.encode("ab<|endoftext|>aZ", allowed_special="all")
    assert err.value.unknown == [("Z", 16)]


# --- run files other tools read -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["char", "byte", "gpt2"])
@pytest.mark.parametrize("eot", [False, True])
def test_saved_tokenizer_json_loads_in_transformers_with_the_same_ids(tmp_path, kind, eot):
    transformers = pytest.importorskip("transformers")
    text = "Hello world, naïve 東京 🙂\n\n  x\ty <|endoftext|> end\r\n"
    tok = make_tokenizer(kind, text, eot=eot)
    tok.save_pretrained(tmp_path)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert len(hf) == tok.vocab_size
    plain = text.replace("<|endoftext|>", "")
    assert hf.encode(plain) == tok.encode(plain)
    # Hugging Face turns a special token's string into its id: our allowed_special="all"
    if tok.eot_token is not None:
        assert hf.encode(text) == tok.encode(text, allowed_special="all")
        assert tok.eot_token in hf.encode(text)
    assert hf.decode(tok.encode(plain)) == tok.decode(tok.encode(plain))
    if kind == "char":  # characters outside the vocabulary: the unknown token on both sides
        assert hf.encode("Zq!") == tok.encode("Zq!", unknown="unk")
    assert load_tokenizer(tmp_path).to_dict() == tok.to_dict()


def test_old_run_directories_and_hf_only_directories(tmp_path):
    from pathlib import Path

    fixture = Path(__file__).parents[1] / "fixtures" / "run_v0" / "gpt2-style"
    old = load_tokenizer(fixture)  # first format: {"type": ...} in tokenizer.json
    assert old.kind == json.loads((fixture / "tokenizer.json").read_text())["type"]
    make_tokenizer("byte").save_pretrained(tmp_path)
    (tmp_path / "decoderlm_tokenizer.json").unlink()
    with pytest.raises(ValueError, match="Hugging Face tokenizer and decoderlm_tokenizer.json"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("style", ["gpt2-style", "llama-style"])
def test_an_old_run_directory_still_samples(capsys, style):
    from pathlib import Path

    from decoderlm.cli import main

    run = Path(__file__).parents[1] / "fixtures" / "run_v0" / style
    args = ["sample", "--run", str(run), "--prompt", "The ", "--max-new-tokens", "8", "--seed", "0"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("The ") and len(out) == len("The ") + 8 + 1  # one char per token
    assert set(out[4:-1]) <= set(load_tokenizer(run).chars)


def test_each_class_reads_only_its_own_kind_and_the_kind_is_read_without_building(tmp_path):
    # Tokenizer.from_pretrained is a classmethod of each concrete class (read_tokenizer reads
    # any kind); read_end_of_text_id knows GPT-2's id from the file alone
    from decoderlm import GPT2Tokenizer, Tokenizer
    from decoderlm.tokenizers import read_end_of_text_id, read_tokenizer

    ByteTokenizer(["<|endoftext|>"]).save_pretrained(tmp_path / "byte")
    assert ByteTokenizer.from_pretrained(tmp_path / "byte").eot_token == 256
    assert read_tokenizer(tmp_path / "byte").to_dict() == ByteTokenizer(["<|endoftext|>"]).to_dict()
    assert read_end_of_text_id(tmp_path / "byte") == 256
    with pytest.raises(ValueError, match="holds a 'byte' tokenizer, not 'char'"):
        CharTokenizer.from_pretrained(tmp_path / "byte")
    with pytest.raises(ValueError, match="reads one kind; use read_tokenizer"):
        Tokenizer.from_pretrained(tmp_path / "byte")
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "decoderlm_tokenizer.json").write_text('{"type": "gpt2"}')
    assert read_end_of_text_id(tmp_path / "gpt2") == GPT2Tokenizer().eot_token == 50256
    assert read_end_of_text_id(tmp_path / "nothing") is None
    (tmp_path / "decoderlm_tokenizer.json").write_text('{"type": "byte", "special_tokens": 3}')
    with pytest.raises(ValueError, match="unknown or malformed tokenizer"):
        read_tokenizer(tmp_path)
