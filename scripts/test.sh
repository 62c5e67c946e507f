#!/usr/bin/env bash
# Sets up what is missing, builds, and runs the whole test suite (GoogleTest through CTest).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
start=$(date +%s)
bash scripts/build.sh
built=$(date +%s)
ctest --test-dir "${EMBER_BUILD_DIR:-build}" --output-on-failure -j"$(nproc)" --timeout 900 "$@"
tested=$(date +%s)
echo "build $((built - start))s, tests $((tested - built))s"
# CI (CI=true) also runs the ThreadSanitizer subset: the loader, dp, ddp, signal and default-dtype
# tests in a build of their own (build-tsan/, only what they need). The ASan+UBSan suite needs
# the whole build and about an hour on 2 cores: it runs by hand (docs/build.md, "Sanitizers").
if [ "${CI:-}" = true ] && [ $# -eq 0 ]; then
  bash scripts/sanitize.sh tsan
  echo "tsan subset (build and tests) $(( $(date +%s) - tested ))s"
fi
