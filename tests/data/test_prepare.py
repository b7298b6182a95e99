"""Tokenizers behind one interface, `decoderlm prepare`, token directories, `decoderlm eval`."""

import importlib.util
import json
import math
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from decoderlm.cli import main
from decoderlm.data.corpus import WIKITEXT_FILES as WIKITEXT_NAMES
from decoderlm.data.corpus import load_token_dir
from decoderlm.data.prepare import encode_source, iter_token_chunks, prepare
from decoderlm.tokenizers import GPT2Tokenizer, make_tokenizer

from conftest import SHAKESPEARE, SHARED_DATA, WIKI, needs_shared, one_line_error, quiet

# --- tokenizers ---------------------------------------------------------------------------


# --- streaming text and BPE chunks ----------------------------------------------------------


def test_bpe_chunks_are_cut_where_the_ids_do_not_change(tmp_path):
    rng = random.Random(0)
    atoms = [
        "a",
        "word",
        " ",
        "  ",
        "\n",
        "\n\n",
        " \n ",
        "\t",
        "\u00a0",
        "\u3000",
        "7",
        "42",
        "'s",
        "'ll",
        "!",
        "?!",
        "é",
        "東京",
        "🙂",
        "<|endoftext|>",
        "\r\n",
    ]
    text = "".join(rng.choice(atoms) for _ in range(6000))
    path = tmp_path / "adversarial.txt"
    path.write_text(text, encoding="utf-8", newline="")
    tok = GPT2Tokenizer()
    whole = tok.encode_ordinary(path.read_text(encoding="utf-8"))
    special = tok.encode(path.read_text(encoding="utf-8"), allowed_special="all")
    assert whole != special
    for chunk_bytes in (5, 17, 64, 1000):
        ids, _ = encode_source(tok, path, chunk_bytes=chunk_bytes)
        assert ids.tolist() == whole, chunk_bytes
        ids = np.concatenate(
            [i for i, _ in iter_token_chunks(tok, path, "error", chunk_bytes, "special")]
        )
        assert ids.tolist() == special, chunk_bytes


@needs_shared
def test_prepare_gpt2_on_real_files_equals_tiktoken_on_the_whole_text(tmp_path):
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    # the oracle: tiktoken with the independent copy of OpenAI's files in shared/data
    ranks = data_gym_to_mergeable_bpe_ranks(
        str(SHARED_DATA / "gpt2-bpe" / "vocab.bpe"), str(SHARED_DATA / "gpt2-bpe" / "encoder.json")
    )
    oracle = tiktoken.Encoding(
        "gpt2-oracle",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": 50256},
    )
    files = [WIKI / "test.txt", WIKI / "valid.txt"]  # two documents: eot after each
    meta = prepare(files, "gpt2", tmp_path / "wiki", chunk_bytes=1 << 16, log=quiet)
    expected = np.array(
        oracle.encode(WIKI.joinpath("test.txt").read_text(encoding="utf-8"))
        + [50256]
        + oracle.encode(WIKI.joinpath("valid.txt").read_text(encoding="utf-8"))
        + [50256]
    )
    tokens = load_token_dir(tmp_path / "wiki")
    assert np.array_equal(np.concatenate([tokens.train, tokens.val]), expected)
    n_train = int(0.9 * len(expected))
    assert meta["tokens"] == {"train": n_train, "val": len(expected) - n_train}
    assert [Path(s["path"]).name for s in meta["sources"]] == ["test.txt", "valid.txt"]
    assert [s["bytes"] for s in meta["sources"]] == [1_290_590, 1_146_846]  # SOURCES.md
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 50_257
    assert tokens.train.dtype == np.uint16 and not tokens.train.flags.writeable


@needs_shared
def test_prepare_char_and_byte_on_tiny_shakespeare(tmp_path, capsys):
    data = SHAKESPEARE.read_bytes()  # pure ASCII: one character per byte
    n, n_train = 1_115_394, int(0.9 * 1_115_394)
    assert (
        main(
            [
                "prepare",
                "--data",
                str(SHAKESPEARE),
                "--tokenizer",
                "byte",
                "--out",
                str(tmp_path / "byte"),
            ]
        )
        == 0
    )
    tokens = load_token_dir(tmp_path / "byte")
    assert np.array_equal(tokens.train, np.frombuffer(data, np.uint8)[:n_train])
    assert np.array_equal(tokens.val, np.frombuffer(data, np.uint8)[n_train:])

    assert (
        main(
            [
                "prepare",
                "--data",
                str(SHAKESPEARE),
                "--tokenizer",
                "char",
                "--out",
                str(tmp_path / "char"),
                "--val-fraction",
                "0.25",
            ]
        )
        == 0
    )
    assert "wrote" in capsys.readouterr().out
    tokens = load_token_dir(tmp_path / "char")
    chars = sorted(set(data.decode("ascii")))
    assert len(chars) == 65 and tokens.tokenizer.chars == chars + ["\ufffd"]
    lookup = np.zeros(128, np.int64)
    lookup[[ord(c) for c in chars]] = np.arange(65)
    expected = lookup[np.frombuffer(data, np.uint8)]
    n_train = int(0.75 * n)
    assert np.array_equal(tokens.train, expected[:n_train])
    assert np.array_equal(tokens.val, expected[n_train:])
    meta = tokens.meta
    assert meta["tokens"] == {"train": n_train, "val": n - n_train}
    assert meta["vocab_size"] == 66 and meta["val_fraction"] == 0.25
    assert meta["unknown_characters"] == 0 and meta["tokenizer"]["unk_token"] == "\ufffd"
    assert meta["sources"] == [
        {
            "path": str(SHAKESPEARE.resolve()),
            "bytes": n,
            "sha256": "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
            "split": "train",
        }
    ]


def test_a_vocabulary_over_65536_ids_is_stored_as_uint32(tmp_path):
    text = "".join(chr(0x10000 + i) for i in range(70_000))  # 70,000 distinct characters
    (tmp_path / "big.txt").write_text(text, encoding="utf-8")
    meta = prepare([tmp_path / "big.txt"], "char", tmp_path / "out", log=quiet)
    tokens = load_token_dir(tmp_path / "out")
    assert meta["dtype"] == "uint32" and tokens.train.dtype == np.uint32
    assert meta["vocab_size"] == 70_001
    assert np.array_equal(np.concatenate([tokens.train, tokens.val]), np.arange(70_000))


# --- failures leave nothing half-written; clear errors --------------------------------------


def test_a_failed_prepare_leaves_no_directory_and_keeps_an_old_one(tmp_path):
    (tmp_path / "good.txt").write_text("hello world " * 100, encoding="utf-8")
    (tmp_path / "bad.txt").write_bytes(b"fine text, then \xff")
    out = tmp_path / "tokens"
    with pytest.raises(ValueError, match="offset 16"):
        prepare([tmp_path / "good.txt", tmp_path / "bad.txt"], "gpt2", out, log=quiet)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.txt", "good.txt"]
    prepare([tmp_path / "good.txt"], "byte", out, log=quiet)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ValueError, match="offset 16"):
        prepare([tmp_path / "bad.txt"], "char", out, overwrite=True, log=quiet)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.txt", "good.txt", "tokens"]
    prepare([tmp_path / "good.txt"], "char", out, overwrite=True, log=quiet)
    assert load_token_dir(out).tokenizer.kind == "char"


def test_prepare_user_mistakes_are_one_line_errors(tmp_path, capsys):
    good, empty, latin1 = tmp_path / "good.txt", tmp_path / "empty.txt", tmp_path / "latin1.txt"
    good.write_text("some text " * 10, encoding="utf-8")
    empty.write_text("")
    latin1.write_bytes("café au lait".encode("latin-1"))
    out = str(tmp_path / "out")
    one_line_error(capsys, ["prepare", "--data", str(empty), "--out", out], "is empty")
    one_line_error(
        capsys,
        ["prepare", "--data", str(latin1), "--out", out],
        "invalid byte at offset 3",
        "--tokenizer byte",
    )
    one_line_error(
        capsys, ["prepare", "--data", str(tmp_path / "nope.txt"), "--out", out], "not found"
    )
    one_line_error(capsys, ["prepare", "--data", str(good), "--out", str(good)], "is a file")
    one_line_error(
        capsys,
        ["prepare", "--data", str(good), "--out", out, "--val-fraction", "1.5"],
        "val_fraction must be in [0, 1)",
    )
    one_line_error(capsys, ["prepare", "--data", str(tmp_path), "--out", out], "is empty")
    assert not Path(out).exists()
    assert main(["prepare", "--data", str(latin1), "--tokenizer", "byte", "--out", out]) == 0
    one_line_error(capsys, ["prepare", "--data", str(good), "--out", out], "--overwrite")
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "notes.md").write_text("mine")
    one_line_error(
        capsys,
        ["prepare", "--data", str(good), "--out", str(tmp_path / "keep"), "--overwrite"],
        "refusing to replace it",
    )
    # never the network in tests: only the error of the package's absence
    if importlib.util.find_spec("datasets") is None:
        one_line_error(
            capsys,
            ["prepare", "--dataset", "wikitext-2-raw-v1", "--out", out + "2"],
            "`datasets` package",
        )


# --- batches from memmaps -------------------------------------------------------------------


MEMORY_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    import numpy as np, torch
    from decoderlm import DecoderLM, ModelConfig
    from decoderlm.data.corpus import get_batch, load_token_dir
    from decoderlm.evaluate import evaluate

    directory, headroom = sys.argv[1], int(sys.argv[2])
    data_kb = next(int(line.split()[1]) for line in open("/proc/self/status")
                   if line.startswith("VmData:"))
    limit = data_kb * 1024 + headroom
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    tokens = load_token_dir(directory)
    try:  # the limit is real: the corpus cannot be read into memory
        np.array(tokens.train, dtype=np.int64)
        raise SystemExit("the memory limit did not stop a full copy")
    except MemoryError:
        pass
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(vocab_size=256, block_size=32, n_layers=1, n_heads=2,
                                  d_model=32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(3):
        x, y = get_batch(tokens.train, 8, 32, generator)
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    evaluate(model, tokens.val[:10_000])
    peak_kb = next(int(line.split()[1]) for line in open("/proc/self/status")
                   if line.startswith("VmHWM:"))
    print(json.dumps({"losses": losses, "limit": limit, "peak_rss": peak_kb * 1024,
                      "tokens": len(tokens.train)}))
""")


@pytest.mark.skipif(sys.platform != "linux", reason="uses RLIMIT_DATA and /proc/self/status")
def test_a_token_file_larger_than_the_memory_limit_trains(tmp_path):
    # RLIMIT_DATA bounds the process's private memory (heap, anonymous mmaps) but not a
    # read-only file mapping: the 4 GiB corpus (sparse on disk) trains within 256 MiB of
    # headroom only if batches copy just their windows.
    out = tmp_path / "big"
    out.mkdir()
    n_train, n_val = 2 * 2**30, 4096  # uint16 tokens: train.bin is 4 GiB
    rng = np.random.default_rng(0)
    with open(out / "train.bin", "wb") as f:
        f.truncate(n_train * 2)
        for offset in np.linspace(0, n_train * 2 - 2**16, 64).astype(np.int64) // 2 * 2:
            f.seek(int(offset))
            f.write(rng.integers(0, 256, 2**15, dtype=np.uint16).tobytes())
    (out / "val.bin").write_bytes(rng.integers(0, 256, n_val, dtype=np.uint16).tobytes())
    (out / "meta.json").write_text(
        json.dumps(
            {
                "tokenizer": {"type": "byte"},
                "vocab_size": 256,
                "dtype": "uint16",
                "tokens": {"train": n_train, "val": n_val},
            }
        )
    )
    headroom = 256 * 2**20
    src = Path(__file__).resolve().parents[2] / "src"
    result = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, str(out), str(headroom)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(src), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["tokens"] == n_train
    assert all(math.isfinite(v) for v in report["losses"])
    file_size = n_train * 2
    assert report["limit"] < file_size and report["peak_rss"] < file_size / 4


def test_a_token_dir_without_validation_tokens_is_noted_and_refused_by_train(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("hello world, " * 200, encoding="utf-8")
    out = tmp_path / "tok"
    assert main(["prepare", "--data", str(text), "--out", str(out), "--val-fraction", "0"]) == 0
    assert "--val-fraction 0 leaves val.bin empty" in capsys.readouterr().out
    one_line_error(
        capsys,
        [
            "train",
            "--data",
            str(out),
            "--out",
            str(tmp_path / "run"),
            "--max-steps",
            "2",
            "--no-progress",
        ],
        "has no validation tokens",
        "--val-fraction 0.1",
    )
    assert not (tmp_path / "run").exists()


# --- documents, separators and split layouts ------------------------------------------------


def _tiktoken_gpt2():
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    from decoderlm.tokenizers import GPT2_BPE_DIR

    ranks = data_gym_to_mergeable_bpe_ranks(
        str(GPT2_BPE_DIR / "vocab.bpe"), str(GPT2_BPE_DIR / "encoder.json")
    )
    return tiktoken.Encoding(
        "gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 50256}
    )


def _files(tmp_path, **texts):
    for name, text in texts.items():
        (tmp_path / name.replace("_", ".")).write_text(text, encoding="utf-8")
    return [tmp_path / name.replace("_", ".") for name in texts]


def _stream(directory):
    tokens = load_token_dir(directory)
    return np.concatenate([tokens.train, tokens.val]).tolist()


def test_prepare_several_files_appends_end_of_text_after_each_like_nanogpt(tmp_path):
    a, b = _files(tmp_path, a_txt="First doc.<|endoftext|>\n", b_txt="Second one.\n")
    enc = _tiktoken_gpt2()
    meta = prepare([a, b], "gpt2", tmp_path / "g", val_fraction=0.2, log=quiet)
    # nanoGPT's openwebtext/prepare.py: encode_ordinary(text) then append eot_token per doc
    expect = enc.encode_ordinary(a.read_text()) + [50256] + enc.encode_ordinary(b.read_text())
    assert _stream(tmp_path / "g") == expect + [50256]
    assert meta["documents"] == {"count": 2, "separator": 50256, "endoftext": "text"}
    # one file: one document, nothing appended; the text's separators are special only if asked
    prepare([a], "gpt2", tmp_path / "s", endoftext="special", log=quiet)
    assert _stream(tmp_path / "s") == enc.encode(a.read_text(), allowed_special="all")
    assert 50256 in _stream(tmp_path / "s")


def test_prepare_char_gets_end_of_text_only_when_asked(tmp_path, capsys):
    a, b = _files(tmp_path, a_txt="abc\n", b_txt="cab\n")
    prepare([a, b], "char", tmp_path / "plain", val_fraction=0.2, log=quiet)
    chars = sorted(set("abc\n"))  # the vocabulary, independently: code-point order
    assert _stream(tmp_path / "plain") == [chars.index(c) for c in "abc\ncab\n"]
    assert load_token_dir(tmp_path / "plain").tokenizer.eot_token is None
    meta = prepare([a, b], "char", tmp_path / "eot", val_fraction=0.2, eot=True, log=quiet)
    eot = load_token_dir(tmp_path / "eot").tokenizer.eot_token
    assert eot == len(chars) + 1 == meta["vocab_size"] - 1  # after the chars and U+FFFD
    ids = [chars.index(c) for c in "abc\n"] + [eot] + [chars.index(c) for c in "cab\n"] + [eot]
    assert _stream(tmp_path / "eot") == ids
    prepare([a, b], "byte", tmp_path / "byte", val_fraction=0.2, eot=True, log=quiet)
    assert _stream(tmp_path / "byte") == [*b"abc\n", 256, *b"cab\n", 256]
    one_line_error(
        capsys,
        ["prepare", "--data", str(a), "--out", str(tmp_path / "x"), "--endoftext", "special"],
        "no end-of-text token",
        "--eot",
    )


@pytest.mark.parametrize("names", [("train.txt", "valid.txt", "test.txt"), WIKITEXT_NAMES])
def test_prepare_keeps_the_splits_of_a_train_valid_test_directory(tmp_path, capsys, names):
    d = tmp_path / "corpus"
    d.mkdir()
    for name, text in zip(names, ["train text\n", "valid text\n", "TEST ONLY\n"], strict=True):
        (d / name).write_text(text, encoding="utf-8")
    assert main(["prepare", "--data", str(d), "--out", str(tmp_path / "tok")]) == 0
    out = capsys.readouterr().out
    tokens = load_token_dir(tmp_path / "tok")
    assert tokens.tokenizer.decode(tokens.train) == "train text\n"
    assert tokens.tokenizer.decode(tokens.val) == "valid text\n"
    assert not set("TESONLY") & set(tokens.tokenizer.chars)  # the test file was never read
    assert f"{names[0]}: train" in out and f"{names[1]}: val" in out
    assert f"{names[2]}: not used" in out
    # a test split without a train split is refused, never trained on
    (d / names[0]).unlink()
    one_line_error(
        capsys,
        ["prepare", "--data", str(d), "--out", str(tmp_path / "t2")],
        f"no {names[0]}",
        names[1],
    )


def test_endoftext_in_the_text_is_text_special_or_refused_in_one_line(tmp_path, capsys):
    text = "ab<|endoftext|>ba\n" * 40  # chunks of 7 characters cut the token in every place
    (tmp_path / "c.txt").write_text(text, encoding="utf-8")
    tok = make_tokenizer("char", text, eot=True)
    for mode, want in (
        ("text", tok.encode_ordinary(text)),
        ("special", tok.encode(text, allowed_special="all")),
    ):
        ids = [i for i, _ in iter_token_chunks(tok, tmp_path / "c.txt", "error", 7, mode)]
        assert np.concatenate(ids).tolist() == want, mode
    assert tok.eot_token in tok.encode(text, allowed_special="all")
    one_line_error(
        capsys,
        ["prepare", "--data", str(tmp_path / "c.txt"), "--out", str(tmp_path / "x")]
        + ["--tokenizer", "gpt2", "--endoftext", "error"],
        "holds the special token '<|endoftext|>' at character 2",
        "--endoftext special",
    )
    assert not (tmp_path / "x").exists()
    one_line_error(  # a char vocabulary without --eot has no such token: no error could come
        capsys,
        ["prepare", "--data", str(tmp_path / "c.txt"), "--out", str(tmp_path / "x")]
        + ["--tokenizer", "char", "--endoftext", "error"],
        "--endoftext error: a char vocabulary has no end-of-text token; add --eot",
    )
    assert not (tmp_path / "x").exists()
