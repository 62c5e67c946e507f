#!/usr/bin/env bash
# examples/fabric_loop and examples/embed_trainer built out of tree against the installed packages
# (find_package(Ember)). embed_trainer trains its own network through ember::Run with the checkpoint
# and early_stopping plugins and must read back a test accuracy above 0.9. fabric_loop is
# trained with ddp on 2 CPU ranks in bf16-mixed: the loss must go down, both ranks must end with
# the same weights byte for byte, and a run resumed from a saved state must end exactly where an
# uninterrupted run of the same steps ends.
#   fabric_loop.sh <ember build dir> <scratch dir>
set -euo pipefail
build=$1
work=$2
src=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
rm -rf "$work"
mkdir -p "$work"
prefix="$work/prefix"
cmake --install "$build" --prefix "$prefix" >/dev/null
test -f "$prefix/lib/cmake/Ember/EmberConfig.cmake"
test -f "$prefix/include/ember/fabric.h"
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S "$src/examples/fabric_loop" -B "$work/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" -DTorch_DIR="$TORCH_DIR" "${launcher[@]}" > "$work/configure.log" 2>&1 || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
exe="$work/build/fabric_loop"
# Linked against the installed libember.so, with no toml++/spdlog/Boost of its own.
# Not `ldd | grep -q`: under pipefail grep's early exit can kill ldd with SIGPIPE and fail the check.
libs=$(ldd "$exe")
grep -q "libember.so.* => $prefix/lib/libember.so" <<<"$libs" || { echo "$libs"; exit 1; }
cd "$work"
unset EMBER_PLUGIN_PATH  # plugins come from <prefix>/lib/ember/plugins, next to libember.so
data=()
[ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] || data=(--synthetic)
common=(--strategy ddp --devices 2 --precision bf16-mixed --accelerator cpu --threads 1 --batch 32 --limit 4096 "${data[@]}")

run() {  # name, args...: runs the example, keeps its output in <name>.out / <name>.err
  local name=$1
  shift
  timeout 300 "$exe" "${common[@]}" "$@" > "$name.out" 2> "$name.err" || { echo "fabric_loop $* failed:"; cat "$name.err"; exit 1; }
}

# The plugins are the installed ones, found next to libember.so (dladdr), not the build tree's.
LD_DEBUG=files timeout 120 "$exe" --strategy single_device --accelerator cpu --synthetic --limit 256 --batch 32 --steps 2 \
  > located.out 2> located.err || { cat located.err | grep -v "^ *[0-9]*:" ; exit 1; }
grep -q "file=$prefix/lib/ember/plugins/libsingle_device.so" located.err ||
  { echo "single_device was not loaded from $prefix/lib/ember/plugins:"; grep "plugins/lib" located.err; exit 1; }

run full --steps 40 --weights full
cat full.out
read -r first last < <(sed -n 's/.*loss \([0-9.]*\) -> \([0-9.]*\).*/\1 \2/p' full.out)
[ -n "$first" ] || { echo "no loss line"; cat full.out full.err; exit 1; }
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < 0.8 * a) }' || { echo "loss did not go down: $first -> $last"; exit 1; }
grep -q "ddp on 2 rank(s), bf16" full.out || { echo "not ddp/bf16 on 2 ranks"; cat full.out; exit 1; }
cmp full.rank0 full.rank1 || { echo "the two ranks ended with different weights"; exit 1; }

# 25 steps, save; resume for the remaining 15: the same weights as the uninterrupted 40.
run first --steps 25 --save state.ckpt
test -f state.ckpt
run resumed --steps 40 --resume state.ckpt --weights resumed
grep -q "resumed from state.ckpt at step 25" resumed.out || { cat resumed.out resumed.err; exit 1; }
cmp full.rank0 resumed.rank0 || { echo "the resumed run does not end where the uninterrupted one does"; exit 1; }
cmp resumed.rank0 resumed.rank1
# ZeRO-3 through the same program: parameters sharded between steps, read back gathered.
run sharded --strategy sharded --precision 32-true --steps 12 --weights sharded
grep -q "sharded on 2 rank(s)" sharded.out || { cat sharded.out sharded.err; exit 1; }
cmp sharded.rank0 sharded.rank1 || { echo "sharded: the ranks' gathered weights differ"; exit 1; }

# The embeddable trainer: a program with its own module and data, plugins by name, results read back.
cmake -S "$src/examples/embed_trainer" -B "$work/build-embed" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" -DTorch_DIR="$TORCH_DIR" "${launcher[@]}" > "$work/configure-embed.log" 2>&1 ||
  { cat "$work/configure-embed.log"; exit 1; }
cmake --build "$work/build-embed" > "$work/build-embed.log" 2>&1 || { cat "$work/build-embed.log"; exit 1; }
timeout 300 "$work/build-embed/embed_trainer" "$work/embed-runs" > embed.out 2> embed.err || { echo "embed_trainer failed:"; cat embed.out embed.err; exit 1; }
cat embed.out
grep -q "^best checkpoint: $work/embed-runs/embed_trainer/version_0/checkpoints/" embed.out || { echo "no best checkpoint read back"; exit 1; }

echo "fabric_loop built against the installed Ember package: ddp x 2, bf16-mixed, loss $first -> $last, ranks identical, resume exact"
