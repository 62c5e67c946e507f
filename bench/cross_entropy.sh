#!/usr/bin/env bash
# Ember::losses' cross_entropy vs LibTorch's at::cross_entropy_loss, loss and backward, for float32
# and bf16 logits at the char GPT's and GPT-2's vocabularies (bench/cross_entropy.cpp says what is
# timed). On a GPU machine pass `cuda` (Ember's CUDA kernels where the build compiled them).
#   bash bench/cross_entropy.sh [threads=2] [rounds=7] [cpu|cuda]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
build=${EMBER_BUILD_DIR:-build}
cmake --build "$build" --target bench_cross_entropy >/dev/null
grep -m1 "model name" /proc/cpuinfo || true
"$build/bench/bench_cross_entropy" "${1:-2}" "${2:-7}" "${3:-cpu}"
