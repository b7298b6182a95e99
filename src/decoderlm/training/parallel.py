"""Speed and scale, applied to the model from outside: the attention kernel for bfloat16 on
the CPU, activation checkpointing, torch.compile, and DDP / FSDP2 under torchrun.

`parallelize` applies them in one place, as torchtitan's parallelize function does, in this
order: the attention choice, activation checkpointing (each block wrapped), then FSDP2 (each
block, then the root, sharded in place) or DDP (the model wrapped), and torch.compile last,
around the DDP / FSDP2 module (torchtitan compiles each block before sharding instead).
The model's state dict keeps its plain keys throughout: the checkpoint wrapper strips its own
prefix, and DDP's and compile's are stripped by `weights.normalize_state_dict`.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import TrainConfig
from ..errors import UserError
from ..model.model import DecoderLM

__all__ = [
    "DistInfo",
    "init_distributed",
    "Parallelized",
    "parallelize",
    "choose_attention",
    "apply_activation_checkpointing",
    "gradient_sync",
    "agree_across_ranks",
    "gather_across_ranks",
    "barrier",
]


@dataclass(frozen=True)
class DistInfo:
    """This process's place in a torchrun job; rank 0 of 1 without torchrun."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        """Only rank 0 writes files and prints."""
        return self.rank == 0

    def main_only(self, log):
        """`log` on rank 0; on the other ranks a function that prints nothing."""
        return log if self.is_main else _silent


def _silent(*args, **kwargs) -> None:
    pass


def init_distributed(device: str | None = None) -> tuple[DistInfo, torch.device]:
    """Join the torchrun job described by the RANK / LOCAL_RANK / WORLD_SIZE environment
    variables (process group backend: nccl on CUDA, gloo on CPU), or run alone without them.

    Returns:
        (DistInfo, the torch.device of this process: cuda:LOCAL_RANK on CUDA).
    """
    kind = (device or ("cuda" if torch.cuda.is_available() else "cpu")).split(":")[0]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return DistInfo(), torch.device(device or kind)
    info = DistInfo(int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")), world)
    target = torch.device(kind, info.local_rank) if kind == "cuda" else torch.device(kind)
    if kind == "cuda":
        torch.cuda.set_device(target)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if kind == "cuda" else "gloo")
    return info, target


def choose_attention(model: DecoderLM, cfg: TrainConfig, device: torch.device) -> None:
    """Use the written-out attention for training steps (`attn.impl = "explicit"`; evaluation
    keeps the fused kernel) in every block whose attention drops out probabilities, and in
    every block when training in bfloat16, on the CPU with block_size <= 128.

    On the CPU, F.scaled_dot_product_attention has no fused kernel with dropout: it falls
    back to its written-out math, whose mask draws one random number per probability
    (`bernoulli_`); the written-out attention draws it from 16 bits (`model.dropout`). And
    PyTorch's CPU flash-attention kernel is much slower in bfloat16 than in float32 (see
    benchmarks/attention_backward.py). Both written-out paths hold T x T probabilities, small
    for T <= 128. Everywhere else the fused kernel ("sdpa") keeps memory linear in T.
    """
    if device.type != "cpu" or model.config.block_size > 128:
        return
    for block in model.blocks:
        if cfg.compute.dtype == "bfloat16" or block.attn.dropout > 0:
            block.attn.impl = "explicit"


def apply_activation_checkpointing(model: DecoderLM) -> None:
    """Wrap every block so that only its input is kept in the forward pass and its activations
    are recomputed in the backward pass (less memory, about one more forward pass of compute).
    The state dict keys do not change."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block)


@dataclass
class Parallelized:
    """A model prepared for training steps.

    Attributes:
        model: the DecoderLM itself (sharded in place under FSDP2): its parameters, state
            dict and evaluation.
        device: this process's device.
        step_module: what training steps call (compiled, DDP-wrapped, or the model).
        ddp: the DistributedDataParallel wrapper, or None.
        fsdp: whether the model is sharded with FSDP2.
    """

    model: DecoderLM
    device: torch.device
    step_module: torch.nn.Module
    ddp: torch.nn.parallel.DistributedDataParallel | None = None
    fsdp: bool = False


def parallelize(
    model: DecoderLM, cfg: TrainConfig, info: DistInfo, device: torch.device
) -> Parallelized:
    """Apply cfg's speed and scale settings to `model` (in place) for training on `device`:
    the attention choice, activation checkpointing, FSDP2 or DDP (several processes), then
    torch.compile outside them.

    Raises:
        UserError: fsdp in a single process.
    """
    choose_attention(model, cfg, device)
    if cfg.compute.activation_checkpointing:
        apply_activation_checkpointing(model)
    ddp = None
    if cfg.compute.fsdp:
        if info.world_size == 1 and not dist.is_initialized():
            raise UserError("fsdp needs several processes: run under torchrun, or set fsdp false")
        from torch.distributed.fsdp import fully_shard  # imported here: DTensor is slow to import

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        step_module = model
    elif info.world_size > 1:
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
        step_module = ddp
    else:
        step_module = model
    if cfg.compute.compile:
        step_module = torch.compile(step_module)
    return Parallelized(model, device, step_module, ddp, cfg.compute.fsdp)


def gradient_sync(par: Parallelized, last: bool):
    """The context of one micro-step's forward and backward: gradients are synchronised across
    ranks only on the last micro-step of an optimizer step. DDP decides in forward whether
    its backward all-reduces, so the context must cover forward and backward."""
    if par.fsdp:
        par.model.set_requires_gradient_sync(last)
    if par.ddp is not None and not last:
        return par.ddp.no_sync()
    return contextlib.nullcontext()


def agree_across_ranks(loss: torch.Tensor, stop_requested: bool, info: DistInfo) -> bool:
    """Average this step's `loss` over all ranks (in place); returns whether any rank had a
    stop request, the same answer on every rank.

    The training loop stops on this answer, never on its own requests: a signal handled after
    the agreement (SIGINT reaches the ranks at different points of their step) would
    otherwise stop that rank one step before the others, which then wait in the next step's
    gradient all-reduce for it, while it waits in the checkpoint's gather for them. The
    request is counted at the next step's agreement instead.
    """
    if info.world_size == 1:
        return stop_requested
    flags = torch.tensor([float(stop_requested)], device=loss.device)
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return bool(flags.item())


def gather_across_ranks(value, info: DistInfo) -> list:
    """[value of rank 0, value of rank 1, ...] on every rank (a picklable object)."""
    if info.world_size == 1:
        return [value]
    values = [None] * info.world_size
    dist.all_gather_object(values, value)
    return values


def barrier(info: DistInfo) -> None:
    """Wait until every rank gets here (nothing to wait for in one process)."""
    if info.world_size > 1:
        dist.barrier()
