#!/usr/bin/env bash
# Out-of-tree plugin check: install the engine and SDK into a prefix, build examples/hello_callback
# against the installed SDK only (find_package(EmberSDK)), install it into the same prefix, and
# train with the installed engine loading it. Then do the same for every plugin folder under
# plugins/callbacks and plugins/schedulers: one generated project add_subdirectory()s them all
# against the installed SDK, its builds replace the installed copies, and the installed engine
# must load each of them. The schedulers, swa, ema and lr_monitor link Ember::support, so their
# builds prove that the support headers and target are installed and exported with the SDK.
#   out_of_tree.sh <ember build dir> <scratch dir>
set -euo pipefail
build=$1
work=$2
src=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
rm -rf "$work"
mkdir -p "$work"
prefix="$work/prefix"
cmake --install "$build" --prefix "$prefix" >/dev/null
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S "$src/examples/hello_callback" -B "$work/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" -DTorch_DIR="$TORCH_DIR" -DCMAKE_INSTALL_PREFIX="$prefix" "${launcher[@]}" >/dev/null
cmake --build "$work/build" >/dev/null
cmake --install "$work/build" >/dev/null
test -f "$prefix/lib/ember/plugins/libhello_callback.so"
cd "$work"
# Only the installed folder: no build-tree plugins, no EMBER_PLUGIN_PATH.
unset EMBER_PLUGIN_PATH
info=$("$prefix/bin/engine" plugins info hello_callback)   # captured: `| grep -q` can SIGPIPE it under pipefail
grep -q "kind:        callback" <<<"$info"
cat > run.toml <<'TOML'
[trainer]
max_epochs = 2
enable_progress_bar = false
[model]
name = "mlp"
input_size = 8
hidden = [4]
[data]
name = "synthetic"
shape = [8]
num_train = 64
[hello_callback]
greeting = "hello from out of tree"
TOML
"$prefix/bin/engine" --plugins hello_callback run.toml 2> err.txt
grep -q "hello from out of tree: epoch 1 ended at step" err.txt || { cat err.txt; exit 1; }
echo "out-of-tree plugin built against the installed SDK and loaded by the installed engine"

# The project's own callback and scheduler plugins, built the same way.
test -f "$prefix/include/ember/support/lr_schedule.h" || { echo "the SDK install has no <ember/support/lr_schedule.h>"; exit 1; }
grep -q 'Ember::support' "$prefix"/lib*/cmake/EmberSDK/EmberSDKTargets.cmake || { echo "EmberSDKTargets.cmake exports no Ember::support"; exit 1; }
bundled="$work/bundled"
mkdir -p "$bundled"
names=()
{
  echo 'cmake_minimum_required(VERSION 3.25)'
  echo 'project(ember_bundled_plugins LANGUAGES CXX)'
  echo 'set(TORCH_CUDA_ARCH_LIST "9.0" CACHE STRING "")'
  echo 'find_package(EmberSDK 0.1 REQUIRED)'
  for dir in "$src"/plugins/callbacks/*/ "$src"/plugins/schedulers/*/; do
    [ -f "$dir/CMakeLists.txt" ] || continue
    name=$(basename "$dir")
    names+=("$name")
    echo "add_subdirectory(\"${dir%/}\" \"$name\")"
  done
} > "$bundled/CMakeLists.txt"
[ ${#names[@]} -gt 0 ] || { echo "no plugin folders found under $src/plugins/{callbacks,schedulers}"; exit 1; }
# Many plugins in one project: they share one precompiled LibTorch header (EMBER_PLUGIN_PCH), which
# must really be used (-Werror=invalid-pch: a header GCC ignores fails the build instead of slowing it).
# No optimisation (an empty build type): what is proven is that they build against the installed SDK
# and load into the installed engine. Measured on 2 cores, ccache off: 390 s at -O2 alone (CI), 318 s
# with the shared header, 260 s with it and no optimisation.
cmake -S "$bundled" -B "$bundled/build" "${gen[@]}" -DCMAKE_BUILD_TYPE= -DEMBER_PLUGIN_PCH=ON \
  -DCMAKE_CXX_FLAGS=-Werror=invalid-pch \
  -DCMAKE_PREFIX_PATH="$prefix" -DTorch_DIR="$TORCH_DIR" -DCMAKE_INSTALL_PREFIX="$prefix" "${launcher[@]}" >/dev/null
CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime \
  cmake --build "$bundled/build" -j2 > "$bundled/build.log" 2>&1 || { cat "$bundled/build.log"; exit 1; }
grep -q 'ember_plugin_pch' "$bundled/build/build.ninja" "$bundled/build/Makefile" 2>/dev/null ||
  { echo "EMBER_PLUGIN_PCH=ON made no shared precompiled header"; exit 1; }
for name in "${names[@]}"; do
  test -f "$bundled/build/$name/lib$name.so" || { echo "out-of-tree build made no lib$name.so"; exit 1; }
  rm -f "$prefix/lib/ember/plugins/lib$name.so"  # the copy installed with the engine goes
done
cmake --install "$bundled/build" >/dev/null
for name in "${names[@]}"; do
  # The engine's copy was removed above, so this one is the out-of-tree build's.
  test -f "$prefix/lib/ember/plugins/lib$name.so" || { echo "lib$name.so was not installed from the out-of-tree build"; exit 1; }
  "$prefix/bin/engine" plugins info "$name" > info.txt || { cat info.txt; exit 1; }
  grep -q "file:        $prefix/lib/ember/plugins/lib$name.so" info.txt || { cat info.txt; exit 1; }
done
# A run that uses some of them (when present), loaded from the out-of-tree builds.
want=(early_stopping timer model_summary grad_accum_schedule)
have=()
for w in "${want[@]}"; do [[ " ${names[*]} " == *" $w "* ]] && have+=("$w"); done
if [ ${#have[@]} -eq ${#want[@]} ]; then
  cat > run2.toml <<'TOML'
plugins = ["early_stopping", "timer", "model_summary", "grad_accum_schedule"]
[trainer]
max_epochs = 3
enable_progress_bar = false
[model]
name = "mlp"
input_size = 8
hidden = [4]
[data]
name = "synthetic"
shape = [8]
num_train = 64
[early_stopping]
monitor = "val_loss"
[timer]
duration = "00:01:00:00"
[grad_accum_schedule]
epochs = [0, 1]
factors = [1, 2]
TOML
  "$prefix/bin/engine" run2.toml 2> err2.txt || { cat err2.txt; exit 1; }
  grep -q "Trainable params" err2.txt || { cat err2.txt; exit 1; }
  grep -q "grad_accum_schedule: accumulating 2 batches" err2.txt || { cat err2.txt; exit 1; }
fi
echo "${#names[@]} bundled plugins (${names[*]}) built out of tree against the installed SDK and loaded by the installed engine"
