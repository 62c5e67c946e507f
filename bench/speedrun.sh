#!/usr/bin/env bash
# Time to accuracy, side by side in one run: the recipe of configs/fashion_mnist_speedrun.toml
# (network, data order, augmentation, optimizer, one-cycle schedule, label smoothing) trained by
#   - Ember with its defaults (csv logger, progress lines, the config as written),
#   - plain PyTorch (bench/speedrun.py torch) with PyTorch's defaults,
#   - PyTorch Lightning (bench/speedrun.py lightning) with Lightning's defaults,
# on the same LibTorch wheel, one after the other, `rounds` times (interleaved, so a noisy
# neighbour slows them alike). Each side evaluates test accuracy after every epoch. Reported per
# side: seconds from the start of training to the end of the first epoch whose test accuracy
# reaches the target (median over rounds; evaluation time included), the final accuracy,
# training samples per second of epoch time (evaluation included, alike for every side), peak
# host RSS (and CUDA memory), and the whole process's wall time (start-up, imports and data
# loading included). Printed first: the CPU model and its SIMD flags, LibTorch and Lightning versions.
#   bash bench/speedrun.sh [rounds] [target] [config] [device]
#   bash bench/speedrun.sh 1 0.925                                          (this CPU)
#   bash bench/speedrun.sh 1 0.93 configs/fashion_mnist_speedrun_gpu.toml cuda   (a GPU)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
rounds=${1:-1}; target=${2:-0.925}; config=${3:-configs/fashion_mnist_speedrun.toml}; device=${4:-cpu}
build=${EMBER_BUILD_DIR:-build}
torch_prefix=${EMBER_TORCH_PREFIX:-$(bash scripts/setup.sh | tail -n 1)}   # EMBER_TORCH_PREFIX: a given LibTorch (the GPU machine's), no set-up
cmake --build "$build" --target engine ember_plugin_cnn ember_plugin_fashion_mnist ember_plugin_single_device \
  ember_plugin_fp32 ember_plugin_bf16 ember_plugin_amp16 ember_plugin_csv ember_plugin_checkpoint ember_plugin_model_summary \
  ember_plugin_one_cycle >/dev/null
python=$(cd "$torch_prefix/../../../../../.." && pwd)/bin/python   # the venv that holds the torch wheel
[ -x "$python" ] || python=python3
"$python" -c "import lightning" 2>/dev/null || "$python" -m pip install -q "lightning==2.6.*" >/dev/null
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //') ($(nproc) usable cpus)"
echo "cpu flags: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|avx512f|avx512_bf16|avx512_fp16|amx_bf16|amx_tile|amx_fp16|fma)$' | tr '\n' ' ')"
"$python" -c "import torch, lightning; print(f'torch {torch.__version__} (cpu capability {torch.backends.cpu.get_cpu_capability()}), lightning {lightning.__version__}')"
if [ "$device" = cuda ]; then
  "$python" -c "import torch; print('gpu:', torch.cuda.get_device_name(0))"
fi
echo "recipe: $config, target test accuracy $target, device $device"
echo

engine_args=("$build/engine/engine" --set "trainer.default_root_dir=\"$work/runs\"")
[ "$device" = cuda ] && engine_args+=(--set 'trainer.accelerator="cuda"') || engine_args+=(--set 'trainer.accelerator="cpu"')
run_side() {  # side -> the side's output in $work/<side>.<round>
  case $1 in
    ember) SPEEDRUN_WORK=$work "$python" bench/speedrun.py ember "$config" "${engine_args[@]}" ;;
    *) SPEEDRUN_WORK=$work "$python" bench/speedrun.py "$1" "$config" "$device" 2>"$work/$1.err" || { cat "$work/$1.err" >&2; exit 1; } ;;
  esac
}
for r in $(seq 1 "$rounds"); do
  for side in ember torch lightning; do
    run_side $side > "$work/$side.$r"
  done
done

report() {  # side -> one line: median over rounds of the time to target; the last round's other figures
  cat "$work/$1".* | awk -v side="$1" -v target="$target" '
    $1 == "epoch" { acc = $4; if (!hit && $4 >= target) { hit = 1; t[++n] = $5 } }
    $1 == "summary" {
      if (!hit) t[++n] = -1
      hit = 0; final = acc; cuda = ""
      for (i = 2; i < NF; i += 2) {
        if ($i == "samples_per_sec") sps = $(i + 1)
        if ($i == "peak_rss_mb") rss = $(i + 1) " MB"
        if ($i == "peak_cuda_mb") cuda = " (cuda " $(i + 1) " MB)"
        if ($i == "process_s") proc = $(i + 1) " s"
      }
    }
    END {
      # median of the times to target (a round that missed the target counts as infinitely slow)
      for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if ((t[j] >= 0 && t[j] < t[i]) || t[i] < 0) { x = t[i]; t[i] = t[j]; t[j] = x }
      med = t[int((n + 1) / 2)]
      printf "%-10s %16s %10s %12s %22s %10s\n", side, (med < 0 ? "not reached" : sprintf("%.1f s", med)), final, sps, rss cuda, proc
      print med > "/dev/stderr"
    }' 2>"$work/$1.median"
}
printf "%-10s %16s %10s %12s %22s %10s\n" side "time to target" "final acc" "samples/s" "peak memory" "process"
for side in ember torch lightning; do report $side; done
e=$(cat "$work/ember.median"); l=$(cat "$work/lightning.median"); t=$(cat "$work/torch.median")
echo
awk -v e="$e" -v l="$l" -v t="$t" 'BEGIN {
  if (e > 0 && l > 0) printf "Ember is %.2fx faster to the target than Lightning", l / e
  if (e > 0 && t > 0) printf " and %.2fx faster than plain PyTorch", t / e
  print "" }'
echo
echo "per epoch (round 1): epoch, cumulative epoch seconds (evaluation included), test accuracy, seconds since training started"
for side in ember torch lightning; do echo "$side:"; grep '^epoch' "$work/$side.1" | sed 's/^/  /'; done
