"""The training loop (decoderlm.training.loop): gradient accumulation."""

import pytest
import torch

from decoderlm import DecoderLM
from decoderlm.config import TrainConfig
from decoderlm.training.loop import train

from conftest import tiny_config


def test_gradient_accumulation_equals_one_larger_batch():
    data = torch.randint(0, 65, (3000,), generator=torch.Generator().manual_seed(1))
    runs = []
    for batch_size, accumulation in ((8, 1), (4, 2), (2, 4)):
        torch.manual_seed(0)
        model = DecoderLM(tiny_config())
        cfg = TrainConfig(
            batch_size=batch_size,
            grad_accum_steps=accumulation,
            max_steps=4,
            lr=1e-3,
            log_interval=1,
            eval_interval=100,
            eval_batches=1,
        )
        result = train(model, cfg, data[:2700], data[2700:], progress=False)
        runs.append(([r["train_loss"] for r in result.metrics], model.state_dict()))
    for losses, state in runs[1:]:
        assert losses == pytest.approx(runs[0][0], abs=1e-6)
        for name, value in state.items():
            torch.testing.assert_close(value, runs[0][1][name], atol=1e-4, rtol=0)
