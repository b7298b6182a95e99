"""The evaluation loss and `decoderlm eval` (decoderlm.evaluate)."""

import json
import math

import pytest
import torch

import decoderlm.data.corpus as data_module
from decoderlm import DecoderLM, load_tokenizer
from decoderlm.cli import main
from decoderlm.data.corpus import EMBEDDED_CORPUS, load_token_dir
from decoderlm.data.prepare import prepare
from decoderlm.evaluate import evaluate, evaluate_run, score_window_starts, token_logprobs
from decoderlm.tokenizers import DEFAULT_UNK_TOKEN
from decoderlm.training.run import run_experiment

from conftest import SMALL, SMALL_TRAIN, WIKI, needs_shared, one_line_error, quiet, tiny_model


def test_evaluate_is_deterministic_and_restores_train_mode():
    model = tiny_model(dropout=0.2).train()
    data = torch.randint(0, 65, (500,))
    a, b = evaluate(model, data), evaluate(model, data)
    assert a == b and model.training
    T = model.config.block_size
    n = (len(data) - 1) // T
    windows = data[: n * T + 1]
    x = torch.stack([windows[i * T : (i + 1) * T] for i in range(n)])
    y = torch.stack([windows[i * T + 1 : (i + 1) * T + 1] for i in range(n)])
    model.eval()
    assert a == pytest.approx(model(x, y)[1].item(), rel=1e-6)


@pytest.fixture(scope="module")
def crop_runs(tmp_path_factory):
    """Two tiny character models trained briefly on the shipped crop: with an unknown token in
    the vocabulary (what `decoderlm train` builds) and without one (as in first-format run
    directories)."""
    root = tmp_path_factory.mktemp("runs")
    with_unk = run_experiment(
        "seed-notebook",
        out=root / "unk",
        model_overrides=SMALL,
        train_overrides=SMALL_TRAIN,
        device="cpu",
        no_progress=True,
        log=quiet,
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(data_module, "DEFAULT_UNK_TOKEN", None)
        plain = run_experiment(
            "seed-notebook",
            out=root / "plain",
            model_overrides=SMALL,
            train_overrides=SMALL_TRAIN,
            device="cpu",
            no_progress=True,
            log=quiet,
        )
    assert load_tokenizer(with_unk.out_dir).unk_token == DEFAULT_UNK_TOKEN
    assert load_tokenizer(plain.out_dir).unk_token is None
    return with_unk, plain


def test_eval_val_split_is_the_runs_final_validation_loss(crop_runs, capsys):
    _, plain = crop_runs
    report = evaluate_run(plain.out_dir)
    assert report["nats_per_token"] == pytest.approx(plain.val_loss, rel=1e-6)
    n_val = 300_000 - int(0.9 * 300_000)
    assert report["tokens"] == n_val and report["windows"] == (n_val - 1) // 32
    assert report["tokens_scored"] == report["windows"] * 32
    assert report["bits_per_char"] == pytest.approx(plain.val_loss / math.log(2))
    assert report["perplexity"] == pytest.approx(math.exp(plain.val_loss))
    assert main(["eval", "--run", str(plain.out_dir), "--split", "train", "--json"]) == 0
    train_report = json.loads(capsys.readouterr().out)
    assert train_report["split"] == "train" and train_report["tokens"] == 270_000


@needs_shared
def test_eval_on_wikitext_test_maps_unknown_characters_to_the_unknown_token(crop_runs, capsys):
    with_unk, plain = crop_runs
    test_text = (WIKI / "test.txt").read_text(encoding="utf-8")
    crop = set(EMBEDDED_CORPUS.read_text(encoding="utf-8"))
    expected_unknown = sum(1 for c in test_text if c not in crop)  # the oracle
    assert expected_unknown > 0
    argv = ["eval", "--run", str(with_unk.out_dir), "--data", str(WIKI / "test.txt")]
    assert main([*argv, "--batch-size", "512"]) == 0
    out = capsys.readouterr().out
    assert f"unknown characters: {expected_unknown:,} (mapped to the unknown token '\ufffd')" in out
    assert main([*argv, "--batch-size", "512", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["unknown_characters"] == expected_unknown
    assert report["tokens"] == len(test_text) and math.isfinite(report["nats_per_token"])
    # the oracle: ids made without the tokenizer's encode, scored by the same windows
    tok = load_tokenizer(with_unk.out_dir)
    ids = torch.tensor([tok.stoi.get(c, tok.chars.index("\ufffd")) for c in test_text])
    model = DecoderLM.from_pretrained(with_unk.out_dir)
    assert report["nats_per_token"] == pytest.approx(evaluate(model, ids, batch_size=512), rel=1e-6)
    # the run without an unknown token says so instead of crashing
    one_line_error(
        capsys,
        ["eval", "--run", str(plain.out_dir), "--data", str(WIKI / "test.txt")],
        "no unknown token",
        "'杜' at position",
    )


def test_eval_errors_are_clear(crop_runs, tmp_path, capsys):
    _, plain = crop_runs
    run = tmp_path / "run"
    run.mkdir()
    for path in plain.out_dir.iterdir():
        if path.is_file():
            (run / path.name).write_bytes(path.read_bytes())
    short = tmp_path / "short.txt"
    short.write_text("The cat", encoding="utf-8")
    one_line_error(
        capsys, ["eval", "--run", str(run), "--data", str(short)], "needs block_size + 1 = 33"
    )
    one_line_error(
        capsys, ["eval", "--run", str(run), "--data", str(short), "--split", "val"], "scored whole"
    )
    prepare([short], "byte", tmp_path / "bytes", log=quiet)
    one_line_error(
        capsys,
        ["eval", "--run", str(run), "--data", str(tmp_path / "bytes")],
        "prepared with another tokenizer",
    )
    config = json.loads((run / "config.json").read_text())
    del config["data_spec"]
    (run / "config.json").write_text(json.dumps(config))
    one_line_error(capsys, ["eval", "--run", str(run)], "no 'data_spec'", "--data PATH")
    one_line_error(capsys, ["eval", "--run", str(tmp_path / "nowhere")], "not found")
    not_utf8 = tmp_path / "latin1.txt"
    not_utf8.write_bytes("caf\u00e9 au lait, the cat sat on the mat all day".encode("latin-1"))
    err = one_line_error(capsys, ["eval", "--run", str(run), "--data", str(not_utf8)], "not UTF-8")
    assert err.count(str(not_utf8)) == 1, err


def test_eval_a_byte_model_on_a_prepared_token_directory(tmp_path, capsys):
    text = EMBEDDED_CORPUS.read_text(encoding="utf-8")[:5_000]
    (tmp_path / "c.txt").write_text(text, encoding="utf-8")
    prepare([tmp_path / "c.txt"], "byte", tmp_path / "tok", log=quiet)
    tokens = load_token_dir(tmp_path / "tok")
    model = tiny_model(vocab_size=256)
    model.save_pretrained(tmp_path / "run")
    tokens.tokenizer.save_pretrained(tmp_path / "run")
    assert (
        main(["eval", "--run", str(tmp_path / "run"), "--data", str(tmp_path / "tok"), "--json"])
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    data = text.encode("utf-8")
    val = torch.tensor(list(data[int(0.9 * len(data)) :]))
    assert report["split"] == "val" and report["tokens"] == len(val)
    assert report["nats_per_token"] == pytest.approx(evaluate(model, val), rel=1e-6)
    assert report["bits_per_byte"] == pytest.approx(report["nats_per_token"] / math.log(2))
    assert "bits_per_char" not in report
    # a run whose data_spec names the token directory: --split reads it
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    config["data_spec"] = {
        "path": None,
        "dataset": None,
        "max_chars": None,
        "token_dir": str(tmp_path / "tok"),
        "val_fraction": 0.1,
    }
    (tmp_path / "run" / "config.json").write_text(json.dumps(config))
    train_report = evaluate_run(tmp_path / "run", split="train")
    assert train_report["tokens"] == int(0.9 * len(data))
    assert train_report["nats_per_token"] == pytest.approx(
        evaluate(model, torch.tensor(list(data[: int(0.9 * len(data))]))), rel=1e-6
    )


@pytest.mark.parametrize("n", [2, 20, 33, 64, 65, 90])
def test_token_logprobs_score_every_token_once_in_evaluates_windows(n):
    model = tiny_model(seed=6)  # block_size 32
    ids = torch.randint(0, 65, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    lp, top_v, top_i = token_logprobs(model, ids, top_k=2)
    T, expected = 32, []
    with torch.no_grad():  # the oracle: windows of T written out
        for start in range(0, n - 1, T):
            lo = min(start, max(0, n - 1 - T))  # the tail's window ends at the last id
            window = torch.tensor([ids[lo : lo + T + 1]])
            full = torch.log_softmax(model(window[:, :-1])[0][0], -1)
            for t in range(start, min(start + T, n - 1)):
                expected.append(full[t - lo])
    expected = torch.stack(expected)
    assert torch.allclose(lp, expected.gather(1, torch.tensor(ids[1:])[:, None])[:, 0], atol=1e-5)
    assert torch.equal(top_i, expected.topk(2).indices)
    assert torch.allclose(top_v, expected.topk(2).values, atol=1e-5)
    if (n - 1) % T == 0:  # then these are exactly evaluate's windows
        assert float(-lp.mean()) == pytest.approx(evaluate(model, torch.tensor(ids)), abs=1e-5)
    assert score_window_starts(n, T)[-1] + min(T, n - 1) == n - 1


def test_eval_scores_a_gguf_file_and_a_hugging_face_directory_on_data(tmp_path, capsys):
    pytest.importorskip("gguf")  # the [export] extra
    from decoderlm import CharTokenizer

    text = "The cat sat on the mat; the dog sat on the log. " * 8
    tok = CharTokenizer.from_text(text)
    model = tiny_model(vocab_size=tok.vocab_size, activation="gelu_tanh")  # llama.cpp's GELU
    model.save_pretrained(tmp_path / "run")
    tok.save_pretrained(tmp_path / "run")
    paths = {"--run": tmp_path / "run", "--gguf": tmp_path / "m.gguf", "--hf": tmp_path / "hf"}
    for format, flag in (("gguf", "--gguf"), ("hf", "--hf")):
        argv = ["export", "--run", str(paths["--run"]), "--format", format]
        assert main([*argv, "--out", str(paths[flag])]) == 0
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    expected = evaluate(model, torch.tensor(tok.encode(text)))
    capsys.readouterr()
    for flag, path in paths.items():
        argv = ["eval", flag, str(path), "--data", str(tmp_path / "text.txt"), "--json"]
        assert main(argv) == 0, flag
        report = json.loads(capsys.readouterr().out)
        assert report["nats_per_token"] == pytest.approx(expected, rel=1e-5), flag
        assert report["run"] == str(path) and report["tokens"] == len(text)
    for flag in ("--gguf", "--hf"):  # no run, so no recorded data: --data is needed
        message = f"{flag} {paths[flag]} records no data to score; give --data PATH"
        one_line_error(capsys, ["eval", flag, str(paths[flag])], message)
    one_line_error(
        capsys, ["eval", "--run", "r", "--hf", "h", "--data", "t"], "give only one of --run"
    )


def test_eval_of_a_gpt2_bpe_run_gives_bits_per_byte(tmp_path, capsys):
    """bits/byte of a GPT-2 BPE model, against the closed form: the mean loss over the scored
    tokens (evaluate) x their count / the UTF-8 bytes of their text / ln 2, on ASCII text (one
    byte per character, so the bytes are the decoded text's length)."""
    from decoderlm.tokenizers import GPT2Tokenizer

    text = "The cat sat on the mat; the dog sat on the log. " * 12
    tok = GPT2Tokenizer()
    model = tiny_model(vocab_size=tok.vocab_size)
    model.save_pretrained(tmp_path / "run")
    tok.save_pretrained(tmp_path / "run")
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    ids = tok.encode(text)
    T = model.config.block_size
    scored = ids[1 : (len(ids) - 1) // T * T + 1]
    nats = evaluate(model, torch.tensor(ids))
    n_bytes = len(tok.decode(scored))
    assert n_bytes < len(text)  # the first token and the tail are not scored
    argv = ["eval", "--run", str(tmp_path / "run"), "--data", str(tmp_path / "text.txt")]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bytes_scored"] == n_bytes
    assert report["bits_per_byte"] == pytest.approx(nats * len(scored) / n_bytes / math.log(2))
    assert main(argv) == 0
    assert f"{report['bits_per_byte']:.4f} bits/byte" in capsys.readouterr().out
