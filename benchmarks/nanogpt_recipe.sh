#!/usr/bin/env bash
# nanoGPT's CPU shakespeare_char recipe (its README), then its final model scored over the whole
# validation split in non-overlapping 64-token windows (nanoGPT's own printed val loss is an
# estimate from 20 random batches). Prints key=value lines: wall_s (the training process),
# val_loss_nanogpt_estimate, val_loss_full_split. Run by benchmarks/vs_nanogpt.py; by hand:
#   NANOGPT=path/to/nanoGPT INPUT=data/input.txt bash benchmarks/nanogpt_recipe.sh
# NANOGPT: a clone of https://github.com/karpathy/nanoGPT (model.py, train.py, configurator.py,
# config/train_shakespeare_char.py are used unchanged); INPUT: Tiny Shakespeare's input.txt;
# WORK: a scratch directory (default: a new temporary one); MAX_ITERS: default 2000.
set -euo pipefail
nanogpt=$(cd "${NANOGPT:?set NANOGPT to a nanoGPT clone}" && pwd)
input=$(realpath "${INPUT:?set INPUT to the Tiny Shakespeare input.txt}")
work=${WORK:-$(mktemp -d)}
mkdir -p "$work"
max_iters=${MAX_ITERS:-2000}
cp -r "$nanogpt/model.py" "$nanogpt/train.py" "$nanogpt/configurator.py" "$nanogpt/config" "$work/"
mkdir -p "$work/data/shakespeare_char"
python - "$input" "$work/data/shakespeare_char" <<'PY'
# the same files nanoGPT's prepare.py writes: sorted characters, 90/10 split, uint16 ids, meta.pkl
import pickle, sys, numpy as np
text = open(sys.argv[1], encoding="utf-8").read()
chars = sorted(set(text)); stoi = {c: i for i, c in enumerate(chars)}
ids = np.array([stoi[c] for c in text], dtype=np.uint16); n = int(len(ids) * 0.9)
ids[:n].tofile(sys.argv[2] + "/train.bin"); ids[n:].tofile(sys.argv[2] + "/val.bin")
pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi},
            open(sys.argv[2] + "/meta.pkl", "wb"))
PY
cd "$work"
start=$(date +%s.%N)
python train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20 \
  --log_interval=100 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 \
  --max_iters="$max_iters" --lr_decay_iters="$max_iters" --dropout=0.0 \
  --always_save_checkpoint=True > train.log 2>&1
echo "wall_s=$(python -c "print(round($(date +%s.%N) - $start, 1))")"
grep -o "val loss [0-9.]*" train.log | tail -1 | sed 's/val loss /val_loss_nanogpt_estimate=/'
python - <<'PY'
import numpy as np, torch
from model import GPT, GPTConfig
ck = torch.load("out-shakespeare-char/ckpt.pt", map_location="cpu", weights_only=False)
m = GPT(GPTConfig(**ck["model_args"])); m.eval()
m.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ck["model"].items()})
val = np.fromfile("data/shakespeare_char/val.bin", dtype=np.uint16).astype(np.int64)
T = ck["model_args"]["block_size"]; n = (len(val) - 1) // T
x = torch.from_numpy(val[:n * T]).view(n, T); y = torch.from_numpy(val[1:n * T + 1]).view(n, T)
with torch.no_grad():
    tot = sum(m(x[i:i + 256], y[i:i + 256])[1].item() * len(x[i:i + 256]) for i in range(0, n, 256))
print(f"val_loss_full_split={tot / n:.4f}")
print(f"iterations={ck['iter_num']} tokens_scored={n * T}")
PY
