"""The training loop (decoderlm.training.loop): gradient accumulation, validation estimates,
printing."""

import pytest
import torch

from decoderlm import DecoderLM
from decoderlm.config import TrainConfig
from decoderlm.data.corpus import windows
from decoderlm.training.loop import train

from conftest import tiny_config


def trained(data, val, batch_size: int, accumulation: int, max_steps: int, eval_interval: int):
    """(TrainResult, model): TINY (seed 0) trained by AdamW at a constant lr 1e-3 in float32,
    unclipped, logging every step."""
    torch.manual_seed(0)
    model = DecoderLM(tiny_config())
    cfg = TrainConfig.from_dict(
        dict(
            batch_size=batch_size,
            grad_accum_steps=accumulation,
            max_steps=max_steps,
            optimizer="adamw",
            lr=1e-3,
            schedule="constant",
            grad_clip=None,
            dtype="float32",
            log_interval=1,
            eval_interval=eval_interval,
            eval_batches=1,
        )
    )
    return train(model, cfg, data, val, progress=False), model


def test_gradient_accumulation_equals_one_larger_batch():
    data = torch.randint(0, 65, (3000,), generator=torch.Generator().manual_seed(1))
    runs = []
    for batch_size, accumulation in ((8, 1), (4, 2), (2, 4)):
        result, model = trained(data[:2700], data[2700:], batch_size, accumulation, 4, 100)
        runs.append(([r["train_loss"] for r in result.metrics], model.state_dict()))
    for losses, state in runs[1:]:
        assert losses == pytest.approx(runs[0][0], abs=1e-6)
        for name, value in state.items():
            torch.testing.assert_close(value, runs[0][1][name], atol=1e-4, rtol=0)


def test_the_validation_estimate_does_not_depend_on_the_micro_batch_split():
    data = torch.randint(0, 65, (6000,), generator=torch.Generator().manual_seed(2))
    val = data[:3000]  # 93 windows of 32: more than one step's 32, so the count matters
    estimates = []
    for batch_size, accumulation in ((32, 1), (8, 4)):
        result, model = trained(data[3000:], val, batch_size, accumulation, 2, 1)
        estimates.append([r["val_loss"] for r in result.metrics])
        with torch.no_grad():  # the estimate is that of the first 32 windows spread evenly
            starts = torch.linspace(0, 92, 32).long() * 32
            x, y = windows(val, starts, 32)
            assert estimates[-1][-1] == pytest.approx(float(model.eval()(x, y)[1]), abs=1e-5)
    assert estimates[1] == pytest.approx(estimates[0], abs=1e-5)


def test_progress_false_prints_nothing(capsys):
    data = torch.randint(0, 65, (2000,), generator=torch.Generator().manual_seed(3))
    cfg = TrainConfig.from_dict(
        dict(batch_size=2, max_steps=2, log_interval=1, eval_interval=1, eval_batches=1)
    )
    for progress in (False, True):
        torch.manual_seed(0)
        result = train(DecoderLM(tiny_config()), cfg, data[:1500], data[1500:], progress=progress)
        out, err = capsys.readouterr()
        assert [r["step"] for r in result.metrics if "val_loss" in r] == [1, 2]
        if not progress:
            assert out == "" and err == ""
    assert "val " in out + err  # the evaluation lines, shown with progress


@pytest.mark.parametrize("n_val,calls", [(600, 1), (3000, 2)])
def test_the_whole_split_is_evaluated_once_at_the_end(monkeypatch, n_val, calls):
    """When the last step's estimate already covers every validation window (18 windows of
    32 <= one batch of 32), it is the final loss; with 93 windows the whole split is
    evaluated after it. Either way the final loss is that of the whole split."""
    from decoderlm.evaluate import evaluate
    from decoderlm.training import loop

    counted = []
    monkeypatch.setattr(loop, "evaluate", lambda *a, **k: counted.append(1) or evaluate(*a, **k))
    data = torch.randint(0, 65, (5000,), generator=torch.Generator().manual_seed(4))
    result, model = trained(data[:2000], data[2000 : 2000 + n_val], 32, 1, 2, 10)
    assert len(counted) == calls
    assert result.val_loss == evaluate(model, data[2000 : 2000 + n_val], None, 32)
