#!/usr/bin/env bash
# Checkpoints are readable from Python: train a short run with the engine, then load last.ckpt
# with torch.load under its default weights_only=True (allow-listing torch's own two unpickling
# helpers, as docs/checkpoint.md says) and check what it holds.
#   python_interop.sh <engine> <python with torch> <scratch dir>
set -euo pipefail
engine=$1; python=$2; work=$3
rm -rf "$work"; mkdir -p "$work"; cd "$work"
cat > run.toml <<'TOML'
[trainer]
max_epochs = 2
enable_progress_bar = false
[model]
name = "mlp"
input_size = 8
hidden = [4]
[data]
name = "synthetic"
shape = [8]
num_train = 64
TOML
OMP_NUM_THREADS=1 "$engine" run.toml 2> engine.log || { cat engine.log; exit 1; }
"$python" -W ignore - runs/run/version_0/checkpoints/last.ckpt <<'PY'
import sys
import torch
import torch.jit._pickle as p

with torch.serialization.safe_globals([p.restore_type_tag, p.build_tensorlist]):
    ck = torch.load(sys.argv[1])  # weights_only=True, the default since torch 2.6
assert ck["format"] == "ember-checkpoint", ck["format"]
assert ck["global_step"] == 4, ck["global_step"]
sd = ck["state_dict"]
assert sorted(sd) == ["fc1.bias", "fc1.weight", "head.bias", "head.weight"], sorted(sd)
assert tuple(sd["fc1.weight"].shape) == (4, 8)
assert ck["loops"]["epoch_finished"] and ck["loops"]["epoch"] == 1
assert ck["callbacks"]["checkpoint"]["best_model_path"].endswith(".ckpt")
assert "[model]" in ck["config"]
print("checkpoint read by torch.load in Python:", len(sd), "tensors, step", ck["global_step"])
PY
