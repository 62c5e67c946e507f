#!/usr/bin/env bash
# Installs this build into <work>/prefix and builds examples/<name> against that install out of
# tree (its own CMake project: find_package(EmberSDK), nothing from the source tree). Prints only
# the logs of a step that failed.
#   build_example.sh <ember build dir> <work dir> <example folder name>
# TORCH_DIR and CMAKE_PREFIX_PATH (':'-separated) say where LibTorch and the other dependencies are.
set -euo pipefail
build=$1
work=$2
name=$3
src=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
rm -rf "$work"
mkdir -p "$work"
prefix="$work/prefix"
cmake --install "$build" --prefix "$prefix" > "$work/install.log" 2>&1 || { cat "$work/install.log"; exit 1; }
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S "$src/examples/$name" -B "$work/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" -DTorch_DIR="$TORCH_DIR" -DCMAKE_INSTALL_PREFIX="$prefix" "${launcher[@]}" \
  > "$work/configure.log" 2>&1 || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
cmake --install "$work/build" > "$work/install-example.log" 2>&1 || { cat "$work/install-example.log"; exit 1; }
