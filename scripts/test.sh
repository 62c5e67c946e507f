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
# CI (CI=true) also runs the ThreadSanitizer subset: the loader, ddp, mesh, signal and default-dtype
# tests in a build of their own (build-tsan/, only what they need). The ASan+UBSan suite needs
# the whole build and about an hour on 2 cores: it runs by hand (docs/build.md, "Sanitizers").
# CI stops a run at 90 minutes (EMBER_CI_BUDGET_S). A cold TSan build and its tests take about 25
# minutes on 2 cores: when less than that is left after the suite (a CI machine whose compiler
# cache is empty builds everything cold), the subset is left out with a line saying so, rather
# than the whole run being cut off with nothing reported. A failed suite fails CI either way.
if [ "${CI:-}" = true ] && [ $# -eq 0 ]; then
  budget=${EMBER_CI_BUDGET_S:-5400}
  need=${EMBER_TSAN_NEEDS_S:-1500}
  left=$(( budget - (tested - start) ))
  if [ "$left" -ge "$need" ]; then
    bash scripts/sanitize.sh tsan
    echo "tsan subset (build and tests) $(( $(date +%s) - tested ))s"
  else
    echo "tsan subset NOT RUN: ${left}s of CI's ${budget}s are left and a cold TSan build with its tests needs about ${need}s; run it by hand: bash scripts/sanitize.sh tsan"
  fi
fi
