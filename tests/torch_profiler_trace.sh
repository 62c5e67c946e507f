#!/usr/bin/env bash
# torch_profiler: the Chrome trace it writes parses as JSON and holds Ember's ranges for exactly
# the scheduled batches (wait 1, warmup 1, active 2: ProfilerStep#2 and #3), operators inside
# them, and the key-averages table is sorted by self time.
#   torch_profiler_trace.sh <engine> <python> <scratch dir>
set -euo pipefail
engine=$(realpath "$1"); python=$2; work=$3
rm -rf "$work"; mkdir -p "$work"; cd "$work"
cat > run.toml <<'TOML'
[trainer]
max_epochs = 1
enable_progress_bar = false
enable_model_summary = false
[model]
name = "mlp"
input_size = 8
hidden = [16]
[data]
name = "synthetic"
shape = [8]
num_train = 96
num_val = 32
batch_size = 16
[torch_profiler]
wait = 1
warmup = 1
active = 2
TOML
OMP_NUM_THREADS=1 "$engine" --plugins torch_profiler run.toml 2> engine.log || { cat engine.log; exit 1; }
grep -q "torch_profiler: cycle 0" engine.log || { cat engine.log; exit 1; }
grep -q "training on cuda" engine.log && export EMBER_TRACE_ON_CUDA=1
"$python" -W ignore - runs/run/version_0/torch_profiler <<'PY'
import json, os, re, sys
d = sys.argv[1]
with open(os.path.join(d, "trace-rank0.json")) as f:
    trace = json.load(f)
events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
names = {e["name"] for e in events}
steps = sorted(n for n in names if n.startswith("ProfilerStep#"))
assert steps == ["ProfilerStep#2", "ProfilerStep#3"], steps
for r in ["ember/training_step", "ember/backward", "ember/optimizer_step", "ember/data_fetch"]:
    assert r in names, (r, sorted(names)[:40])
# On CUDA, Kineto repeats each range on the GPU timeline (cat "gpu_user_annotation"): count the host's.
count = lambda n: sum(1 for e in events if e["name"] == n and e.get("cat") != "gpu_user_annotation")
assert count("ember/backward") == 2 and count("ember/optimizer_step") == 2, (count("ember/backward"), count("ember/optimizer_step"))
assert count("ember/data_fetch") == 2, count("ember/data_fetch")  # after each recorded batch (the last one until recording stops)
ops = [n for n in names if n.startswith("aten::")]
assert any(n in ops for n in ("aten::addmm", "aten::linear", "aten::mm")), sorted(ops)
# Operators run inside the step ranges.
step = next(e for e in events if e["name"] == "ProfilerStep#2")
inside = [e for e in events if e["name"].startswith("aten::") and step["ts"] <= e["ts"] <= step["ts"] + step["dur"]]
assert inside, "no operator inside ProfilerStep#2"
# A run on a GPU records its kernels too.
if os.environ.get("EMBER_TRACE_ON_CUDA") == "1":
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert kernels, sorted({e.get("cat") for e in events})
table = open(os.path.join(d, "key_averages-rank0.txt")).read().splitlines()
selfs = [float(l.split()[-5]) for l in table[2:] if re.match(r".*\d+\.\d+%\s", l)]
assert len(selfs) >= 5 and selfs == sorted(selfs, reverse=True), table[:8]
print(f"trace: {len(events)} events, ranges {steps}; key averages sorted by self time ({len(selfs)} rows)")
PY
# emit_nvtx: NVTX ranges for Nsight Systems instead of a trace (without nsys they go nowhere): the
# run trains as before and writes no trace.
rm -rf runs
OMP_NUM_THREADS=1 "$engine" --plugins torch_profiler run.toml --set torch_profiler.emit_nvtx=true 2> nvtx.log || { cat nvtx.log; exit 1; }
grep -q "torch_profiler: emitting NVTX ranges" nvtx.log || { cat nvtx.log; exit 1; }
[ ! -e runs/run/version_0/torch_profiler ] || { echo "emit_nvtx wrote a trace"; exit 1; }
echo "emit_nvtx: trained with NVTX ranges on, no trace written"

