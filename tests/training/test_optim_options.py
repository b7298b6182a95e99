"""The optimiser and schedule options of decoderlm.training.optim: Muon for the blocks' weight
matrices with AdamW for the rest, the warm-up-stable-decay schedule, and exact resume with
every option of a modern recipe on."""

import copy
import math

import pytest
import test_state
import torch
from test_state import assert_same_run, cli, train_argv

from decoderlm.config import TrainConfig
from decoderlm.model.weights import list_checkpoints
from decoderlm.training import optim
from decoderlm.training.checkpoints import load_trainer_state
from decoderlm.training.optim import (
    MuonWithAdamW,
    configure_optimizer,
    lr_at,
    muon_parameters,
    set_lr,
)

from conftest import one_line_error, tiny_model

corpus, one_thread = test_state.corpus, test_state.one_thread  # its fixtures, shared here

# Muon at a constant lr, AdamW with torch's default betas for the rest
MUON = dict(
    optimizer="muon", lr=1e-3, muon_lr=0.01, weight_decay=0.0, schedule="constant", beta2=0.999
)


def _backward(model):
    x = torch.randint(0, 65, (4, 32), generator=torch.Generator().manual_seed(0))
    _, loss = model.train()(x, torch.roll(x, -1, 1))
    loss.backward()


def test_muon_gets_exactly_the_blocks_linear_weights_chosen_by_module():
    model = tiny_model(tie_embeddings=False, mlp="swiglu")
    names = {id(p): n for n, p in model.named_parameters()}
    chosen = sorted(names[id(p)] for p in muon_parameters(model))
    kinds = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.gate", "mlp.proj")
    assert chosen == sorted(f"blocks.{i}.{k}.weight" for i in range(2) for k in kinds)
    opt = configure_optimizer(model, TrainConfig.from_dict(MUON))
    muon_ids = {id(p) for p in opt.param_groups[0]["params"]}
    for name in ("tok_emb.weight", "pos_emb.weight", "lm_head.weight"):  # 2-D, not hidden
        assert id(model.get_parameter(name)) not in muon_ids
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


def test_muon_update_is_orthogonalised_and_adamw_steps_the_rest_as_plain_adamw():
    model = tiny_model()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        p.grad = torch.randn(p.shape, generator=g)
        q.grad = p.grad.clone()
    # the gradient of qkv [192, 64]: U diag(sigma) V^T, singular values from 1 down to 0.01
    u, _ = torch.linalg.qr(torch.randn(192, 64, generator=g))
    v, _ = torch.linalg.qr(torch.randn(64, 64, generator=g))
    qkv = model.blocks[0].attn.qkv.weight
    qkv.grad = u @ torch.diag(torch.logspace(0, -2, 64)) @ v.T
    before = qkv.detach().clone()
    configure_optimizer(model, TrainConfig.from_dict(MUON)).step()
    update = (before - qkv.detach()) / (0.01 * math.sqrt(192 / 64))  # Muon's lr adjustment
    s = torch.linalg.svdvals(update)
    assert s.min() > 0.6 and s.max() < 1.3, s  # quintic Newton-Schulz: all near 1
    assert torch.linalg.norm(update - u @ v.T) / torch.linalg.norm(u @ v.T) < 0.3
    hidden = {id(p) for p in muon_parameters(model)}
    rest = [n for n, p in model.named_parameters() if id(p) not in hidden]
    flat = [n for n in rest if model.get_parameter(n).dim() < 2]
    plain = torch.optim.AdamW(
        [
            {"params": [reference.get_parameter(n) for n in rest if n not in flat]},
            {"params": [reference.get_parameter(n) for n in flat]},
        ],
        lr=1e-3,
        weight_decay=0.0,
    )
    plain.step()
    for n in rest:
        assert torch.allclose(model.get_parameter(n), reference.get_parameter(n), atol=1e-7), n


def _muon_against_torch(steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ours, torch.optim.Muon's) weights after `steps` steps on the same random gradients:
    a tall, a square and a wide matrix, weight decay 0.1."""
    cfg = TrainConfig.from_dict({**MUON, "weight_decay": 0.1})
    g = torch.Generator().manual_seed(0)
    ours = [
        torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(192, 64), (64, 64), (64, 256)]
    ]
    theirs = [torch.nn.Parameter(w.detach().clone()) for w in ours]
    mine = MuonWithAdamW(ours, [{"params": [], "weight_decay": 0.0}], cfg, fused=True)
    reference = torch.optim.Muon(
        theirs, lr=0.01, weight_decay=0.1, momentum=cfg.optim.muon_momentum
    )
    for _ in range(steps):
        for w, r in zip(ours, theirs, strict=True):
            w.grad = torch.randn(w.shape, generator=g)
            r.grad = w.grad.clone()
        mine.step()
        reference.step()
    return [(w.detach(), r.detach()) for w, r in zip(ours, theirs, strict=True)]


def test_muon_multiplying_in_bfloat16_steps_exactly_as_torch_optim_muon(monkeypatch):
    monkeypatch.setattr(optim, "muon_dtype", lambda device: torch.bfloat16)
    for ours, theirs in _muon_against_torch():
        assert torch.equal(ours, theirs)


def test_muon_multiplying_in_float32_differs_from_torch_optim_muon_by_bfloat16_rounding_only(
    monkeypatch,
):
    monkeypatch.setattr(optim, "muon_dtype", lambda device: torch.float32)
    for ours, theirs in _muon_against_torch():
        assert not torch.equal(ours, theirs)  # the products did run in float32
        # three steps of lr 0.01 moved each weight by ~0.03; bfloat16 keeps 8 bits of them
        assert (ours - theirs).abs().max() < 1e-3


def test_muon_lr_follows_the_schedule_and_state_survives_a_round_trip():
    cfg = TrainConfig.from_dict({**MUON, "schedule": "wsd", "warmup_steps": 2, "max_steps": 10})
    model = tiny_model()
    opt = configure_optimizer(model, cfg)
    assert isinstance(opt, MuonWithAdamW)
    set_lr(opt, lr_at(0, cfg))
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * lr_at(0, cfg) / 1e-3)
    assert opt.param_groups[1]["lr"] == lr_at(0, cfg)
    _backward(model)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    again = configure_optimizer(model, cfg)
    again.load_state_dict(saved)
    qkv = model.blocks[0].attn.qkv.weight
    assert torch.equal(again.state[qkv]["momentum_buffer"], opt.state[qkv]["momentum_buffer"])
    assert again.adamw.state is again.state and again.adamw.param_groups[0] is again.param_groups[1]


def test_muon_without_trainable_hidden_matrices_is_refused():
    model = tiny_model()
    for p in muon_parameters(model):
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="optimizer 'muon' needs trainable weight matrices"):
        configure_optimizer(model, TrainConfig.from_dict({"optimizer": "muon"}))


def test_wsd_schedule_is_a_trapezoid():
    cfg = TrainConfig.from_dict(
        dict(
            lr=1e-3,
            min_lr=1e-4,
            warmup_steps=10,
            max_steps=110,
            schedule="wsd",
            cooldown_fraction=0.2,
        )
    )
    lrs = [lr_at(s, cfg) for s in range(130)]
    assert lrs[:10] == pytest.approx([1e-3 * (s + 1) / 10 for s in range(10)])  # warm-up
    assert lrs[10:88] == [1e-3] * 78  # stable until the last 22 steps
    assert lrs[88:110] == pytest.approx([1e-3 - 9e-4 * (s - 87) / 22 for s in range(88, 110)])
    assert lrs[109] == pytest.approx(1e-4) and lrs[110:] == [pytest.approx(1e-4)] * 20


RECIPE = [
    "--optimizer", "muon", "--schedule", "wsd", "--cooldown-fraction", "0.5", "--qk-norm",
    "--mlp", "relu2", "--zero-init-proj", "--logit-softcap", "15", "--log", "csv",
]  # fmt: skip


def test_every_recipe_option_resumes_exactly_in_a_new_process(corpus, tmp_path):
    whole = tmp_path / "whole"
    steps = ["--max-steps", "10", "--decay-steps", "10"]
    assert cli(*train_argv(corpus, whole, *steps, *RECIPE)).returncode == 0
    out = tmp_path / "run"
    first = cli(*train_argv(corpus, out, "--max-steps", "5", "--decay-steps", "10", *RECIPE))
    assert first.returncode == 0, first.stderr
    state = load_trainer_state(list_checkpoints(out)[-1])
    assert any("momentum_buffer" in s for s in state["optimizer"]["state"].values())
    second = cli("train", "--resume", out, "--max-steps", "10")
    assert second.returncode == 0, second.stderr
    assert_same_run(whole, out)
    csv_steps = (out / "metrics.csv").read_text().splitlines()[1:]
    assert [int(line.split(",")[0]) for line in csv_steps] == list(range(1, 11))


@pytest.mark.parametrize(
    "flags,fragment",
    [
        (["--optimizer", "sgd"], "--optimizer: expected one of adamw, muon, got 'sgd'"),
        (["--schedule", "linear"], "--schedule: expected one of cosine, constant, wsd"),
        (["--optimizer", "muon", "--fsdp"], "optimizer 'muon' orthogonalises whole weight"),
        (["--optimizer", "muon", "--lora-rank", "2", "--init-from", "."], "'muon' trains the"),
        (["--cooldown-fraction", "0"], "cooldown_fraction must be a finite number in (0.0, 1.0]"),
    ],
)
def test_bad_optimizer_and_schedule_options_are_one_line(capsys, corpus, tmp_path, flags, fragment):
    one_line_error(capsys, train_argv(corpus, tmp_path / "run", *flags), fragment)
