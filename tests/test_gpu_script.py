"""benchmarks/gpu.sh and its Python parts: the script parses, and the parts it runs without a
GPU (tiny CPU fallbacks) work and print their figures."""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def gpu_step(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu_step

    return gpu_step


def _args(**overrides):
    base = dict(dtype="bfloat16", batch=2, steps=2, new_tokens=8, no_compile=True, tiny=True)
    return argparse.Namespace(**{**base, **overrides})


def test_gpu_script_is_valid_bash_and_falls_back_without_a_gpu():
    assert subprocess.run(["bash", "-n", str(BENCHMARKS / "gpu.sh")]).returncode == 0
    text = (BENCHMARKS / "gpu.sh").read_text()
    assert "torch.cuda.is_available()" in text and "--tiny" in text


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_train_part_runs_on_the_cpu(gpu_step, capsys, dtype):
    gpu_step.train_part(_args(dtype=dtype))
    out = capsys.readouterr().out
    assert "tokens/s" in out and "MFU" in out
    if dtype == "float16":
        assert "GradScaler scale" in out


def test_generate_part_agrees_with_transformers_on_the_cpu(gpu_step, capsys):
    pytest.importorskip("transformers")
    gpu_step.generate_part(_args())
    assert "same tokens: True" in capsys.readouterr().out


def test_fsdp_part_refuses_to_run_outside_torchrun():
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_step.py"), "fsdp", "--tiny"],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0 and "torchrun" in result.stderr
