"""GPU figures of benchmarks/gpu.sh, one part per call (each also runs on the CPU with --tiny,
which is how it is tested where there is no GPU).

    python benchmarks/gpu_step.py train [--dtype bfloat16|float16] [--batch 8] [--steps 10]
    python benchmarks/gpu_step.py generate [--new-tokens 256]
    torchrun --nproc_per_node 1 benchmarks/gpu_step.py fsdp

train: GPT-2 small (124M; the `gpt2` preset, context 1024) through the trainer's own
    `parallelize` (the attention choice, torch.compile unless --no-compile) and `train_step`
    with fused AdamW, random tokens; after 3 warm-up steps, tokens/s over --steps steps, MFU
    against the device's peak for the dtype (`decoderlm.training.metrics.peak_flops`), the
    peak allocated memory beside `decoderlm.model.analysis.memory_bytes` (what `decoderlm params`
    prints), and for float16 the GradScaler's scale and the steps it skipped.
generate: greedy decoding of a random GPT-2 small, batch 1, a 32-token prompt, decoderlm's
    `generate` (KV cache) against transformers' `generate` on the same weights (saved by
    `decoderlm.io.hf_gpt2.save_gpt2`), tokens/s of each after a warm-up, and whether the
    tokens agree.
fsdp: the train part's step with FSDP2 (fully_shard per block, then the root) in one process
    of a torchrun job.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time

import torch

from common import arguments
from decoderlm import DecoderLM, ModelConfig, TrainConfig, get_preset
from decoderlm.generation.generate import generate
from decoderlm.model.analysis import flops_per_token, memory_bytes
from decoderlm.training.loop import autocast_for, micro_batches, train_step
from decoderlm.training.metrics import peak_flops
from decoderlm.training.optim import configure_optimizer
from decoderlm.training.parallel import DistInfo, parallelize

TINY = dict(vocab_size=256, block_size=64, n_layers=2, n_heads=2, d_model=64)
_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def device_and_config(args) -> tuple[torch.device, ModelConfig]:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    model = TINY if args.tiny else get_preset("gpt2").model
    return device, ModelConfig.from_dict({**model, "dropout": 0.0})


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_part(args, fsdp: bool = False) -> None:
    device, config = device_and_config(args)
    cfg = TrainConfig.from_dict(
        dict(
            batch_size=args.batch,
            dtype=args.dtype,
            compile=not args.no_compile,
            fsdp=fsdp,
            optimizer="adamw",
            lr=1e-4,
            schedule="constant",
            grad_clip=None,
        )
    )
    torch.manual_seed(0)
    model = DecoderLM(config).to(device).train()
    par = parallelize(model, cfg, DistInfo(), device)
    optimizer = configure_optimizer(model, cfg)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.compute.dtype == "float16")
    data = torch.randint(0, config.vocab_size, (1_000_000,))
    generator, autocast = torch.Generator().manual_seed(0), autocast_for(cfg, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def steps(n: int) -> float:
        sync(device)
        start = time.perf_counter()
        for _ in range(n):
            batches = micro_batches(data, generator, cfg, DistInfo(), config.block_size)
            loss = train_step(par, optimizer, scaler, batches, cfg, autocast)
        loss.item()
        sync(device)
        return time.perf_counter() - start

    steps(3)  # warm-up (compilation)
    seconds = steps(args.steps)
    tokens_per_s = args.steps * args.batch * config.block_size / seconds
    peak = peak_flops(device, cfg.compute.dtype)
    flops = flops_per_token(config)["training"]
    mfu = f"{flops * tokens_per_s / peak:.1%}" if peak else "n/a (unknown peak)"
    print(
        f"train {cfg.compute.dtype} fsdp={fsdp} compile={cfg.compute.compile} on {device}: "
        f"batch {args.batch}"
    )
    print(f"  tokens/s {tokens_per_s:,.0f}, MFU {mfu}")
    if device.type == "cuda":
        estimate = memory_bytes(config, args.batch, None, _DTYPE_NAMES[cfg.compute.dtype])
        print(
            f"  peak allocated {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB; "
            f"estimate training_peak {estimate['training_peak'] / 2**30:.2f} GiB "
            f"(decoderlm params, {_DTYPE_NAMES[cfg.compute.dtype]})"
        )
    if scaler.is_enabled():
        taken = _adam_steps(optimizer)
        print(f"  GradScaler scale {scaler.get_scale():.0f}, optimizer steps taken {taken}")


def _adam_steps(optimizer) -> int:
    """AdamW's step count (a step skipped by the GradScaler does not count)."""
    return int(max((float(s.get("step", 0)) for s in optimizer.state.values()), default=0))


def generate_part(args) -> None:
    from transformers import GPT2LMHeadModel

    from decoderlm.io.hf_gpt2 import save_gpt2

    device, config = device_and_config(args)
    torch.manual_seed(0)
    model = DecoderLM(config).to(device).eval()
    prompt = torch.randint(0, config.vocab_size, (1, 32), device=device)
    with tempfile.TemporaryDirectory() as hf_dir:
        save_gpt2(model, hf_dir)
        theirs = GPT2LMHeadModel.from_pretrained(hf_dir).to(device).eval()
    n = args.new_tokens

    def ours_run():
        return generate(model, prompt, n, do_sample=False)

    def theirs_run():
        mask = torch.ones_like(prompt)
        return theirs.generate(
            prompt, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip

    rates = {}
    for name, run in (("decoderlm", ours_run), ("transformers", theirs_run)) * 2:
        with torch.no_grad():
            sync(device)
            start = time.perf_counter()
            out = run()
            sync(device)
        rates[name] = (n / (time.perf_counter() - start), out[0, 32:].tolist())  # last of 2
    same = rates["decoderlm"][1] == rates["transformers"][1]
    print(f"generate on {device}, greedy, batch 1, 32-token prompt, {n} new tokens:")
    for name, (rate, _) in rates.items():
        print(f"  {name}: {rate:,.1f} tokens/s")
    print(f"  ratio {rates['decoderlm'][0] / rates['transformers'][0]:.2f}x; same tokens: {same}")


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("part", choices=["train", "generate", "fsdp"])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (a check)")
    args = parser.parse_args()
    if args.part == "fsdp":
        import torch.distributed as dist

        if "RANK" not in os.environ:
            raise SystemExit("error: the fsdp part runs under torchrun --nproc_per_node 1")
        backend = "nccl" if torch.cuda.is_available() and not args.tiny else "gloo"
        dist.init_process_group(backend)
        with contextlib.ExitStack() as stack:
            stack.callback(dist.destroy_process_group)
            train_part(args, fsdp=True)
    elif args.part == "train":
        train_part(args)
    else:
        generate_part(args)


if __name__ == "__main__":
    main()
