#!/usr/bin/env bash
# Overhead of each observability plugin on the Fashion-MNIST example: the same short run (one
# epoch of `steps` batches, 10 validation batches, no test) with no extra plugin and with each
# plugin, interleaved, `rounds` times. Reports the median wall time of the whole process and of
# the training loop (the engine's "epoch" time from simple_profiler's view is not used, so every
# variant is timed the same way: process start to exit).
#   bash bench/observability.sh [rounds=3] [steps=100]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
rounds=${1:-3}; steps=${2:-100}
engine="$root/${EMBER_BUILD_DIR:-build}/engine/engine"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
cd "$work"
variants=("baseline:" "tensorboard:tensorboard" "tensorboard+histograms:tensorboard" "simple_profiler:simple_profiler"
          "throughput:throughput" "device_stats:device_stats" "torch_profiler:torch_profiler"
          "all:simple_profiler,tensorboard,throughput,device_stats")
common=(--set trainer.max_epochs=1 --set "trainer.limit_train_batches=$steps" --set trainer.limit_val_batches=10
        --set trainer.test_after_fit=false --set trainer.enable_progress_bar=false --set trainer.log_every_n_steps=10
        --set trainer.num_sanity_val_steps=0 --set trainer.enable_model_summary=false)
declare -A times
for r in $(seq "$rounds"); do
  for v in "${variants[@]}"; do
    name=${v%%:*}; plugins=${v#*:}
    extra=(); [ -n "$plugins" ] && extra=(--plugins "csv,$plugins")
    [ "$name" = "tensorboard+histograms" ] && extra+=(--set tensorboard.histogram_every_n_steps=10)
    start=$(date +%s.%N)
    OMP_NUM_THREADS=1 "$engine" "${extra[@]}" "${common[@]}" --set trainer.num_threads=1 \
        --set "trainer.default_root_dir=\"$work/runs-$name-$r\"" "$root/configs/fashion_mnist.toml" 2> "$work/log-$name-$r"
    end=$(date +%s.%N)
    times[$name]+="$(awk -v a="$start" -v b="$end" 'BEGIN { print b - a }') "   # awk, not bc: the GPU machine has no bc
  done
done
echo "| variant | median s (of $rounds) | vs baseline | per step (ms) |"
echo "|---|---|---|---|"
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
base=$(echo "${times[baseline]}" | median)
for v in "${variants[@]}"; do
  name=${v%%:*}
  m=$(echo "${times[$name]}" | median)
  printf "| %s | %.2f | %+.1f%% | %+.2f |\n" "$name" "$m" "$(awk -v m="$m" -v b="$base" 'BEGIN { print (m / b - 1) * 100 }')" \
         "$(awk -v m="$m" -v b="$base" -v s="$steps" 'BEGIN { print (m - b) * 1000 / s }')"
done
grep -h "Profiler overhead" "$work"/runs-simple_profiler-*/fashion_mnist/version_0/simple_profiler.txt | sed 's/^/simple_profiler: /'
