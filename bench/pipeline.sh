#!/usr/bin/env bash
# Pipeline stages on CPU ranks (docs/parallelism.md): for each schedule and micro-batch count, rank
# 0's parameters + gradients + optimizer state at the step (the memory_probe test plugin: storage
# sizes of the live tensors) and the step's peak above that (activations kept for backward), the
# step time, and the measured bubble (the share of each training batch rank 0 spent waiting for
# another stage's message, which ddp logs at teardown) against the schedule's theoretical one,
# (p - 1) / (m + p - 1) or (p - 1) / (v m + p - 1) interleaved. The global batch is the same
# everywhere (16 sequences of 16 tokens). The last rows shard each stage over 2 data-parallel
# ranks with ZeRO (sharded stages 1 and 3: 3D without tensor parallelism) against ddp's replicas.
# Per-step time = (time of `long` steps - time of `short` steps) / (long - short), which removes
# start-up. The ranks share this machine's cores (2 on CI-sized machines), so a rank waiting for a
# message leaves its core to the other: times compare the variants' overheads, not a speed-up.
#   bash bench/pipeline.sh [layers=8] [d_model=256] [short=3] [long=6]
#   ONLY="single pp2xzero3dp2-1f1b-m4" bash bench/pipeline.sh   # some variants only
set -euo pipefail
layers=${1:-8}
d=${2:-256}
short=${3:-3}
long=${4:-6}
root=$(cd "$(dirname "$0")/.." && pwd)
engine=${ENGINE:-$root/build/engine/engine}
probe_dir=${PROBE_DIR:-$root/build/test-plugins/good}
work=$(mktemp -d /tmp/ember-bench-pipeline-XXXXXX)
trap 'rm -rf "$work"' EXIT
# shellcheck source=bench/common.sh
source "$root/bench/common.sh"
memory_bench_toml "$layers" "$d" 16 16 > "$work/run.toml"
echo "transformer: $layers layers, d_model $d, 8 heads, global batch 16 x 16 tokens, AdamW, 1 thread per rank"
echo
echo "| variant | strategy | ranks | stages x data | schedule | micro-batches | rank 0 state MB | vs single_device | step peak MB | s/step | measured bubble (rank 0) | theory |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
single_total=""
# name ranks pipeline_parallel schedule microbatches virtual_stages strategy
for variant in "single 1 1 - 0 1 single_device" "dp2 2 1 - 0 1 ddp" "pp2-gpipe-m2 2 2 gpipe 2 1 ddp" "pp2-gpipe-m8 2 2 gpipe 8 1 ddp" \
               "pp2-1f1b-m2 2 2 1f1b 2 1 ddp" "pp2-1f1b-m8 2 2 1f1b 8 1 ddp" "pp2-interleaved-m2 2 2 interleaved_1f1b 2 2 ddp" \
               "pp2-interleaved-m8 2 2 interleaved_1f1b 8 2 ddp" "pp4-1f1b-m8 4 4 1f1b 8 1 ddp" "pp2xdp2-1f1b-m4 4 2 1f1b 4 1 ddp" \
               "pp2xzero1dp2-1f1b-m4 4 2 1f1b 4 1 sharded" "pp2xzero3dp2-1f1b-m4 4 2 1f1b 4 1 sharded"; do
  read -r name ranks pp schedule m v strategy <<<"$variant"
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then continue; fi
  dp=$((ranks / pp))
  args=(--set "data.batch_size=$((16 / dp))")
  if [ "$ranks" -gt 1 ]; then
    args+=(--plugins "$strategy" --set "$strategy.timeout=600.0" --set "parallelism.pipeline_parallel=$pp")
    case $name in *zero1*) args+=(--set "sharded.stage=1") ;; esac
    [ "$pp" -gt 1 ] && args+=(--set "parallelism.schedule=\"$schedule\"" --set "parallelism.microbatches=$m" --set "parallelism.virtual_stages=$v")
  fi
  a=$(probe_run "$ranks" "$short" "${args[@]}")
  b=$(probe_run "$ranks" "$long" "${args[@]}")
  line=$(grep -o 'memory_probe: rank 0 step 2: .*' "$work/err" | head -1)
  total=$(sed -E 's/.* total ([0-9]+) bytes.*/\1/' <<<"$line")
  [ -z "$single_total" ] && single_total=$total
  peak=$(sed -E 's/.* step_peak ([0-9]+) bytes.*/\1/' <<<"$line")
  bubble="-" theory="-"
  if [ "$pp" -gt 1 ]; then
    stats=$(grep -v '\[rank' "$work/err" | grep -o 'pipeline: [0-9]* training batches, [0-9.]*% of their time waiting.*theory: [0-9.]*%' | head -1)
    bubble=$(sed -E 's/.*, ([0-9.]+)% of their time.*/\1%/' <<<"$stats")
    theory=$(sed -E 's/.*theory: ([0-9.]+)%.*/\1%/' <<<"$stats")
  fi
  printf '| %s | %s | %d | %d x %d | %s | %s | %.1f | %.3f | %.1f | %.2f | %s | %s |\n' "$name" "$strategy" "$ranks" "$pp" "$dp" "$schedule" "$m" \
    "$(calc "$total / 1e6")" "$(calc "$total / $single_total")" "$(calc "$peak / 1e6")" "$(calc "($b - $a) / ($long - $short)")" \
    "$bubble" "$theory"
done
