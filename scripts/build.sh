#!/usr/bin/env bash
# Sets up what is missing (scripts/setup.sh), then configures and builds Ember in ./build.
# Extra CMake arguments: CMAKE_ARGS="-DEMBER_BUILD_TESTS=OFF" scripts/build.sh
# EMBER_BUILD_TARGET=runnable builds only what training needs (the engine and every plugin; what
# scripts/quickstart.sh does); the default builds everything, the test suite and benches included.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
torch_prefix=$(bash scripts/setup.sh | tail -n 1)
build=${EMBER_BUILD_DIR:-build}
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
# setup.sh installs every optional dependency, so this build requires them (a missing one fails
# here instead of quietly leaving a part untested); CMAKE_ARGS="-DEMBER_MPI=AUTO" relaxes that.
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$torch_prefix" \
    -DEMBER_MPI=ON -DEMBER_CAIRO=ON -DEMBER_PROTOBUF=ON -DEMBER_TCMALLOC=ON ${CMAKE_ARGS:-} >/dev/null
fi
target=()
[ -n "${EMBER_BUILD_TARGET:-}" ] && target=(--target "$EMBER_BUILD_TARGET")
cmake --build "$build" -j"$(nproc)" "${target[@]}"
