#!/usr/bin/env bash
# trainer.activation_checkpointing on the GPT-2 124M shape: memory held for backward and step
# time, none / full / selective side by side (bench/activation_memory.cpp).
#   bash bench/activation_memory.sh [batch=1] [seq=1024] [steps=2]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${EMBER_BUILD_DIR:-build}
cmake --build "$root/$build" --target bench_activation_memory >/dev/null
"$root/$build/bench/bench_activation_memory" "${1:-1}" "${2:-1024}" "${3:-2}"
