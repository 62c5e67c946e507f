#!/usr/bin/env bash
# Device meshes on CPU ranks (docs/parallelism.md): bytes of parameters + gradients + trained
# shards + optimizer state resident on rank 0 at the step (the memory_probe test plugin: storage
# sizes of the live tensors, not computed from parameter counts), the step's peak above that
# (activations kept for backward, gradients being made, communication buffers: a counting
# allocator over the batch's forward and backward) and step time, for data parallel (ddp), tensor
# parallel with and without sequence parallelism, both (ddp 2 x 2), ZeRO-3 alone and ZeRO-3 x
# tensor parallel (2D), hybrid sharding (2 replicas x ZeRO-3 over 2), on a transformer of about 25M parameters. The global batch is the same everywhere (8 sequences of 16
# tokens): each data-parallel rank takes 8 / data-parallel ranks.
# Per-step time = (time of `long` steps - time of `short` steps) / (long - short), which removes
# start-up. The ranks share this machine's cores (2 on CI-sized machines), so times compare the
# variants' overheads, not a speed-up.
#   bash bench/mesh.sh [layers=8] [d_model=512] [short=3] [long=6] [seq_len=16]
# (a long sequence makes the activations, not the state, the larger part: bash bench/mesh.sh 4 256 2 4 256)
# ONLY="single zero3x4 hsdp2x2" runs those variants only.
set -euo pipefail
layers=${1:-8}
d=${2:-512}
short=${3:-3}
long=${4:-6}
seq=${5:-16}
root=$(cd "$(dirname "$0")/.." && pwd)
engine=${ENGINE:-$root/build/engine/engine}
probe_dir=${PROBE_DIR:-$root/build/test-plugins/good}
work=$(mktemp -d /tmp/ember-bench-mesh-XXXXXX)
trap 'rm -rf "$work"' EXIT
# shellcheck source=bench/common.sh
source "$root/bench/common.sh"
memory_bench_toml "$layers" "$d" "$seq" 8 > "$work/run.toml"
echo "transformer: $layers layers, d_model $d, 8 heads, global batch 8 x $seq tokens, AdamW, 1 thread per rank"
echo
echo "| mesh | strategy | ranks | data (replicas x shards) x tensor | rank 0 state MB (params + grads + trained shards + optimizer) | vs single_device | step peak MB | s/step |"
echo "|---|---|---|---|---|---|---|---|"
single_total=""
# name strategy ranks tensor_parallel sequence_parallel [data_parallel_replicate]
for variant in "single single_device 1 1 false" "dp2 ddp 2 1 false" "tp2 ddp 2 2 false" "tp2+sp ddp 2 2 true" "dp4 ddp 4 1 false" \
               "dp2xtp2 ddp 4 2 false" "tp4 ddp 4 4 false" "tp4+sp ddp 4 4 true" "zero3x4 sharded 4 1 false" \
               "zero3x2xtp2 sharded 4 2 false" "hsdp2x2 sharded 4 1 false 2"; do
  read -r name strategy ranks tp sp rep <<<"$variant"
  rep=${rep:-1}
  [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]] && continue
  dp=$((ranks / tp))
  args=(--set "data.batch_size=$((8 / dp))")
  [ "$strategy" != single_device ] && args+=(--plugins "$strategy" --set "parallelism.tensor_parallel=$tp" --set "$strategy.timeout=600.0"
                                             --set "parallelism.sequence_parallel=$sp" --set "parallelism.data_parallel_replicate=$rep")
  a=$(probe_run "$ranks" "$short" "${args[@]}")
  b=$(probe_run "$ranks" "$long" "${args[@]}")
  line=$(grep -o 'memory_probe: rank 0 step 2: .*' "$work/err" | head -1)
  total=$(sed -E 's/.* total ([0-9]+) bytes.*/\1/' <<<"$line")
  [ -z "$single_total" ] && single_total=$total
  parts=$(sed -E 's/.*parameters ([0-9]+) gradients ([0-9]+) trained ([0-9]+) optimizer_state ([0-9]+).*/\1 \2 \3 \4/' <<<"$line")
  read -r p g t o <<<"$parts"
  peak=$(sed -E 's/.* step_peak ([0-9]+) bytes.*/\1/' <<<"$line")
  dims="$dp"; [ "$rep" -gt 1 ] && dims="$dp ($rep x $((dp / rep)))"
  printf '| %s | %s | %d | %s x %d | %.1f (%.1f + %.1f + %.1f + %.1f) | %.3f | %.1f | %.2f |\n' "$name" "$strategy" "$ranks" "$dims" "$tp" \
    "$(calc "$total / 1e6")" "$(calc "$p / 1e6")" "$(calc "$g / 1e6")" "$(calc "$t / 1e6")" "$(calc "$o / 1e6")" \
    "$(calc "$total / $single_total")" "$(calc "$peak / 1e6")" "$(calc "($b - $a) / ($long - $short)")"
done
