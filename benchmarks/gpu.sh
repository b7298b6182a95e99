#!/usr/bin/env bash
# The GPU path, measured: CUDA tests, GPT-2 small training in bfloat16 (torch.compile, fused
# AdamW: tokens/s, MFU, peak memory vs `decoderlm params`), float16 with a GradScaler, FSDP2 and
# the CLI under torchrun on one GPU, CUDA generation vs transformers. Prints everything; about
# 5-8 minutes on one recent GPU. Run from the project root:
#
#     bash benchmarks/gpu.sh            # CPU_FALLBACK=1 runs every part on a tiny CPU model
#
# Without a CUDA device it says so and runs the CPU fallbacks (tiny shapes) instead, which is
# how the script itself is checked on machines without a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python}
step="$python benchmarks/gpu_step.py"
status=0

run() {  # run a part, print its command and output, remember a failure, go on
  echo "+ $*"
  "$@" || { echo "FAILED ($?): $*"; status=1; }
  echo
}

if [ "${CPU_FALLBACK:-0}" != 1 ] && $python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  $python -c "import torch; print('GPU:', torch.cuda.get_device_name(0), '| torch', torch.__version__, '| CUDA', torch.version.cuda)"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null
  echo
  run $python -m pytest -m cuda -q -p no:cacheprovider
  run $step train --dtype bfloat16 --batch 8 --steps 20
  run $step train --dtype float16 --batch 8 --steps 10
  run $python -m decoderlm params --preset gpt2 --batch-size 8 --dtype bf16
  run $python -m torch.distributed.run --nproc_per_node 1 benchmarks/gpu_step.py fsdp --steps 10
  run $python -m torch.distributed.run --nproc_per_node 1 -m decoderlm train --device cuda \
    --max-steps 50 --out "${TMPDIR:-/tmp}/decoderlm-gpu-ddp" --overwrite --no-progress
  run $step generate --new-tokens 256
else
  echo "no CUDA device (or CPU_FALLBACK=1): the GPU parts were NOT measured; CPU fallbacks on a tiny model"
  echo
  run $step train --tiny --no-compile --steps 3
  run $step train --tiny --no-compile --steps 3 --dtype float16
  run $python -m torch.distributed.run --nproc_per_node 1 benchmarks/gpu_step.py fsdp --tiny --no-compile --steps 2
  run $step generate --tiny --new-tokens 16
  run $python -m decoderlm params --preset gpt2 --batch-size 8 --dtype bf16
fi
exit $status
