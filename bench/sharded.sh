#!/usr/bin/env bash
# sharded vs ddp on CPU: bytes of parameters + gradients + optimizer state resident on each rank
# at the step (measured by the memory_probe test plugin: storage sizes of the live tensors and a
# counting allocator around the first step, not computed from parameter counts), and step time,
# for ZeRO stages 0 (ddp) to 3 with 1, 2 and 3 ranks, on a transformer of about 50M parameters
# (the size the sharded issue asks for).
# Per-step time = (time of a run of `long` steps - time of `short` steps) / (long - short), which
# removes start-up. Ranks share this machine's cores, so times compare variants, not hardware.
#   bash bench/sharded.sh [layers=16] [d_model=512] [short=3] [long=6]
set -euo pipefail
layers=${1:-16}
d=${2:-512}
short=${3:-3}
long=${4:-6}
root=$(cd "$(dirname "$0")/.." && pwd)
engine=${ENGINE:-$root/build/engine/engine}
probe_dir=${PROBE_DIR:-$root/build/test-plugins/good}
work=$(mktemp -d /tmp/ember-bench-sharded-XXXXXX)
trap 'rm -rf "$work"' EXIT
# shellcheck source=bench/common.sh
source "$root/bench/common.sh"
memory_bench_toml "$layers" "$d" 16 2 > "$work/run.toml"
echo "transformer: $layers layers, d_model $d, batch 2 x 16 tokens per rank, AdamW, 1 thread per rank"
echo
echo "| variant | ranks | rank 0 state MB (params + grads + trained shards + optimizer) | vs ddp same ranks | s/step |"
echo "|---|---|---|---|---|"
for ranks in 1 2 3; do
  ddp_total=""
  for variant in ddp sharded1 sharded2 sharded3; do
    case $variant in
      ddp) args=(--plugins ddp) ;;
      sharded*) args=(--plugins sharded --set "sharded.stage=${variant#sharded}") ;;
    esac
    a=$(probe_run "$ranks" "$short" "${args[@]}")
    b=$(probe_run "$ranks" "$long" "${args[@]}")
    line=$(grep -o 'memory_probe: rank 0 step 2: .*' "$work/err" | head -1)
    total=$(sed -E 's/.* total ([0-9]+) bytes.*/\1/' <<<"$line")
    [ -z "$ddp_total" ] && ddp_total=$total
    parts=$(sed -E 's/.*parameters ([0-9]+) gradients ([0-9]+) trained ([0-9]+) optimizer_state ([0-9]+).*/\1 \2 \3 \4/' <<<"$line")
    read -r p g t o <<<"$parts"
    printf '| %s | %d | %.1f (%.1f + %.1f + %.1f + %.1f) | %.3f | %.2f |\n' "$variant" "$ranks" \
      "$(calc "$total / 1e6")" "$(calc "$p / 1e6")" "$(calc "$g / 1e6")" "$(calc "$t / 1e6")" "$(calc "$o / 1e6")" \
      "$(calc "$total / $ddp_total")" "$(calc "($b - $a) / ($long - $short)")"
  done
done
