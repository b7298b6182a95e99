"""Speed and scale applied from outside the model (decoderlm.training.parallel): distributed
training on the CPU with gloo (DDP and FSDP2 through torchrun, gradient accumulation with
DDP's no_sync; each process uses one thread), activation checkpointing, torch.compile and
the choice of attention kernel.

The oracle is one process that sees the same windows: N ranks with batch_size b draw their
windows from one shared generator, so a single process with batch_size N * b trains on exactly
the union of their batches.
"""

import copy
import json
import math
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from decoderlm import DecoderLM
from decoderlm.config import TrainConfig
from decoderlm.training.loop import train
from decoderlm.training.parallel import (
    apply_activation_checkpointing,
    choose_attention,
    init_distributed,
)

from conftest import tiny_config

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TEXT = "".join(chr(33 + (i * 7919) % 60) for i in range(3000))
SMALL = [  # AdamW: FSDP shards the matrices Muon orthogonalises whole
    "--preset",
    "classic",
    "--n-layers",
    "2",
    "--n-heads",
    "2",
    "--d-model",
    "32",
    "--block-size",
    "16",
    "--dropout",
    "0",
    "--dtype",
    "float32",
    "--max-steps",
    "6",
    "--eval-interval",
    "3",
    "--log-interval",
    "1",
    "--no-progress",
    "--sample-chars",
    "5",
    "--lr",
    "3e-3",
    "--warmup-steps",
    "2",
    "--schedule",
    "cosine",
]


def losses(run_dir):
    """Every logged training and validation loss, in order."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in records for key in ("train_loss", "val_loss") if key in r]


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_two_processes_with_batch_b_equal_one_process_with_batch_2b(tmp_path, sharding):
    data = tmp_path / "text.txt"
    data.write_text(TEXT, encoding="utf-8")
    one, two = tmp_path / "one", tmp_path / "two"
    single = subprocess.run(
        [
            sys.executable,
            "-m",
            "decoderlm",
            "train",
            "--data",
            str(data),
            "--out",
            str(one),
            *SMALL,
            "--batch-size",
            "4",
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert single.returncode == 0, single.stderr
    extra = ["--fsdp"] if sharding == "fsdp" else []
    pair = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "decoderlm",
            "train",
            "--data",
            str(data),
            "--out",
            str(two),
            *SMALL,
            "--batch-size",
            "2",
            *extra,
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert pair.returncode == 0, pair.stderr
    assert "x 2 processes" in pair.stdout and pair.stdout.count("final validation loss") == 1
    assert losses(one) == pytest.approx(losses(two), abs=1e-5)
    a, b = load_file(str(one / "model.safetensors")), load_file(str(two / "model.safetensors"))
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=1e-5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CFG = dict(
    batch_size=2,
    grad_accum_steps=4,
    max_steps=3,
    lr=1e-3,
    warmup_steps=0,
    schedule="constant",
    log_interval=1,
    eval_interval=100,
    eval_batches=1,
    dtype="float32",
    optimizer="adamw",  # the tolerances below are Adam's
    seed=3,
)


def _accumulating_rank(rank, world, port, out_dir, data):
    """One rank: TINY, accumulation 4, micro-batch 2, gloo."""
    import torch.nn.parallel
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )
    calls = []
    plain_ddp = torch.nn.parallel.DistributedDataParallel

    class CountingDDP(plain_ddp):  # counts gradient all-reduces
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.register_comm_hook(
                None, lambda state, bucket: (calls.append(1), allreduce_hook(state, bucket))[1]
            )

    torch.nn.parallel.DistributedDataParallel = CountingDDP
    info, _ = init_distributed("cpu")
    torch.manual_seed(0)
    model = DecoderLM(tiny_config())
    cfg = TrainConfig.from_dict(CFG)
    result = train(model, cfg, data[:1800], data[1800:], progress=False, info=info)
    torch.save(
        {
            "params": model.state_dict(),
            "losses": [r["train_loss"] for r in result.metrics],
            "all_reduces": len(calls),
        },
        out_dir / f"rank{rank}.pt",
    )
    dist.destroy_process_group()


def test_gradient_accumulation_syncs_once_per_step_and_matches_one_process(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 65, (2000,), generator=g)
    mp.spawn(_accumulating_rank, args=(2, _free_port(), tmp_path, data), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    torch.manual_seed(0)
    reference = DecoderLM(tiny_config())  # one process, the same 16 sequences per step
    cfg = TrainConfig.from_dict({**CFG, "batch_size": 4})
    result = train(reference, cfg, data[:1800], data[1800:], progress=False)
    expected = [r["train_loss"] for r in result.metrics]
    assert ranks[0]["losses"] == ranks[1]["losses"]  # the logged loss is the global mean
    assert ranks[0]["losses"] == pytest.approx(expected, abs=1e-6)
    for name, value in reference.state_dict().items():
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name])  # max diff 0
        # atol 1e-4 (lr / 10), not 1e-6: the ranks add gradients in another
        # order, and Adam's m / sqrt(v) turns a 1e-9 difference in a near-zero gradient into
        # up to lr in that weight (seen: 1.1e-5 in one element of 16,384)
        torch.testing.assert_close(ranks[0]["params"][name], value, atol=1e-4, rtol=0)
    # TINY's gradients fit one DDP bucket: one all-reduce per optimizer step, not per micro-step
    assert ranks[0]["all_reduces"] == ranks[1]["all_reduces"] == CFG["max_steps"]


def test_activation_checkpointing_gives_the_same_gradients_and_saves_less():
    torch.manual_seed(0)
    plain = DecoderLM(tiny_config()).train()
    wrapped = copy.deepcopy(plain)
    apply_activation_checkpointing(wrapped)
    assert list(wrapped.state_dict()) == list(plain.state_dict())  # no wrapper prefix
    idx = torch.randint(0, 65, (4, 32))
    grads, saved = [], []
    for model in (plain, wrapped):
        sizes = []

        def pack(t, sizes=sizes):
            sizes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _, loss = model(idx, idx)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        saved.append(sum(sizes))
    names = [name for name, _ in plain.named_parameters()]
    for name, grad, checkpointed in zip(names, grads[0], grads[1], strict=True):
        torch.testing.assert_close(checkpointed, grad, atol=1e-6, rtol=1e-5, msg=name)
    assert saved[1] < saved[0] / 2  # only each block's input (and the head) is kept


def test_compiled_training_matches_eager(tmp_path):
    data = torch.randint(0, 65, (2000,), generator=torch.Generator().manual_seed(2))
    losses = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = DecoderLM(tiny_config(n_layers=1))
        cfg = TrainConfig.from_dict(
            dict(
                batch_size=4,
                max_steps=3,
                optimizer="adamw",
                lr=1e-3,
                schedule="constant",
                dtype="float32",
                log_interval=1,
                eval_interval=100,
                eval_batches=1,
                compile=compiled,
            )
        )
        result = train(model, cfg, data[:1800], data[1800:], progress=False)
        losses.append([r["train_loss"] for r in result.metrics])
    assert all(math.isfinite(v) for v in losses[1])
    assert losses[1] == pytest.approx(losses[0], abs=1e-4)


def test_written_out_attention_is_chosen_for_bfloat16_or_attention_dropout_on_the_cpu():
    # on the CPU up to a 128-token context: bfloat16 (slow in the fused kernel) or dropout on
    # the probabilities (the fused kernel has none on the CPU: its fallback draws one random
    # number per probability); nowhere else
    def impls(dtype, device="cpu", block_size=128, **dropouts):
        model = DecoderLM(tiny_config(block_size=block_size, **dropouts))
        choose_attention(model, TrainConfig.from_dict({"dtype": dtype}), torch.device(device))
        return {getattr(block.attn, "impl", "sdpa") for block in model.blocks}

    assert impls("bfloat16") == {"explicit"}
    assert impls("bfloat16", block_size=129) == {"sdpa"}
    assert impls("float32") == impls("float16") == {"sdpa"}
    assert impls("bfloat16", device="meta") == {"sdpa"}
    assert impls("float32", dropout=0.05) == {"explicit"}
    assert impls("float32", dropout=0.05, attn_dropout=0.0) == {"sdpa"}
    assert impls("float32", attn_dropout=0.1) == {"explicit"}
    assert impls("float32", dropout=0.05, block_size=129) == {"sdpa"}
    assert impls("float32", dropout=0.05, device="meta") == {"sdpa"}
