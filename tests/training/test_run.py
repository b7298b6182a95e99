"""Whole runs (decoderlm.training.run): training on a prepared token directory."""

import json

import pytest
import torch

from decoderlm import DecoderLM
from decoderlm.data.prepare import prepare
from decoderlm.evaluate import evaluate_run
from decoderlm.io.hf_gpt2 import save_gpt2
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
        no_progress=True,
        log=quiet,
    )
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["data_spec"]["token_dir"] == str((tmp_path / "tokens").resolve())
    assert config["model"]["vocab_size"] == {"byte": 256, "gpt2": 50257}[kind]
    assert json.loads((tmp_path / "run" / "decoderlm_tokenizer.json").read_text())["type"] == kind
    report = evaluate_run(tmp_path / "run", split="val")
    assert report["nats_per_token"] == pytest.approx(summary.val_loss, rel=1e-6)


def test_a_larger_vocab_size_pads_and_a_smaller_one_is_refused(tmp_path):
    # nanoGPT's 50,304 rows for GPT-2's 50,257 tokens: trained, sampled and exported
    transformers = pytest.importorskip("transformers")
    source = tmp_path / "text.txt"
    source.write_text(TEXT * 3, encoding="utf-8")
    prepare([source], "gpt2", tmp_path / "tokens", log=quiet)
    common = dict(data=tmp_path / "tokens", train_overrides=FAST, device="cpu", log=quiet)
    common["preset"] = "classic"  # GPT-2's architecture: the run exports to the GPT-2 format
    small = {**SMALL, "activation": "gelu_tanh"}
    with pytest.raises(ValueError, match="smaller than the tokenizer's 50257 tokens"):
        run_experiment(
            out=tmp_path / "no", model_overrides={**small, "vocab_size": 50000}, **common
        )
    assert not (tmp_path / "no").exists()
    run = tmp_path / "run"
    run_experiment(
        out=run, model_overrides={**small, "vocab_size": 50304}, no_progress=True, **common
    )
    config = json.loads((run / "config.json").read_text())["model"]
    assert config["vocab_size"] == 50257 and config["padded_vocab_size"] == 50304
    model = DecoderLM.from_pretrained(run)
    assert model.tok_emb.weight.shape == (50304, 16)
    assert (run / "samples.txt").read_text(encoding="utf-8")  # sampled through the tokenizer
    save_gpt2(model, tmp_path / "hf")
    ref = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    idx = torch.randint(0, 50257, (1, 16))
    with torch.no_grad():
        assert (ref(idx).logits - model(idx)[0]).abs().max() < 1e-4


def test_a_one_process_run_imports_neither_distributed_checkpoint_nor_matplotlib(tmp_path):
    """The start-up cost of a short run: torch.distributed.checkpoint is for torchrun runs,
    matplotlib is the plots' child process's (checked in a fresh process: these tests' own
    imports would hide them). FSDP is not checked: torch._dynamo imports it, and every
    torch.optim optimizer imports torch._dynamo."""
    import subprocess
    import sys

    source = tmp_path / "text.txt"
    source.write_text(TEXT, encoding="utf-8")
    script = (
        "import sys\n"
        "from decoderlm.training.run import run_experiment\n"
        f"run_experiment(data={str(source)!r}, out={str(tmp_path / 'run')!r}, device='cpu',\n"
        f"    model_overrides={SMALL!r}, train_overrides={FAST!r}, no_progress=True,\n"
        "    log=lambda *a: None)\n"
        "watched = ('torch.distributed.checkpoint', 'matplotlib')\n"
        "print(sorted(m for m in watched if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    assert (tmp_path / "run" / "attention.png").stat().st_size > 0
    assert (tmp_path / "run" / "checkpoints").is_dir()
