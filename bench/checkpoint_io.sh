#!/usr/bin/env bash
# The cost of the checkpoint checksum (CRC32C of every record) next to the write and the load of
# a ~500 MB checkpoint (bench/checkpoint_io.cpp says what each line times).
#   bash bench/checkpoint_io.sh [size_mb=500] [rounds=3] [dir=a temp folder under build/]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
build=${EMBER_BUILD_DIR:-build}
cmake --build "$build" --target bench_checkpoint_io >/dev/null
dir=${3:-$build/bench-checkpoint-io}
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$build/bench/bench_checkpoint_io" "$dir" "${1:-500}" "${2:-3}"
rmdir "$dir" 2>/dev/null || true
