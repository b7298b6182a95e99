"""The learning-rate schedule (decoderlm.training.optim)."""

import math

import pytest

from decoderlm.config import TrainConfig
from decoderlm.training.optim import lr_at


def test_cosine_schedule_matches_the_formula():
    cfg = TrainConfig.from_dict(
        dict(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110, schedule="cosine")
    )
    assert lr_at(0, cfg) == pytest.approx(1e-4)
    assert lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(10, cfg) == pytest.approx(1e-3)
    mid = 10 + 99 / 2
    assert lr_at(int(mid), cfg) == pytest.approx(
        1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * (int(mid) - 10) / 99))
    )
    assert lr_at(109, cfg) == pytest.approx(1e-4)
    constant = TrainConfig.from_dict(dict(lr=2e-4, min_lr=2e-4, schedule="constant"))
    assert lr_at(50, constant) == 2e-4
