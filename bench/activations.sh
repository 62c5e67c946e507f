#!/usr/bin/env bash
# Ember::activations' gelu_tanh vs LibTorch's at::gelu(x, "tanh") on CPU float32, forward and
# backward, at the GPT configs' hidden-activation shapes (bench/activations.cpp says what is timed).
#   bash bench/activations.sh [threads=2] [rounds=7]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
build=${EMBER_BUILD_DIR:-build}
cmake --build "$build" --target bench_activations >/dev/null
grep -m1 "model name" /proc/cpuinfo || true
"$build/bench/bench_activations" "${1:-2}" "${2:-7}"
