#!/usr/bin/env bash
# Fused vs plain optimizer step time (AdamW, SGD with momentum) for 1M, 10M and 100M parameters;
# prints the CPU model, its SIMD flags and a markdown table (bench/optimizers.cpp says what is timed).
#   bash bench/optimizers.sh [sizes_in_millions=1,10,100] [device=cpu]   (OMP_NUM_THREADS, default 1: intra-op threads)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
build=${EMBER_BUILD_DIR:-build}
cmake --build "$build" --target bench_optimizers >/dev/null
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$build/bench/bench_optimizers" "${1:-1,10,100}" "${2:-cpu}"
