#!/usr/bin/env bash
# Runs ON the GPU test machine (../shared/device/README.md), from the project root, after
# `EXTRA_DEBS="zlib1g" bash ../shared/device/pack.sh` on the development machine and with
# `.devdeps` carried. Builds with the carried Debian packages against the machine's own CUDA
# PyTorch (no Open MPI, cairo or protobuf there: those parts are left out and their tests skip),
# runs the whole suite on the GPU, then the GPU benches given in GPU_BENCHES (default: all).
# Everything it writes goes under $OUT (logs, ctest's JUnit file, tables).
#   bash scripts/gpu_check.sh [build|suite|bench|all]
set -uo pipefail
what=${1:-all}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "$what" = build ] || [ "$what" = all ] || [ ! -x build-gpu/engine/engine ]; then
  start=$(date +%s)
  # zlib1g-dev's libz.so points at /lib/x86_64-linux-gnu/libz.so.1.2.13, which that machine lacks:
  # name the carried shared library directly (the static libz.a cannot link into a plugin).
  CMAKE_ARGS="-DEMBER_MPI=AUTO -DEMBER_CAIRO=AUTO -DEMBER_PROTOBUF=AUTO -DEMBER_TCMALLOC=AUTO -DZLIB_LIBRARY=/tmp/devroot/lib/x86_64-linux-gnu/libz.so.1 ${CMAKE_ARGS:-}" \
    bash .devdeps/build-on-device.sh > "$OUT/build.log" 2>&1
  rc=$?
  echo "build: exit $rc in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
  grep -E "Ember:|NCCL" "$OUT/build.log" | tee -a "$OUT/summary.txt"
  [ $rc -eq 0 ] || { grep -E "error|FAILED" "$OUT/build.log" | head -30; exit $rc; }
fi
source /tmp/devroot/env.sh
if [ "$what" = suite ] || [ "$what" = all ]; then
  start=$(date +%s)
  (cd build-gpu && ctest -j"${CTEST_JOBS:-6}" --timeout 300 --output-on-failure --output-junit "$OUT/ctest.xml" \
     ${CTEST_ARGS:-} > "$OUT/ctest.log" 2>&1)
  echo "suite: exit $? in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
  grep -E "tests passed|tests failed|Total Test time" "$OUT/ctest.log" | tee -a "$OUT/summary.txt"
  sed -n '/The following tests FAILED/,$p' "$OUT/ctest.log" | tee -a "$OUT/summary.txt"
  grep -c "Skipped" "$OUT/ctest.log" | sed 's/^/skipped lines: /' | tee -a "$OUT/summary.txt"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  for b in ${GPU_BENCHES:-optimizers}; do
    case $b in
      optimizers) EMBER_BUILD_DIR=build-gpu bash bench/optimizers.sh 1,10,100 cuda > "$OUT/bench-optimizers.md" 2>&1 ;;
      *) EMBER_BUILD_DIR=build-gpu bash "bench/$b.sh" > "$OUT/bench-$b.md" 2>&1 ;;
    esac
    echo "bench $b: exit $?" | tee -a "$OUT/summary.txt"
  done
fi
