#!/usr/bin/env bash
# Sets up what is missing, builds, and runs the whole test suite (GoogleTest through CTest).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
start=$(date +%s)
bash scripts/build.sh
built=$(date +%s)
ctest --test-dir "${EMBER_BUILD_DIR:-build}" --output-on-failure -j"$(nproc)" --timeout 900 "$@"
echo "build $((built - start))s, tests $(( $(date +%s) - built ))s"
