#!/usr/bin/env bash
# The step stall of a checkpoint, synchronous (checkpoint.async = false) against asynchronous
# (true), for a 500 MB model state: an MLP of 125.8 M float32 parameters (4096 -> 8192 -> 8192 ->
# 3072 -> 10) trained with plain SGD (no optimizer state, so the checkpoint is the 503 MB of
# weights), batch 8, saving every 10 steps (3 saves in 39 steps; no last.ckpt, so nothing is saved
# when the run ends). Three variants side by side, interleaved for `rounds` rounds, the fastest
# round of each kept:
#   none   no checkpoint at all (save_top_k = 0)
#   sync   every save stops training for the whole write (pickle, CRC32C, write, fsync, rename)
#   async  a save copies the state to host memory and training goes on while a thread writes it
# Stall per save = (run time - the run without checkpoints) / 3: everything the saves cost the
# training, the copy and the slowdown of sharing the cores with the writer included. "Blocked" is
# the part the training thread itself waits for: the whole write when synchronous, the copy to host
# memory when asynchronous (the engine's --verbose line "the state was copied ... in N ms").
# Each variant runs with the machine's cores for the training (OMP_NUM_THREADS unset) and with one
# thread (a core left over, as on a GPU machine whose CPU cores are mostly idle while it trains).
# With accelerator = cuda the model trains on the GPU and an asynchronous save copies the state into
# pinned host memory (one copy per tensor, then one synchronisation) before the thread writes it;
# a step takes about a millisecond there, so the saves come every 1,000 steps instead of 10 (3,999
# steps): time enough for a write to finish before the next save (which would wait for it).
#   bash bench/async_checkpoint.sh [rounds=2] [accelerator=cpu]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# shellcheck source=bench/common.sh
source bench/common.sh
build=${EMBER_BUILD_DIR:-build}
cmake --build "$build" --target engine ember_plugin_checkpoint ember_plugin_mlp ember_plugin_synthetic >/dev/null
rounds=${1:-2}
accelerator=${2:-cpu}
threads=""
every=10
[ "$accelerator" = cuda ] && every=1000
work=$(mktemp -d "$root/$build/bench-async-checkpoint.XXXXXX")
trap 'rm -rf "$work"' EXIT
cat >"$work/run.toml" <<TOML
[trainer]
max_epochs = -1
max_steps = $((4 * every - 1))
num_sanity_val_steps = 0
enable_progress_bar = false
enable_model_summary = false
logger = false
[model]
name = "mlp"
input_size = 4096
hidden = [8192, 8192, 3072]
num_classes = 10
[data]
name = "synthetic"
shape = [4096]
num_train = 4096
num_val = 8
batch_size = 8
[optimizer]
name = "sgd"
lr = 0.001
[checkpoint]
every_n_train_steps = $every
save_top_k = -1
save_last = false
TOML
declare -A best blocked
run() {
  local name=$1
  shift
  rm -rf "$work/runs"
  local t0 t1
  t0=$(date +%s.%N)
  (cd "$work" && env $threads "$root/$build/engine/engine" run.toml --verbose --set trainer.accelerator=\""$accelerator"\" "$@" >/dev/null 2>"$work/$name.log") ||
    { cat "$work/$name.log" >&2; exit 1; }
  t1=$(date +%s.%N)
  local t
  t=$(calc "$t1 - $t0")
  if [ -z "${best[$name]:-}" ] || [ "$(calc "$t < ${best[$name]}")" = "1.000" ]; then best[$name]=$t; fi
  if [ "${name%-*}" != none ]; then
    local n
    n=$(find "$work/runs" -name '*.ckpt' | wc -l)
    [ "$n" = 3 ] || { echo "$name: expected 3 checkpoints, found $n" >&2; exit 1; }
  fi
  if [ "${name%-*}" = async ]; then
    # The mean copy time of the 3 saves, in seconds.
    blocked[$name]=$(grep -o 'copied for a background write in [0-9]* ms' "$work/$name.log" |
      awk '{ s += $(NF-1); each = each sep $(NF-1); sep = ", " } END { printf "%.3f (%s ms)", s / NR / 1000, each }')
  fi
}
echo "accelerator: $accelerator"
echo
echo "| training threads | variant | run (s, best of $rounds) | stall per save (s) | vs sync | training thread blocked per save (s) | vs sync |"
echo "|---|---|---|---|---|---|---|"
for threads in "" "OMP_NUM_THREADS=1"; do
  for ((r = 0; r < rounds; r++)); do
    run none-$r --set checkpoint.save_top_k=0
    run sync-$r
    run async-$r --set checkpoint.async=true
  done
  # best of the rounds
  for v in none sync async; do
    b=""
    for ((r = 0; r < rounds; r++)); do
      t=${best[$v-$r]}
      if [ -z "$b" ] || [ "$(calc "$t < $b")" = "1.000" ]; then b=$t; bb=${blocked[$v-$r]:-}; fi
      unset "best[$v-$r]"
    done
    best[$v]=$b
    blocked[$v]=$bb
  done
  label=${threads:-"all cores"}
  stall_sync=$(calc "(${best[sync]} - ${best[none]}) / 3")
  stall_async=$(calc "(${best[async]} - ${best[none]}) / 3")
  echo "| $label | none | ${best[none]} | - | - | - | - |"
  echo "| $label | sync, 503 MB state | ${best[sync]} | $stall_sync | 1.00 | $stall_sync | 1.00 |"
  echo "| $label | async, 503 MB state | ${best[async]} | $stall_async | $(calc "$stall_async / $stall_sync") | ${blocked[async]} | $(calc "${blocked[async]%% *} / $stall_sync") |"
done
