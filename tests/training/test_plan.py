"""What a run is asked for and what it plans (decoderlm.training.plan) and its run directory
(decoderlm.training.run_dir), without training."""

import dataclasses
import hashlib

import pytest

from decoderlm.config import TrainConfig
from decoderlm.errors import UserError
from decoderlm.presets import get_preset
from decoderlm.training.parallel import DistInfo
from decoderlm.training.plan import RunRequest, make_plan
from decoderlm.training.run_dir import RUN_FILES, free_run_dir, run_files

TEXT = "The quick brown fox jumps over the lazy dog. " * 40


def test_the_request_holds_train_settings_flat_and_cannot_change():
    request = RunRequest(train_overrides={"optim": {"lr": 1e-3}, "max_steps": 7})
    assert request.train_overrides == {"lr": 1e-3, "max_steps": 7}
    assert request.model_overrides == {} and request.verify
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.out = "elsewhere"


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(resume="r", overwrite=True), "pick one"),
        (dict(resume="r", init_from="m"), "drop --init-from"),
        (dict(train_overrides=[("lr", 1e-3)]), "train_overrides must map fields"),
        (dict(model_overrides="n_layers=2"), "model_overrides must map fields"),
        (dict(train_overrides={"lrr": 1e-3}), r"unknown TrainConfig field\(s\) \['lrr'\]"),
    ],
)
def test_a_request_that_cannot_go_together_is_refused_when_made(arguments, message):
    with pytest.raises(UserError, match=message):
        RunRequest(**arguments)


def test_a_new_plan_takes_the_preset_then_the_overrides(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "text.txt"
    data.write_text(TEXT, encoding="utf-8")
    (tmp_path / "runs" / "default").mkdir(parents=True)  # taken: the plan picks the next name
    overrides = {"max_steps": 7, "optim": {"lr": 1e-3}}
    request = RunRequest(data=data, model_overrides={"n_layers": 1}, train_overrides=overrides)
    plan = make_plan(request, DistInfo(), log=lambda line: None)
    preset = get_preset("default")
    assert plan.train_cfg == TrainConfig(**{**preset.train, "max_steps": 7, "lr": 1e-3})
    assert plan.model_cfg.n_layers == 1 and plan.model_cfg.d_model == preset.model["d_model"]
    assert plan.model_cfg.vocab_size == len(set(TEXT)) + 1  # its characters and the unknown one
    assert plan.preset == "default" and plan.out_dir.as_posix() == "runs/default-2"
    assert plan.data_spec["fingerprint"] == hashlib.sha256(TEXT.encode()).hexdigest()
    assert plan.checkpoint is None and plan.start_model is None and plan.resumed_step is None
    assert plan.extra["train"] == plan.train_cfg.to_dict() and plan.extra["data"] == plan.corpus


def test_merge_without_lora_adapters_is_refused(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text(TEXT, encoding="utf-8")
    request = RunRequest(data=data, out=tmp_path / "run", merge=True)
    with pytest.raises(UserError, match="--merge merges LoRA adapters"):
        make_plan(request, DistInfo(), log=print)


def test_free_run_dir_never_names_a_taken_directory(tmp_path):
    assert free_run_dir("x", tmp_path) == tmp_path / "x"
    (tmp_path / "x").mkdir()
    (tmp_path / "x-2").write_text("a file takes the name too")
    assert free_run_dir("x", tmp_path) == tmp_path / "x-3"


def test_run_files_lists_the_runs_files_in_order_directories_marked(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    for name in ("report.json", "config.json", "notes.txt"):
        (tmp_path / name).write_text("{}")
    assert run_files(tmp_path) == ["config.json", "report.json", "checkpoints/"]
    assert RUN_FILES.index("config.json") < RUN_FILES.index("checkpoints")
