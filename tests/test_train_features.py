"""Training settings: prepared token directories, settings files with overrides, gradient
accumulation, activation checkpointing and torch.compile."""

import json
import math

import pytest
import torch

from conftest import tiny_config
from decoderlm import DecoderLM
from decoderlm.cli import main
from decoderlm.config import TrainConfig
from decoderlm.evaluation import evaluate_run
from decoderlm.prepare import prepare
from decoderlm.train import run_experiment, train

TEXT = "".join(chr(33 + (i * 7919) % 60) for i in range(3000)) + " caf\u00e9 \u6771\u4eac\n" * 20
SMALL = dict(n_layers=1, n_heads=2, d_model=16, block_size=16)
FAST = dict(max_steps=4, eval_interval=2, batch_size=4, sample_chars=5, log_interval=1)


def quiet(*args, **kwargs):
    pass


@pytest.mark.parametrize("kind", ["byte", "gpt2"])
def test_training_reads_a_prepared_token_directory(tmp_path, kind):
    source = tmp_path / "text.txt"
    source.write_text(TEXT * (3 if kind == "gpt2" else 1), encoding="utf-8")
    prepare([source], kind, tmp_path / "tokens", log=quiet)
    summary = run_experiment("seed-notebook", data=tmp_path / "tokens", out=tmp_path / "run",
                             model_overrides=SMALL, train_overrides=FAST, device="cpu",
                             progress=False, log=quiet)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["data_spec"]["token_dir"] == str((tmp_path / "tokens").resolve())
    assert config["model"]["vocab_size"] == {"byte": 256, "gpt2": 50257}[kind]
    assert json.loads((tmp_path / "run" / "tokenizer.json").read_text())["type"] == kind
    report = evaluate_run(tmp_path / "run", split="val")
    assert report["nats_per_token"] == pytest.approx(summary.val_loss, rel=1e-6)


def test_settings_file_then_command_line_overrides(tmp_path, capsys):
    data = tmp_path / "text.txt"
    data.write_text(TEXT, encoding="utf-8")
    settings = tmp_path / "run.toml"
    settings.write_text(f'preset = "seed-notebook"\ndata = "{data}"\nout = "{tmp_path / "run"}"\n'
                        "[model]\nn_layers = 1\nn_heads = 2\nd_model = 16\nblock_size = 16\n"
                        "[train]\nmax_steps = 3\nbatch_size = 4\nlr = 0.01\n"
                        "grad_accum_steps = 2\n", encoding="utf-8")
    assert main(["train", "--config", str(settings), "--max-steps", "5", "--no-progress"]) == 0
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["preset"] == "seed-notebook" and config["model"]["n_layers"] == 1
    assert config["train"]["max_steps"] == 5 and config["train"]["lr"] == 0.01  # flag wins
    assert config["train"]["grad_accum_steps"] == 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert records[-1]["tokens"] == 5 * 4 * 2 * 16  # steps * batch * accumulation * T

    for text, message in (("[train]\nmax_step = 3\n", "unknown setting 'train.max_step'"),
                          ("max_steps = 3\n", "unknown setting 'max_steps'"),
                          ("[model\n", "does not parse"),
                          ("[train]\ndtype = 'float8'\n",
                           "--dtype: expected one of float32, bfloat16, float16")):
        settings.write_text(text, encoding="utf-8")
        assert main(["train", "--config", str(settings), "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("decoderlm: error:") and message in err, err


def test_gradient_accumulation_equals_one_larger_batch():
    data = torch.randint(0, 65, (3000,), generator=torch.Generator().manual_seed(1))
    runs = []
    for batch_size, accumulation in ((8, 1), (4, 2), (2, 4)):
        torch.manual_seed(0)
        model = DecoderLM(tiny_config())
        cfg = TrainConfig(batch_size=batch_size, grad_accum_steps=accumulation, max_steps=4,
                          lr=1e-3, log_interval=1, eval_interval=100, eval_batches=1)
        result = train(model, cfg, data[:2700], data[2700:], progress=False)
        runs.append(([r["train_loss"] for r in result.metrics], model.state_dict()))
    for losses, state in runs[1:]:
        assert losses == pytest.approx(runs[0][0], abs=1e-6)
        for name, value in state.items():
            torch.testing.assert_close(value, runs[0][1][name], atol=1e-4, rtol=0)


def test_activation_checkpointing_gives_the_same_gradients_and_saves_less():
    torch.manual_seed(0)
    model = DecoderLM(tiny_config()).train()
    idx = torch.randint(0, 65, (4, 32))
    grads, saved = [], []
    for checkpointing in (False, True):
        model.activation_checkpointing = checkpointing
        model.zero_grad()
        sizes = []

        def pack(t, sizes=sizes):
            sizes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _, loss = model(idx, idx)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        saved.append(sum(sizes))
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-5)
    assert saved[1] < saved[0] / 2  # only each block's input (and the head) is kept


def test_compiled_training_matches_eager(tmp_path):
    data = torch.randint(0, 65, (2000,), generator=torch.Generator().manual_seed(2))
    losses = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = DecoderLM(tiny_config(n_layers=1))
        cfg = TrainConfig(batch_size=4, max_steps=3, lr=1e-3, log_interval=1,
                          eval_interval=100, eval_batches=1, compile=compiled)
        result = train(model, cfg, data[:1800], data[1800:], progress=False)
        losses.append([r["train_loss"] for r in result.metrics])
    assert all(math.isfinite(v) for v in losses[1])
    assert losses[1] == pytest.approx(losses[0], abs=1e-4)


def test_settings_with_wrong_types_and_options_that_do_not_apply(tmp_path, capsys):
    data = tmp_path / "text.txt"
    data.write_text(TEXT, encoding="utf-8")
    prepare([data], "byte", tmp_path / "tokens", log=quiet)
    settings = tmp_path / "run.toml"
    for text, message in (("data = 5\n", "--data: expected a non-empty string or none, got '5'"),
                          ("max_chars = 'abc'\n", "--max-chars: expected an integer >= 0"),
                          ("[train]\nsample_prompt = 5\n", "--sample-prompt: expected text"),
                          ("[train]\nlr = 'fast'\n", "--lr: expected a number, got 'fast'"),
                          ("train = 5\n", "`train` in the settings file must map fields")):
        settings.write_text(text, encoding="utf-8")
        assert main(["train", "--config", str(settings), "--out", str(tmp_path / "x")]) == 2
        assert message in capsys.readouterr().err
    assert main(["train", "--config", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert "--config: Path is not a file" in capsys.readouterr().err
    assert main(["train", "--data", str(tmp_path / "tokens"), "--max-chars", "100",
                 "--out", str(tmp_path / "x")]) == 2
    assert "do not apply to a prepared token directory" in capsys.readouterr().err
