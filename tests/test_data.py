import hashlib
from pathlib import Path

import pytest
import torch

from decoderlm.data import EMBEDDED_CORPUS, get_batch, load_text, split_ids

SHARED_VALID = (
    Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2-raw" / "valid.txt"
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
    # pitfalls row 18
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
