#!/usr/bin/env bash
# The CUDA paths, end to end through the engine (CTest `gpu_paths`; skips with 77 where no CUDA
# device is visible, as on CI). Every strategy that runs on one GPU and every precision train the
# Fashion-MNIST CNN (synthetic data where the Debian data set is absent) for a few hundred steps on
# cuda:0; each must exit 0, say it trained on cuda:0, and reach a test accuracy close to the same
# run on the CPU in fp32 (the reference computed first). Also: data kept on the GPU vs pinned host
# batches copied on a side stream (the same numbers), flips and crops made on the GPU, an
# interrupted run resumed on the GPU, a checkpoint written on the CPU resumed on the GPU, and the
# observability plugins' GPU readings (NVML, MFU, CUDA kernels in the profiler's trace).
#   bash tests/gpu_paths.sh <engine> <work-dir>        (GPU_PATHS_ONLY=regex: only the cases it matches)
set -uo pipefail
engine=$1; work=$2
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if ! nvidia-smi -L >/dev/null 2>&1; then echo "gpu_paths: no CUDA device visible (nvidia-smi -L failed): skipped"; exit 77; fi
rm -rf "$work"; mkdir -p "$work"; cd "$work" || exit 1

data=(); [ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] || data=(--set 'data.name="synthetic"' --set 'data.shape=[1,28,28]')
common=("$root/configs/fashion_mnist.toml" "${data[@]}" --set trainer.max_epochs=1 --set trainer.limit_train_batches=300
        --set trainer.limit_val_batches=10 --set trainer.num_sanity_val_steps=0 --set trainer.enable_progress_bar=false
        --set trainer.seed=1 --set data.num_workers=0)
failed=0
acc_of() { awk '$1 == "test_acc" { print $2 }' "$1"; }
only=${GPU_PATHS_ONLY:-}   # a regular expression: run only the cases it matches (a short device call)
wanted() { [ -z "$only" ] || [[ $1 =~ $only ]]; }
run_case() {  # name, expected device, args... -> the test accuracy in $work/$name.acc
  local name=$1 dev=$2; shift 2
  wanted "$name" || return 1
  local start; start=$(date +%s.%N)   # (no bc on the GPU machine: awk does the arithmetic)
  timeout 300 "$engine" "${common[@]}" --set "trainer.default_root_dir=\"$work/$name\"" "$@" > "$work/$name.out" 2> "$work/$name.err"
  local rc=$? secs; secs=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { print b - a }')
  local acc; acc=$(acc_of "$work/$name.out")
  if [ $rc -ne 0 ] || [ -z "$acc" ]; then
    echo "FAILED $name (exit $rc): $(grep -v '^\[.*info' "$work/$name.err" | tail -3 | tr '\n' ' ')"; failed=1; return 1
  fi
  if ! grep -q "on $dev" "$work/$name.err"; then
    echo "FAILED $name: did not say it trained on $dev: $(grep -m2 -E 'training on|on cuda|on cpu' "$work/$name.err" | tr '\n' ' ')"; failed=1; return 1
  fi
  printf '%-28s test_acc %-8s %6.1f s\n' "$name" "$acc" "$secs"
  echo "$acc" > "$work/$name.acc"
}
close_to() {  # name, reference name, tolerance
  [ -f "$work/$1.acc" ] && [ -f "$work/$2.acc" ] || return 0
  if ! awk -v a="$(cat "$work/$1.acc")" -v b="$(cat "$work/$2.acc")" -v t="$3" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= t) }'; then
    echo "FAILED $1: test_acc $(cat "$work/$1.acc") is not within $3 of $2's $(cat "$work/$2.acc")"; failed=1
  fi
}

run_case cpu_fp32 cpu --set 'trainer.accelerator="cpu"'
run_case cuda_fp32 cuda:0 --set 'trainer.accelerator="cuda"' --set 'data.on_device="false"'
run_case cuda_fp32_on_device cuda:0 --set 'trainer.accelerator="cuda"' --set 'data.on_device="true"'
run_case cuda_fp32_unpinned cuda:0 --set 'trainer.accelerator="cuda"' --set 'data.on_device="false"' --set data.pin_memory=false
# Flips and padded crops made on the GPU from the CPU generator's draws (copied without a sync):
# the same augmented batches as on the CPU.
aug=(--set data.augment_flip=true --set data.augment_crop_padding=2)
run_case cpu_augmented cpu --set 'trainer.accelerator="cpu"' "${aug[@]}"
run_case cuda_augmented cuda:0 --set 'trainer.accelerator="cuda"' --set 'data.on_device="true"' "${aug[@]}"
for p in 16-mixed bf16-mixed bf16-true; do
  run_case "cuda_$p" cuda:0 --set 'trainer.accelerator="cuda"' --set "trainer.precision=\"$p\""
done
# Pure fp16 with SGD: Adam's default eps (1e-8) is below what float16 holds, and 16-true Adam
# trained this CNN to NaN here (0.1 test accuracy); the engine now refuses that eps up front
# (Cli.Float16AdamNeedsAnEpsFloat16CanHold). bf16-true has the exponent range and trains with it.
sgd=(--set 'optimizer.name="sgd"' --set optimizer.lr=0.05 --set optimizer.momentum=0.9)
run_case cuda_fp32_sgd cuda:0 --set 'trainer.accelerator="cuda"' "${sgd[@]}"
run_case cuda_16-true_sgd cuda:0 --set 'trainer.accelerator="cuda"' --set 'trainer.precision="16-true"' "${sgd[@]}"
run_case cuda_ddp_one_rank cuda:0 --plugins ddp --set 'trainer.accelerator="cuda"' --set ddp.timeout=60.0
run_case cuda_ddp_amp16 cuda:0 --plugins ddp --set 'trainer.accelerator="cuda"' --set 'trainer.precision="16-mixed"' --set ddp.timeout=60.0
run_case cuda_sharded cuda:0 --plugins sharded --set 'trainer.accelerator="cuda"'
run_case cuda_offload cuda:0 --plugins offload --set 'trainer.accelerator="cuda"'
run_case cuda_offload_params cuda:0 --plugins offload --set 'trainer.accelerator="cuda"' --set offload.offload_params=true
# Gradient accumulation under offload: the first micro-batch's gradients land in the fp32 host
# buffer straight from the device, the next ones through a pinned staging buffer added on the host.
run_case cuda_fp32_accumulate cuda:0 --set 'trainer.accelerator="cuda"' --set trainer.accumulate_grad_batches=3
run_case cuda_offload_accumulate cuda:0 --plugins offload --set 'trainer.accelerator="cuda"' --set trainer.accumulate_grad_batches=3
run_case cuda_offload_params_accumulate cuda:0 --plugins offload --set 'trainer.accelerator="cuda"' --set trainer.accumulate_grad_batches=3 \
  --set offload.offload_params=true --set 'offload.compute_dtype="bf16"'
# trainer.cuda_graph: forward and backward captured after 3 warm-up steps and replayed; the
# optimizer step (fused AdamW; amp16's unscale and skip decision) runs after each replay.
run_case cuda_graph cuda:0 --set 'trainer.accelerator="cuda"' --set trainer.cuda_graph=true
run_case cuda_graph_16-mixed cuda:0 --set 'trainer.accelerator="cuda"' --set trainer.cuda_graph=true --set 'trainer.precision="16-mixed"'
for c in cuda_graph cuda_graph_16-mixed; do
  if [ -f "$work/$c.acc" ] && ! grep -q "steps replayed" "$work/$c.err"; then echo "FAILED $c: no 'steps replayed' line"; failed=1; fi
  [ -f "$work/$c.err" ] && grep -h "cuda_graph:" "$work/$c.err" | sed "s/^/  $c: /"
done
swa=(--plugins swa,ema --set 'swa.swa_lrs=[0.0005]')   # averaging from early on: its own CPU reference
run_case cpu_swa_ema cpu --set 'trainer.accelerator="cpu"' "${swa[@]}"
run_case cuda_swa_ema cuda:0 --set 'trainer.accelerator="cuda"' "${swa[@]}"

# Observability on the GPU: device_stats' CUDA memory and NVML readings, throughput's MFU against
# the device's peak, and a Kineto trace with CUDA kernels in it (python3: the GPU machine has it).
obs=(--plugins csv,throughput,device_stats,torch_profiler --set 'trainer.accelerator="cuda"' --set trainer.log_every_n_steps=10
     --set throughput.window_size=20)
if run_case cuda_observability cuda:0 "${obs[@]}"; then
  if ! python3 - "$work/cuda_observability" <<'PY'
import csv, glob, json, sys
run = sys.argv[1]
rows = list(csv.DictReader(open(glob.glob(run + "/**/metrics.csv", recursive=True)[0])))
def values(name):
    return [float(r[name]) for r in rows if r.get(name) not in (None, "")]
problems = []
def need(name, lo, hi, some_positive=False):
    v = values(name)
    if not v: problems.append(f"no {name} in metrics.csv"); return
    if not all(lo <= x <= hi for x in v): problems.append(f"{name} outside [{lo}, {hi}]: {min(v)}..{max(v)}")
    if some_positive and max(v) <= 0: problems.append(f"{name} never above 0")
    print(f"  {name}: {len(v)} values, {min(v):.4g}..{max(v):.4g}")
need("device_stats/cuda_allocated_mb", 0.01, 1e6)
need("device_stats/cuda_peak_allocated_mb", 0.01, 1e6)
need("device_stats/gpu_utilization_percent", 0, 100, some_positive=True)
need("device_stats/gpu_power_watts", 1, 2000)
need("train|device|mfu", 1e-7, 1.0)
need("train|device|samples_per_sec", 1, 1e8)
traces = glob.glob(run + "/**/torch_profiler/trace-rank0*.json", recursive=True)
if not traces: problems.append("no torch_profiler trace")
else:
    events = json.load(open(traces[0]))["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    phases = {e.get("name") for e in events if e.get("cat") == "user_annotation"}
    print(f"  trace: {len(events)} events, {len(kernels)} CUDA kernels, Ember ranges {sorted(p for p in phases if p)[:6]}")
    if not kernels: problems.append("the trace has no CUDA kernel events")
for p in problems: print("FAILED cuda_observability: " + p)
sys.exit(1 if problems else 0)
PY
  then failed=1; fi
fi
run_case cuda_nvtx cuda:0 --plugins torch_profiler --set 'trainer.accelerator="cuda"' --set torch_profiler.emit_nvtx=true

# fp32 on the GPU computes what the CPU computes (cuDNN's algorithms differ in rounding only);
# the data's place and pinning change nothing; 16-bit stays within a few points.
close_to cuda_fp32 cpu_fp32 0.02
close_to cuda_fp32_on_device cuda_fp32 0.02
close_to cuda_fp32_unpinned cuda_fp32 0.02
close_to cuda_augmented cpu_augmented 0.02
close_to cuda_16-true_sgd cuda_fp32_sgd 0.05
close_to cuda_graph cuda_fp32 0.02
close_to cuda_graph_16-mixed cuda_16-mixed 0.02
close_to cuda_offload_accumulate cuda_fp32_accumulate 0.02
close_to cuda_offload_params_accumulate cuda_fp32_accumulate 0.05
for c in cuda_16-mixed cuda_bf16-mixed cuda_bf16-true cuda_dp cuda_ddp_one_rank cuda_ddp_amp16 cuda_sharded \
         cuda_offload cuda_offload_params; do
  close_to "$c" cpu_fp32 0.05
done
close_to cuda_swa_ema cpu_swa_ema 0.1   # averaging mid-learning is volatile: 0.72 vs 0.77 measured

# Resume on the GPU: 1 epoch, then resumed to 2, against 2 straight (same test accuracy within noise).
two=(--set 'trainer.accelerator="cuda"' --set trainer.limit_train_batches=150 --set 'trainer.precision="16-mixed"')
run_case cuda_straight cuda:0 "${two[@]}" --set trainer.max_epochs=2
run_case cuda_first cuda:0 "${two[@]}" --set trainer.max_epochs=1 --set 'trainer.default_root_dir="'"$work"'/resumed"'
if ! wanted cuda_resumed; then :
elif timeout 300 "$engine" "${common[@]}" "${two[@]}" --set trainer.max_epochs=2 --set "trainer.default_root_dir=\"$work/resumed\"" \
     --resume last > "$work/cuda_resumed.out" 2> "$work/cuda_resumed.err"; then
  acc_of "$work/cuda_resumed.out" > "$work/cuda_resumed.acc"
  printf '%-28s test_acc %s\n' cuda_resumed "$(cat "$work/cuda_resumed.acc")"
  close_to cuda_resumed cuda_straight 0.01
else
  echo "FAILED cuda_resumed: $(tail -2 "$work/cuda_resumed.err" | tr '\n' ' ')"; failed=1
fi

# A checkpoint written on the CPU resumes on the GPU (weights and optimizer moments move there).
run_case cpu_first cpu --set 'trainer.accelerator="cpu"' --set trainer.limit_train_batches=150 --set trainer.max_epochs=1 \
  --set 'trainer.default_root_dir="'"$work"'/crossed"'
if ! wanted cpu_to_cuda; then :
elif timeout 300 "$engine" "${common[@]}" --set 'trainer.accelerator="cuda"' --set trainer.limit_train_batches=150 --set trainer.max_epochs=2 \
     --set "trainer.default_root_dir=\"$work/crossed\"" --resume last > "$work/cpu_to_cuda.out" 2> "$work/cpu_to_cuda.err" \
   && grep -q "resumed from" "$work/cpu_to_cuda.err" && grep -q "on cuda:0" "$work/cpu_to_cuda.err"; then
  acc_of "$work/cpu_to_cuda.out" > "$work/cpu_to_cuda.acc"
  printf '%-28s test_acc %s\n' cpu_to_cuda "$(cat "$work/cpu_to_cuda.acc")"
else
  echo "FAILED cpu_to_cuda: $(grep -v '^\[.*info' "$work/cpu_to_cuda.err" | tail -2 | tr '\n' ' ')"; failed=1
fi
exit $failed
