#!/usr/bin/env bash
# Checkpoints are readable from Python with a plain torch.load (its default weights_only=True, no
# allow-listing): train a short run with the engine (with plugins whose states hold lists of
# tensors and of floats), then load every checkpoint it wrote and check what it holds; and the
# safetensors file `engine export` writes from one of them.
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
[checkpoint]
save_top_k = -1
TOML
OMP_NUM_THREADS=1 "$engine" --plugins ema,cosine run.toml 2> engine.log || { cat engine.log; exit 1; }
"$python" -W ignore - runs/run/version_0/checkpoints <<'PY'
import pathlib, sys
import torch

files = sorted(pathlib.Path(sys.argv[1]).glob("*.ckpt"))
assert len(files) == 3, files  # epoch=0, epoch=1, last
for f in files:
    ck = torch.load(f)  # weights_only=True (the default since torch 2.6), nothing allow-listed
    ck2 = torch.load(f, weights_only=True)
    assert ck["format"] == "ember-checkpoint" and ck["format_version"] == 2, (ck["format"], ck["format_version"])
    sd = ck["state_dict"]
    assert type(sd) is dict and sorted(sd) == ["fc1.bias", "fc1.weight", "head.bias", "head.weight"], sorted(sd)
    assert tuple(sd["fc1.weight"].shape) == (4, 8) and sd["fc1.weight"].dtype == torch.float32
    assert all(torch.equal(sd[k], ck2["state_dict"][k]) for k in sd)
    # The module's own names: a torch.nn module with the same layers takes the state_dict as is.
    model = torch.nn.Module()
    model.fc1 = torch.nn.Linear(8, 4)
    model.head = torch.nn.Linear(4, sd["head.weight"].shape[0])
    model.load_state_dict(sd)
    assert isinstance(ck["optimizer"], torch.Tensor) and ck["optimizer"].dtype == torch.uint8
    ema = ck["callbacks"]["ema"]
    assert type(ema["averaged"]) is list and all(isinstance(t, torch.Tensor) for t in ema["averaged"]), ema
    assert isinstance(ck["rng"]["cuda"], list)

last = torch.load(pathlib.Path(sys.argv[1]) / "last.ckpt")
assert last["global_step"] == 4, last["global_step"]
assert last["loops"]["epoch_finished"] and last["loops"]["epoch"] == 1
assert last["callbacks"]["checkpoint"]["best_model_path"].endswith(".ckpt")
assert "[model]" in last["config"]
print("checkpoints read by a plain torch.load in Python:", len(files), "files,", len(last["state_dict"]), "tensors, step", last["global_step"])
PY

# `engine export` writes what Python's safetensors loads: the checkpoint's state_dict, same names,
# same values, and metadata format "pt" (what transformers looks for).
"$engine" export runs/run/version_0/checkpoints/last.ckpt --format safetensors exported.safetensors 2> export.log || { cat export.log; exit 1; }
"$python" -W ignore - runs/run/version_0/checkpoints/last.ckpt exported.safetensors <<'PY'
import sys
import torch
from safetensors import safe_open
from safetensors.torch import load_file

sd = torch.load(sys.argv[1])["state_dict"]
exported = load_file(sys.argv[2])
assert sorted(exported) == sorted(sd), (sorted(exported), sorted(sd))
assert all(torch.equal(exported[k], sd[k]) and exported[k].dtype == sd[k].dtype for k in sd)
with safe_open(sys.argv[2], "pt") as f:
    assert f.metadata()["format"] == "pt", f.metadata()
print("engine export read by safetensors.torch.load_file:", len(exported), "tensors equal to the checkpoint's state_dict")
PY
