"""--threads: parsing, a fixed count, and "auto" leaving the model and every RNG untouched."""

import contextlib

import pytest
import torch

from decoderlm.config import TrainConfig
from decoderlm.training.threads import parse_threads, set_threads, thread_candidates

from conftest import one_line_error, tiny_model


@pytest.fixture(autouse=True)
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_parse_threads_takes_auto_and_positive_integers_only(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    assert [parse_threads(v) for v in (None, "auto", "2", 3)] == [None, "auto", 2, 3]
    for bad in ("0", "-1", "two", True, 1.5):
        with pytest.raises(ValueError, match="--threads must be auto or a positive integer"):
            parse_threads(bad)
    with pytest.raises(ValueError, match="--threads 5 is more than this machine's 4 CPUs"):
        parse_threads("5")


def test_a_fixed_count_is_set():
    model = tiny_model()
    assert set_threads("1", model, TrainConfig(), None, contextlib.nullcontext) == 1
    assert torch.get_num_threads() == 1


def test_auto_picks_a_candidate_and_changes_no_weight_gradient_or_rng():
    model = tiny_model(dropout=0.1).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    lines = []
    data = torch.randint(0, 65, (500,), generator=torch.Generator().manual_seed(0))
    chosen = set_threads(
        "auto", model, TrainConfig(batch_size=2), data, contextlib.nullcontext, lines.append
    )
    assert chosen in thread_candidates() and torch.get_num_threads() == chosen
    assert len(lines) == 1 and lines[0].startswith(f"threads: auto chose {chosen}")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and not model.training
    assert torch.equal(torch.get_rng_state(), rng)


def test_bad_threads_flag_is_one_line_before_anything_is_written(capsys, tmp_path):
    one_line_error(
        capsys, ["train", "--out", str(tmp_path / "run"), "--threads", "many"], "--threads"
    )
    assert not (tmp_path / "run").exists()
