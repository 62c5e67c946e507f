#!/usr/bin/env bash
# Runs ON the GPU test machine (../shared/device/README.md), from the project root, after
# `EXTRA_DEBS="zlib1g dataset-fashion-mnist libutf8proc-dev libutf8proc2 libcsv-dev libcsv3 nlohmann-json3-dev"
# bash ../shared/device/pack.sh` on the development machine (the text model's packages, the data set) and with
# `.devdeps` carried. Builds with the carried Debian packages against the machine's own CUDA
# PyTorch (Open MPI, cairo, protobuf and tcmalloc where that machine has them: on 2026-11-23 it had
# Open MPI and protobuf; what it lacks is left out and its tests skip), runs the whole suite on the
# GPU (the `gpu_paths` test included), then the GPU benches given in GPU_BENCHES (default:
# "optimizers speedrun"; also offload_search, offload_host, offload_step, observability), each
# under BENCH_TIMEOUT seconds (300). The device's calls last 10 minutes and its machine goes back
# 30 s after one ends: on 16 cores the build takes 160-195 s and the suite ~290 s (CTEST_JOBS=12),
# so build + suite fit one call and the benches the next. Everything it writes goes under $OUT
# (logs, ctest's JUnit file, tables); at most 8 files come back.
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
# The benches take this LibTorch as given (no set-up: that machine has no network).
export EMBER_TORCH_PREFIX=${EMBER_TORCH_PREFIX:-$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')}
# Carried dataset-fashion-mnist (EXTRA_DEBS) where the configs, tests and Python sides look for it.
if [ -d /tmp/devroot/usr/share/datasets/fashion-mnist ] && [ ! -e /usr/share/datasets/fashion-mnist ]; then
  mkdir -p /usr/share/datasets && cp -r /tmp/devroot/usr/share/datasets/fashion-mnist /usr/share/datasets/
fi
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
  limit=${BENCH_TIMEOUT:-300}   # seconds per bench: the device's calls are 10 minutes each
  for b in ${GPU_BENCHES:-optimizers speedrun}; do
    case $b in
      optimizers) EMBER_BUILD_DIR=build-gpu timeout "$limit" bash bench/optimizers.sh 1,10,100 cuda > "$OUT/bench-optimizers.md" 2>&1 ;;
      speedrun) EMBER_BUILD_DIR=build-gpu timeout "$limit" bash bench/speedrun.sh "${SPEEDRUN_ROUNDS:-3}" 0.93 \
                  configs/fashion_mnist_speedrun_gpu.toml cuda > "$OUT/bench-speedrun.md" 2>&1 ;;
      offload_search|offload_host|offload_step) EMBER_BUILD_DIR=build-gpu timeout "$limit" bash bench/offload.sh "${b#offload_}" \
                  > "$OUT/bench-$b.md" 2>&1 ;;
      observability) EMBER_BUILD_DIR=build-gpu timeout "$limit" bash bench/observability.sh 1 200 > "$OUT/bench-observability.md" 2>&1 ;;
      *) EMBER_BUILD_DIR=build-gpu timeout "$limit" bash "bench/$b.sh" > "$OUT/bench-$b.md" 2>&1 ;;
    esac
    echo "bench $b: exit $?" | tee -a "$OUT/summary.txt"
  done
fi
