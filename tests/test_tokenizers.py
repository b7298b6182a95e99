import pytest

from decoderlm import CharTokenizer, UnknownCharacterError, load_tokenizer


def test_char_vocabulary_is_sorted_code_points_and_round_trips():
    # pitfalls row 7
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
    (tmp_path / "tokenizer.json").write_text('{"type": "bpe"}')
    with pytest.raises(ValueError, match="unknown or malformed tokenizer"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "nowhere")
