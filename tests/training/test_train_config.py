"""TrainConfig (decoderlm.config): its sections, the flat dicts it is stored and given as, one
source of defaults (the 'default' recipe) and the presets as differences from it."""

import dataclasses
import json
from pathlib import Path

import docstring_parser
import pytest

from decoderlm.config import ArtifactsConfig, OptimConfig, TrainConfig
from decoderlm.errors import UserError
from decoderlm.presets import PRESETS, get_preset

RUN_V0 = Path(__file__).parents[1] / "fixtures" / "run_v0"

# What each preset trains with, every setting written out: the values these presets have
# always resolved to, so rewriting them as differences from the defaults changes no run.
NOTEBOOK = dict(
    batch_size=32, grad_accum_steps=1, max_steps=400, lr=2e-4, min_lr=2e-5, warmup_steps=0,
    decay_steps=None, schedule="constant", cooldown_fraction=0.2, optimizer="adamw",
    muon_lr=0.02, muon_momentum=0.95, weight_decay=1e-2, beta1=0.9, beta2=0.999,
    grad_clip=None, eval_interval=100, eval_batches=20, log_interval=10, log=[],
    peak_tflops=None, dtype="float32", compile=False, activation_checkpointing=False,
    fsdp=False, checkpoint_interval=500, keep_checkpoints=2, val_fraction=0.1, seed=1337,
    sample_chars=600, sample_prompt="T", freeze=None, lora_rank=None, lora_alpha=None,
    lora_targets="qkv", lora_dropout=0.0,
)  # fmt: skip
CLASSIC = {
    **NOTEBOOK,
    **dict(
        max_steps=1800, lr=3e-3, min_lr=3e-4, warmup_steps=100, schedule="cosine",
        weight_decay=0.1, beta2=0.99, grad_clip=1.0, dtype="auto", eval_interval=300,
    ),
}  # fmt: skip
DEFAULT = {
    **CLASSIC,
    **dict(max_steps=500, schedule="wsd", cooldown_fraction=0.4, optimizer="muon"),
    "eval_interval": 250,
}
FINETUNE = {
    **DEFAULT,
    **dict(
        optimizer="adamw", schedule="cosine", max_steps=300, lr=3e-4, min_lr=3e-5,
        warmup_steps=20, weight_decay=0.0, eval_interval=50,
    ),
}  # fmt: skip
RESOLVED = {"seed-notebook": NOTEBOOK, "classic": CLASSIC, "default": DEFAULT, "finetune": FINETUNE}


def resolved(name: str) -> TrainConfig:
    """What `decoderlm train --preset NAME` trains with (no other flag)."""
    return TrainConfig.from_dict(get_preset(name).train)


def test_the_defaults_are_what_decoderlm_train_runs():
    assert get_preset("default").train == {}
    assert TrainConfig() == resolved("default")
    assert TrainConfig().to_dict() == DEFAULT


@pytest.mark.parametrize("name", sorted(RESOLVED))
def test_each_recipe_preset_resolves_to_its_settings(name):
    assert resolved(name).to_dict() == RESOLVED[name]
    defaults = TrainConfig().to_dict()  # a preset names only what differs from them
    assert all(defaults[k] != v for k, v in get_preset(name).train.items())


def test_model_presets_train_with_the_default_recipe():
    for name, preset in PRESETS.items():
        if name not in RESOLVED:
            assert preset.train == {} and resolved(name) == TrainConfig(), name


def test_setting_names_are_unique_across_sections_and_each_is_documented():
    counts = [len(dataclasses.fields(cls)) for cls in TrainConfig.sections().values()]
    owner = TrainConfig.section_of()
    assert len(owner) == sum(counts) == len(TrainConfig().to_dict()) == 36
    assert not set(owner) & set(TrainConfig.sections())  # a section is never a setting's name
    for cls in TrainConfig.sections().values():
        docs = {p.arg_name: p.description for p in docstring_parser.parse_from_object(cls).params}
        assert set(docs) == {f.name for f in dataclasses.fields(cls)}, cls.__name__
        assert all(text and text.strip() for text in docs.values()), cls.__name__


def test_flat_and_nested_dicts_build_the_same_config_and_to_dict_is_flat():
    flat = TrainConfig.from_dict({"lr": 1e-3, "max_steps": 7, "sample_chars": 3})
    nested = TrainConfig.from_dict(
        {"optim": {"lr": 1e-3}, "steps": {"max_steps": 7}, "artifacts": {"sample_chars": 3}}
    )
    mixed = TrainConfig.from_dict({"optim": {"lr": 1e-3}, "max_steps": 7, "sample_chars": 3})
    assert flat == nested == mixed
    assert TrainConfig.flatten({"optim": {"lr": 1e-3}, "max_steps": 7}) == {
        "lr": 1e-3,
        "max_steps": 7,
    }
    assert (flat.optim.lr, flat.steps.max_steps, flat.artifacts) == (1e-3, 7, ArtifactsConfig(3))
    assert all(not isinstance(v, dict) for v in flat.to_dict().values())
    assert TrainConfig.from_dict(flat.to_dict()) == flat
    direct = TrainConfig(optim=OptimConfig(lr=1e-3))
    assert direct.optim.lr == 1e-3 and direct.steps == TrainConfig().steps


def test_settings_by_name_go_to_their_sections():
    # TrainConfig(lr=..., max_steps=...) is how Python callers write a recipe: each name lands
    # in its section, and a whole section given beside names keeps what the names don't change
    cfg = TrainConfig(lr=1e-3, max_steps=7, sample_chars=3)
    assert cfg == TrainConfig.from_dict({"lr": 1e-3, "max_steps": 7, "sample_chars": 3})
    assert (cfg.optim.lr, cfg.steps.max_steps, cfg.artifacts.sample_chars) == (1e-3, 7, 3)
    both = TrainConfig(optim=OptimConfig(lr=1e-3, weight_decay=0.5), lr=2e-3)
    assert (both.optim.lr, both.optim.weight_decay) == (2e-3, 0.5)
    with pytest.raises(UserError, match=r"unknown TrainConfig field\(s\) \['lrr'\]"):
        TrainConfig(lrr=1e-3)
    with pytest.raises(UserError, match="TrainConfig.optim must be a OptimConfig"):
        TrainConfig(optim={"lr": 1e-3})


def test_unknown_settings_are_refused_listing_the_known_ones():
    with pytest.raises(UserError, match=r"unknown TrainConfig field\(s\) \['lrr'\]; known fields"):
        TrainConfig.from_dict({"lrr": 1e-3})
    with pytest.raises(UserError, match=r"\['optim.max_steps'\].*'max_steps'"):
        TrainConfig.from_dict({"optim": {"max_steps": 3}})
    with pytest.raises(UserError, match="must be built from a dict"):
        TrainConfig.from_dict([("lr", 1e-3)])


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"lr": 0}, "lr must be a finite number > 0.0"),
        ({"batch_size": 0}, "batch_size must be a positive integer"),
        ({"schedule": "linear"}, "schedule must be one of"),
        ({"dtype": "fp8"}, "dtype must be one of"),
        ({"sample_chars": -1}, "sample_chars must be an integer >= 0"),
        ({"log": ["wandb"]}, "log must be a list of 'csv' and 'tensorboard'"),
        ({"min_lr": 1.0}, r"min_lr must be a finite number in \[0.0, 0.003\]"),
        ({"fsdp": True}, "optimizer 'muon' orthogonalises whole weight matrices"),
        ({"lora_rank": 4}, "optimizer 'muon' trains the blocks' weight matrices"),
        ({"lora_targets": " , "}, "lora_targets must be a non-empty comma-separated list"),
    ],
)
def test_a_bad_setting_is_one_clear_error_naming_it(settings, message):
    with pytest.raises(UserError, match=message):
        TrainConfig.from_dict(settings)


@pytest.mark.parametrize("style", ["gpt2-style", "llama-style"])
def test_a_stored_config_of_an_earlier_run_reads_back_as_it_trained(style):
    """config.json files without an "optimizer" entry trained with AdamW; every stored value
    comes back, and the rest are the defaults."""
    stored = json.loads((RUN_V0 / style / "config.json").read_text())["train"]
    assert "optimizer" not in stored
    cfg = TrainConfig.from_stored(stored)
    assert cfg.optim.optimizer == "adamw"
    assert {k: v for k, v in cfg.to_dict().items() if k in stored} == stored
    assert TrainConfig.from_stored(cfg.to_dict()) == cfg  # a complete one is taken as it is
