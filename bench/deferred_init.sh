#!/usr/bin/env bash
# Per-rank host memory at set-up with and without deferred initialisation (docs/parallelism.md):
# a 16-layer transformer of width 512 (feed-forward 2048; 50.4 M parameters, 192 MB in float32,
# 12.0 MB a layer) built and set up under sharded stage 3 and offload (offload_params) on 1, 2
# and 4 CPU ranks (and 4 as 2 pipeline stages x 2 shards, and as 2 shards x 2 tensor-parallel
# ranks), under ddp's 2 pipeline stages and 2 tensor-parallel ranks, and under single_device. Each rank logs "model set-up: host memory peak +X MB":
# its resident set's high-water mark from just before the model is built to the end of the
# strategy's set-up, above what it held before. The table shows rank 0's, next to the model's
# share per rank (model / N) and that share plus one layer.
#   bash bench/deferred_init.sh
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
build=${EMBER_BUILD_DIR:-build}
cmake --build "$build" --target engine ember_plugin_sharded ember_plugin_offload ember_plugin_ddp ember_plugin_transformer ember_plugin_synthetic >/dev/null
work=$(mktemp -d "$root/$build/bench-deferred-init.XXXXXX")
trap 'rm -rf "$work"' EXIT
cat >"$work/run.toml" <<'TOML'
[trainer]
accelerator = "cpu"
max_steps = 1
num_sanity_val_steps = 0
enable_progress_bar = false
enable_model_summary = false
enable_checkpointing = false
logger = false
[model]
name = "transformer"
d_model = 512
nhead = 4
dim_feedforward = 2048
num_layers = 16
dropout = 0.0
num_classes = 4
[data]
name = "synthetic"
shape = [2, 512]
num_classes = 4
num_train = 8
num_val = 4
num_test = 0
batch_size = 2
[optimizer]
name = "sgd"
lr = 0.01
TOML
cd "$work"
engine="$root/$build/engine/engine"
model_mb=$(python3 -c 'print(f"{50440196 * 4 / 2**20:.1f}")')
layer_mb=$(python3 -c 'print(f"{3152384 * 4 / 2**20:.1f}")')
peak() {  # rank 0's set-up peak of one run
  OMP_NUM_THREADS=1 "$engine" run.toml "$@" 2>&1 | grep -v '\[rank' | sed -n 's/.*model set-up: host memory peak +\([0-9.]*\) MB.*/\1/p' | head -1
}
echo "model: ${model_mb} MB, one layer: ${layer_mb} MB"
echo
echo "| strategy | ranks | model / N | + one layer | deferred: peak per rank | built whole: peak per rank | deferred / whole |"
echo "|---|---|---|---|---|---|---|"
echo "| single_device | 1 | ${model_mb} | | | $(peak) | |"
for strategy in sharded offload; do
  extra=()
  [ "$strategy" = offload ] && extra=(--set offload.offload_params=true)
  for n in 1 2 4; do
    share=$(python3 -c "print(f'{${model_mb} / $n:.1f}')")
    plus=$(python3 -c "print(f'{${model_mb} / $n + ${layer_mb}:.1f}')")
    d=$(peak --plugins "$strategy" --set "$strategy.timeout=120.0" --set "trainer.devices=$n" "${extra[@]}")
    w=$(peak --plugins "$strategy" --set "$strategy.timeout=120.0" --set "trainer.devices=$n" --set "$strategy.deferred_init=false" "${extra[@]}")
    echo "| $strategy | $n | $share | $plus | $d | $w | $(python3 -c "print(f'{$d / $w:.2f}')") |"
  done
  # 2 pipeline stages x 2 shards: the model is built once for its shapes, then each rank keeps its
  # shard of its own stage.
  share=$(python3 -c "print(f'{${model_mb} / 4:.1f}')")
  plus=$(python3 -c "print(f'{${model_mb} / 4 + ${layer_mb}:.1f}')")
  mesh=(--set "trainer.devices=4" --set "parallelism.pipeline_parallel=2")
  d=$(peak --plugins "$strategy" --set "$strategy.timeout=120.0" "${mesh[@]}" "${extra[@]}")
  w=$(peak --plugins "$strategy" --set "$strategy.timeout=120.0" "${mesh[@]}" --set "$strategy.deferred_init=false" "${extra[@]}")
  echo "| $strategy, 2 stages x 2 shards | 4 | $share | $plus | $d | $w | $(python3 -c "print(f'{$d / $w:.2f}')") |"
  # 2 shards x 2 tensor-parallel ranks: each rank keeps its shard of its slice (the norms, biases
  # and head, which every tensor-parallel rank holds whole, a little above a quarter).
  mesh=(--set "trainer.devices=4" --set "parallelism.tensor_parallel=2")
  d=$(peak --plugins "$strategy" --set "$strategy.timeout=120.0" "${mesh[@]}" "${extra[@]}")
  w=$(peak --plugins "$strategy" --set "$strategy.timeout=120.0" "${mesh[@]}" --set "$strategy.deferred_init=false" "${extra[@]}")
  echo "| $strategy, 2 shards x 2 tensor-parallel | 4 | $share | $plus | $d | $w | $(python3 -c "print(f'{$d / $w:.2f}')") |"
done
# ddp's 2 pipeline stages: each rank keeps its stage's parameters whole.
share=$(python3 -c "print(f'{${model_mb} / 2:.1f}')")
plus=$(python3 -c "print(f'{${model_mb} / 2 + ${layer_mb}:.1f}')")
mesh=(--plugins ddp --set "ddp.timeout=120.0" --set "trainer.devices=2" --set "parallelism.pipeline_parallel=2")
d=$(peak "${mesh[@]}")
w=$(peak "${mesh[@]}" --set "ddp.deferred_init=false")
echo "| ddp, 2 stages | 2 | $share | $plus | $d | $w | $(python3 -c "print(f'{$d / $w:.2f}')") |"
# ddp's 2 tensor-parallel ranks: each rank keeps its slice of the split parameters and the norms,
# biases and head whole (a little above half).
mesh=(--plugins ddp --set "ddp.timeout=120.0" --set "trainer.devices=2" --set "parallelism.tensor_parallel=2")
d=$(peak "${mesh[@]}")
w=$(peak "${mesh[@]}" --set "ddp.deferred_init=false")
echo "| ddp, 2 tensor-parallel | 2 | $share | $plus | $d | $w | $(python3 -c "print(f'{$d / $w:.2f}')") |"
