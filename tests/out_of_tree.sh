#!/usr/bin/env bash
# Out-of-tree plugin check: install the engine and SDK into a prefix, build examples/hello_callback
# against the installed SDK only (find_package(EmberSDK)), install it into the same prefix, and
# train with the installed engine loading it.
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
cmake -S "$src/examples/hello_callback" -B "$work/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" -DTorch_DIR="$TORCH_DIR" -DCMAKE_INSTALL_PREFIX="$prefix" >/dev/null
cmake --build "$work/build" >/dev/null
cmake --install "$work/build" >/dev/null
test -f "$prefix/lib/ember/plugins/libhello_callback.so"
cd "$work"
# Only the installed folder: no build-tree plugins, no EMBER_PLUGIN_PATH.
unset EMBER_PLUGIN_PATH
"$prefix/bin/engine" plugins info hello_callback | grep -q "kind:        callback"
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
