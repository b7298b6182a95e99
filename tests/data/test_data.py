import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from decoderlm.data.corpus import (
    EMBEDDED_CORPUS,
    get_batch,
    is_token_dir,
    iter_text_chunks,
    load_text,
    load_token_dir,
    split_ids,
    windows,
)
from decoderlm.data.prepare import prepare
from decoderlm.evaluate import evaluate

from conftest import quiet, tiny_model

SHARED_VALID = (
    Path(__file__).resolve().parents[3] / "shared" / "data" / "wikitext-2-raw" / "valid.txt"
)


def test_embedded_corpus_is_the_first_300k_characters_of_wikitext2_valid():
    data = EMBEDDED_CORPUS.read_bytes()
    assert (
        hashlib.sha256(data).hexdigest()
        == "5781434db48a1fd7958520e8a8f500bc4a4942abfbbea804239f6b95f5ee4261"
    )
    text, source = load_text()
    assert len(text) == 300_000
    assert text.startswith(" \n = Homarus gammarus = \n")
    assert "WikiText-2" in source
    if SHARED_VALID.is_file():  # an independent copy of the original split
        assert SHARED_VALID.read_text(encoding="utf-8")[:300_000] == text


def test_split_is_90_10_in_order():
    ids = torch.arange(1000)
    train, val = split_ids(ids, 0.1)
    assert torch.equal(train, ids[:900]) and torch.equal(val, ids[900:])


def test_load_text_from_file_directory_and_errors(tmp_path):
    (tmp_path / "a.txt").write_text("hello wörld", encoding="utf-8")
    assert load_text(tmp_path / "a.txt")[0] == "hello wörld"
    assert load_text(tmp_path / "a.txt", max_chars=5)[0] == "hello"
    wiki = tmp_path / "wikitext"
    wiki.mkdir()
    with pytest.raises(FileNotFoundError, match="wiki.train.raw"):
        load_text(wiki)
    (wiki / "wiki.train.raw").write_text(" \n = Train = \n", encoding="utf-8")
    (wiki / "wiki.valid.raw").write_text("valid", encoding="utf-8")
    assert load_text(wiki)[0] == " \n = Train = \n"
    plain = tmp_path / "splits"  # a directory in the train.txt / valid.txt / test.txt layout
    plain.mkdir()
    for name in ("train.txt", "valid.txt", "test.txt"):
        (plain / name).write_text(name, encoding="utf-8")
    assert load_text(plain)[0] == "train.txt"
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8"):
        load_text(tmp_path / "latin1.txt")
    with pytest.raises(FileNotFoundError, match="not found"):
        load_text(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="empty"):
        load_text(tmp_path / "empty.txt")


@pytest.mark.parametrize("n", [10, 16])
def test_get_batch_refuses_too_short_data(n):
    # a window needs block_size + 1 tokens (inputs and targets shifted by one): shorter data
    # is refused at setup, naming its length and the need, instead of failing in randint
    with pytest.raises(ValueError, match=rf"has {n} tokens.*block_size \+ 1 = 17"):
        get_batch(torch.arange(n), 4, 16)


def test_get_batch_windows_and_start_range():
    g = torch.Generator().manual_seed(0)
    data = torch.arange(17)
    for _ in range(20):
        x, y = get_batch(data, 4, 16, g)
        assert torch.equal(x, torch.arange(16).expand(4, 16))
        assert torch.equal(y, torch.arange(1, 17).expand(4, 16))
    data = torch.arange(18)
    starts = set()
    for _ in range(50):
        x, y = get_batch(data, 4, 16, g)
        assert x.shape == y.shape == (4, 16)
        assert torch.equal(x[:, 1:], y[:, :-1])
        starts.update(x[:, 0].tolist())
    assert starts == {0, 1}


def test_text_chunks_split_characters_and_newlines_like_read_text(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes("añ東🙂\r\nx\ry\r\n".encode() * 50)
    for chunk_bytes in (1, 2, 3, 7, 1 << 20):
        chunks = list(iter_text_chunks(path, chunk_bytes))
        assert "".join(chunks) == path.read_text(encoding="utf-8")  # CRLF, CR -> LF too
    bad = tmp_path / "bad.txt"
    bad.write_bytes("é".encode() * 500 + b"\xff" + b"tail")
    for chunk_bytes in (7, 64, 1 << 20):
        with pytest.raises(ValueError, match="invalid byte at offset 1000"):
            list(iter_text_chunks(bad, chunk_bytes))
    cut = tmp_path / "cut.txt"
    cut.write_bytes(b"abc" + "東".encode()[:2])  # a character cut off at the end
    with pytest.raises(ValueError, match="offset 3"):
        list(iter_text_chunks(cut, 2))


def test_damaged_token_directories_give_clear_errors(tmp_path):
    (tmp_path / "a.txt").write_text("abcdefgh" * 100, encoding="utf-8")
    out = tmp_path / "tok"
    prepare([tmp_path / "a.txt"], "char", out, log=quiet)
    meta = json.loads((out / "meta.json").read_text())
    assert is_token_dir(out) and not is_token_dir(tmp_path)
    train_bytes = (out / "train.bin").read_bytes()
    (out / "train.bin").write_bytes(train_bytes[:-2])
    with pytest.raises(ValueError, match="truncated"):
        load_token_dir(out)
    (out / "train.bin").write_bytes(
        np.frombuffer(train_bytes, np.uint16).astype(np.uint32).tobytes()
    )  # ids written as uint32, meta says uint16
    with pytest.raises(ValueError, match="another dtype"):
        load_token_dir(out)
    (out / "train.bin").write_bytes(train_bytes)
    load_token_dir(out)
    (out / "meta.json").write_text(json.dumps({**meta, "dtype": "int8"}))
    with pytest.raises(ValueError, match="dtype 'int8'"):
        load_token_dir(out)
    (out / "meta.json").write_text(json.dumps({**meta, "vocab_size": 3}))
    with pytest.raises(ValueError, match="has 9 ids but vocab_size is 3"):
        load_token_dir(out)
    (out / "meta.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid UTF-8 JSON"):
        load_token_dir(out)
    (out / "meta.json").unlink()
    assert not is_token_dir(out)
    with pytest.raises(FileNotFoundError, match="meta.json not found"):
        load_token_dir(out)


def test_batches_and_evaluation_from_a_memmap_equal_those_from_a_tensor(tmp_path):
    text = EMBEDDED_CORPUS.read_text(encoding="utf-8")[:20_000]
    (tmp_path / "c.txt").write_text(text, encoding="utf-8")
    prepare([tmp_path / "c.txt"], "char", tmp_path / "tok", log=quiet)
    tokens = load_token_dir(tmp_path / "tok")
    tensor = torch.tensor(tokens.tokenizer.encode(text))[: len(tokens.train)]
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for _ in range(3):
        x, y = get_batch(tokens.train, 4, 16, g1)
        x2, y2 = get_batch(tensor, 4, 16, g2)
        assert x.dtype == y.dtype == torch.int64 and x.shape == (4, 16)
        assert torch.equal(x, x2) and torch.equal(y, y2)
    x, _ = windows(tokens.train, torch.tensor([0, 100]), 8)
    assert torch.equal(x, tensor[torch.tensor([[0], [100]]) + torch.arange(8)])
    model = tiny_model(vocab_size=tokens.meta["vocab_size"])
    assert evaluate(model, tokens.train, 20) == evaluate(model, tensor, 20)


def test_the_seed_experiment_data_are_unchanged_by_special_tokens():
    # the default run's char vocabulary has no end-of-text token, and its ids are the
    # sorted-character ids of the embedded text: special-token support changes nothing there
    from decoderlm.data.corpus import EMBEDDED_CORPUS, data_spec, load_corpus

    tokenizer, train_ids, val_ids, _, _ = load_corpus(data_spec(None, None, None, 0.1))
    text = EMBEDDED_CORPUS.read_text(encoding="utf-8")
    chars = sorted(set(text))
    assert tokenizer.chars == [*chars, "\ufffd"] and tokenizer.special_tokens == {}
    assert tokenizer.eot_token is None and "special_tokens" not in tokenizer.to_dict()
    lookup = {c: i for i, c in enumerate(chars)}
    expected = torch.tensor([lookup[c] for c in text])
    assert torch.equal(torch.cat([torch.as_tensor(train_ids), torch.as_tensor(val_ids)]), expected)
