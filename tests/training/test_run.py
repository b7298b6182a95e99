"""Whole runs (decoderlm.training.run): training on a prepared token directory."""

import json

import pytest

from decoderlm.evaluate import evaluate_run
from decoderlm.prepare import prepare
from decoderlm.training.run import run_experiment

from conftest import quiet

TEXT = "".join(chr(33 + (i * 7919) % 60) for i in range(3000)) + " caf\u00e9 \u6771\u4eac\n" * 20
SMALL = dict(n_layers=1, n_heads=2, d_model=16, block_size=16)
FAST = dict(max_steps=4, eval_interval=2, batch_size=4, sample_chars=5, log_interval=1)


@pytest.mark.parametrize("kind", ["byte", "gpt2"])
def test_training_reads_a_prepared_token_directory(tmp_path, kind):
    source = tmp_path / "text.txt"
    source.write_text(TEXT * (3 if kind == "gpt2" else 1), encoding="utf-8")
    prepare([source], kind, tmp_path / "tokens", log=quiet)
    summary = run_experiment(
        "seed-notebook",
        data=tmp_path / "tokens",
        out=tmp_path / "run",
        model_overrides=SMALL,
        train_overrides=FAST,
        device="cpu",
        progress=False,
        log=quiet,
    )
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["data_spec"]["token_dir"] == str((tmp_path / "tokens").resolve())
    assert config["model"]["vocab_size"] == {"byte": 256, "gpt2": 50257}[kind]
    assert json.loads((tmp_path / "run" / "decoderlm_tokenizer.json").read_text())["type"] == kind
    report = evaluate_run(tmp_path / "run", split="val")
    assert report["nats_per_token"] == pytest.approx(summary.val_loss, rel=1e-6)
