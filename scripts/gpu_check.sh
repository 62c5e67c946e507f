#!/usr/bin/env bash
# Runs ON the GPU test machine (../shared/device/README.md), from the project root, after
#   EXTRA_DEBS="$(bash scripts/gpu_check.sh debs)" bash ../shared/device/pack.sh && bash scripts/gpu_check.sh data
# on the development machine (the Debian packages the build needs beyond pack.sh's own list: the
# text models', the engine's libarchive with what it links, and zlib), with `.devdeps` carried. Builds
# with the carried Debian packages against the machine's own CUDA PyTorch (Open MPI, cairo,
# protobuf and tcmalloc where that machine has them; what it lacks is left out and its tests skip),
# then runs what `what` names, each step under the time left before GPU_DEADLINE (seconds since the
# epoch; default: 560 s after the start), so that one device call (10 minutes at most) returns with
# what finished:
#   build   configure and build (EMBER_BUILD_TESTS=OFF unless the suite is asked for: 143 objects
#           instead of 221)
#   kernels the unit tests of Ember's own CUDA kernels (KERNEL_TESTS, a CTest regex; default
#           "CrossEntropy": Ember::losses' cross-entropy against its CPU loops); builds the tests
#   paths   tests/gpu_paths.sh: every single-GPU strategy and precision end to end
#   suite   the whole CTest suite on the GPU (the `gpu_paths` test included; needs the tests built)
#   bench   the GPU benches in GPU_BENCHES (default "optimizers speedrun"; also lm_gpu,
#           async_checkpoint, offload_search, offload_host, offload_step, observability), each under
#           BENCH_TIMEOUT seconds (300) or the time left; cross_entropy is Ember's CUDA cross-entropy
#           kernels against LibTorch's
#   all     build suite bench
# `data` (on the development machine, after scripts/setup.sh and a build) fills .devdata/ (git-ignored;
# carry it with .devdeps): the Austen corpus and its SentencePiece token file (EMBER_CACHE there, so
# the GPT bench needs no tokenizer training), and Fashion-MNIST with the first 30,000 of its
# 60,000 training images and all 10,000 test images (13 + 4 MB: the whole set does not fit the
# device's 64 MiB next to the packages; gpu_paths compares GPU runs with CPU runs on the same data;
# without real images its synthetic fallback cannot run the on-device and augmentation cases).
# On 16 cores the full build took 160-195 s and the suite ~290 s (CTEST_JOBS=12) on 2026-11-23; the
# build without tests 167-170 s, gpu_paths 115 s, lm_gpu and async_checkpoint ~90 s together on
# 2026-11-27 (H200). Everything it writes goes under $OUT (logs, tables); at most 8 files come back.
# The call that ran there:
#   GPU_DEADLINE=$(( $(date +%s) + 505 )) GPU_BENCHES="lm_gpu async_checkpoint" PATHS_TIMEOUT=170 \
#     bash scripts/gpu_check.sh build paths bench          (carry: .devdeps .devdata)
# The next call (Ember's CUDA cross-entropy kernels, written 2026-11-28 and not yet run on a GPU,
# then the profile and the fused row of the GPT-2 bench):
#   GPU_DEADLINE=$(( $(date +%s) + 550 )) GPU_BENCHES="cross_entropy lm_gpu" PATHS_TIMEOUT=150 \
#     LM_GPU_VARIANTS="fused chunked eager compile profile" bash scripts/gpu_check.sh build kernels paths bench
#   bash scripts/gpu_check.sh [build|kernels|paths|suite|bench|all|debs|data]...
set -uo pipefail
if [ "${1:-}" = debs ]; then
  # (not dataset-fashion-mnist: 31 MB; `data` carries a subset of it instead.)
  echo "zlib1g libutf8proc-dev libutf8proc2 libcsv-dev libcsv3 nlohmann-json3-dev" \
       "libsentencepiece-dev libsentencepiece0 libarchive-dev libarchive13 libxml2 libicu72 libnettle8 libacl1 liblz4-1" \
       "libzstd1 liblzma5 libbz2-1.0 libcurl4-openssl-dev libcurl4 libjpeg-dev libjpeg62-turbo-dev libjpeg62-turbo libpng-dev libpng16-16"
  exit 0
fi
if [ "${1:-}" = data ]; then
  set -e +o pipefail   # (zcat ends on SIGPIPE once head has its bytes)
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  grep -qx '/.devdata/' .git/info/exclude 2>/dev/null || echo '/.devdata/' >> .git/info/exclude
  rm -rf .devdata && mkdir -p .devdata/cache .devdata/fashion-mnist
  cp -r "${EMBER_CACHE:-$HOME/.cache/ember}/austen" .devdata/cache/
  # One optimizer step of a one-layer model: text_lm builds the token file of the GPT-2 config.
  EMBER_CACHE=$PWD/.devdata/cache "${EMBER_BUILD_DIR:-build}/engine/engine" configs/gpt2_124m_gpu.toml --set 'trainer.accelerator="cpu"' \
    --set 'trainer.precision="32-true"' --set model.layers=1 --set model.width=64 --set model.heads=2 --set data.batch_size=1 \
    --set trainer.max_steps=2 --set trainer.accumulate_grad_batches=1 --set cosine.warmup=1 --set trainer.limit_val_batches=0 \
    --set checkpoint.save_top_k=0 --set checkpoint.save_last=false --set 'trainer.default_root_dir="/tmp/gpu-check-data"' >/dev/null 2>&1
  ls .devdata/cache/text_lm/*/tokens.u16 >/dev/null
  src=/usr/share/datasets/fashion-mnist
  idx_head() {  # magic, count: the 8-byte IDX header (big-endian)
    printf '%08x%08x' "$1" "$2" | sed 's/../\\x&/g' | xargs -0 printf
  }
  { idx_head 2051 30000; zcat "$src/train-images-idx3-ubyte.gz" | tail -c +9 | head -c $((8 + 30000 * 784)); } | gzip -6 > .devdata/fashion-mnist/train-images-idx3-ubyte.gz
  { idx_head 2049 30000; zcat "$src/train-labels-idx1-ubyte.gz" | tail -c +9 | head -c 30000; } | gzip -6 > .devdata/fashion-mnist/train-labels-idx1-ubyte.gz
  cp "$src"/t10k-* .devdata/fashion-mnist/
  du -sh .devdata
  exit 0
fi
started=$(date +%s)
deadline=${GPU_DEADLINE:-$((started + 560))}
left() { echo $((deadline - $(date +%s))); }
# the seconds a step may take: its own limit or what is left before the deadline, whichever is less
limit_of() { local l; l=$(left); echo $(($1 < l ? $1 : l)); }
what=" ${*:-all} "
[ "$what" = " all " ] && what=" build suite bench "
wants() { [[ $what == *" $1 "* ]]; }
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
# Debian's zlib, bzip2 and xz libraries unpack under lib/, not usr/lib/: the linker (for libarchive's
# and libpng's needs) and the programs find them through LD_LIBRARY_PATH.
export LD_LIBRARY_PATH=/tmp/devroot/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if wants build || [ ! -x build-gpu/engine/engine ]; then
  start=$(date +%s)
  tests=OFF; { wants suite || wants kernels; } && tests=ON
  # zlib1g-dev's libz.so points at /lib/x86_64-linux-gnu/libz.so.1.2.13, which that machine lacks:
  # name the carried shared library directly (the static libz.a cannot link into a plugin).
  CMAKE_ARGS="-DEMBER_BUILD_TESTS=$tests -DEMBER_MPI=AUTO -DEMBER_CAIRO=AUTO -DEMBER_PROTOBUF=AUTO -DEMBER_TCMALLOC=AUTO -DZLIB_LIBRARY=/tmp/devroot/lib/x86_64-linux-gnu/libz.so.1 ${CMAKE_ARGS:-}" \
    timeout "$(limit_of 400)" bash .devdeps/build-on-device.sh > "$OUT/build.log" 2>&1
  rc=$?
  if [ $rc -ne 0 ] && [ -f build-gpu/build.ninja ] && grep -q "cross_entropy_rows\.cu" "$OUT/build.log"; then
    # Ember's own CUDA kernels did not compile with that machine's nvcc / host compiler: say why,
    # and build without them (ATen's kernels then run the same functions) so the rest still runs.
    grep -B2 -A6 "cross_entropy_rows\.cu" "$OUT/build.log" | head -30 | tee -a "$OUT/summary.txt"
    echo "build: Ember's CUDA kernels failed to compile; rebuilding with -DEMBER_CUDA_KERNELS=OFF" | tee -a "$OUT/summary.txt"
    source /tmp/devroot/env.sh
    { cmake -S . -B build-gpu -DEMBER_CUDA_KERNELS=OFF && timeout "$(limit_of 300)" cmake --build build-gpu -j"$(nproc)"; } >> "$OUT/build.log" 2>&1
    rc=$?
  fi
  if [ $rc -ne 0 ] && [ -f build-gpu/build.ninja ]; then
    # Build what can be built (ninja -k 0) and go on with it: one object that fails on that
    # machine's compiler should not cost the whole call.
    grep -E "error|FAILED" "$OUT/build.log" | head -30 | tee -a "$OUT/summary.txt"
    source /tmp/devroot/env.sh
    timeout "$(limit_of 300)" cmake --build build-gpu -j"$(nproc)" -- -k 0 >> "$OUT/build.log" 2>&1
    echo "build: kept going after the failures: exit $?" | tee -a "$OUT/summary.txt"
  fi
  echo "build: exit $rc in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
  grep -E "Ember:|NCCL|^torch " "$OUT/build.log" | tee -a "$OUT/summary.txt"
  [ -x build-gpu/engine/engine ] || { grep -E "error|FAILED" "$OUT/build.log" | head -30; exit 1; }
fi
source /tmp/devroot/env.sh
# The benches take this LibTorch as given (no set-up: that machine has no network).
export EMBER_TORCH_PREFIX=${EMBER_TORCH_PREFIX:-$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')}
# Carried dataset-fashion-mnist (EXTRA_DEBS) where the configs, tests and Python sides look for it.
if [ -d /tmp/devroot/usr/share/datasets/fashion-mnist ] && [ ! -e /usr/share/datasets/fashion-mnist ]; then
  mkdir -p /usr/share/datasets && cp -r /tmp/devroot/usr/share/datasets/fashion-mnist /usr/share/datasets/
fi
[ -d .devdata/cache ] && export EMBER_CACHE=$root/.devdata/cache
if [ -d .devdata/fashion-mnist ] && [ ! -e /usr/share/datasets/fashion-mnist ]; then
  mkdir -p /usr/share/datasets && cp -r .devdata/fashion-mnist /usr/share/datasets/
fi
if wants kernels; then
  start=$(date +%s)
  (cd build-gpu && timeout "$(limit_of 180)" ctest -R "${KERNEL_TESTS:-CrossEntropy}" --timeout 120 --output-on-failure > "$OUT/kernels.log" 2>&1)
  echo "kernels: exit $? in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
  grep -E "tests passed|tests failed|Passed|Failed|Skipped|Not Run" "$OUT/kernels.log" | tee -a "$OUT/summary.txt"
fi
if wants paths; then
  start=$(date +%s)
  timeout "$(limit_of "${PATHS_TIMEOUT:-300}")" bash tests/gpu_paths.sh "$root/build-gpu/engine/engine" /tmp/gpu-paths > "$OUT/gpu_paths.log" 2>&1
  echo "gpu_paths: exit $? in $(( $(date +%s) - start )) s ($(grep -c 'test_acc' "$OUT/gpu_paths.log") cases passed, $(grep -c '^FAILED' "$OUT/gpu_paths.log") failed)" | tee -a "$OUT/summary.txt"
  grep '^FAILED' "$OUT/gpu_paths.log" | tee -a "$OUT/summary.txt"
fi
if wants suite; then
  start=$(date +%s)
  (cd build-gpu && timeout "$(limit_of 400)" ctest -j"${CTEST_JOBS:-6}" --timeout 300 --output-on-failure --output-junit "$OUT/ctest.xml" \
     ${CTEST_ARGS:-} > "$OUT/ctest.log" 2>&1)
  echo "suite: exit $? in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
  grep -E "tests passed|tests failed|Total Test time" "$OUT/ctest.log" | tee -a "$OUT/summary.txt"
  sed -n '/The following tests FAILED/,$p' "$OUT/ctest.log" | tee -a "$OUT/summary.txt"
  grep -c "Skipped" "$OUT/ctest.log" | sed 's/^/skipped lines: /' | tee -a "$OUT/summary.txt"
fi
if wants bench; then
  for b in ${GPU_BENCHES:-optimizers speedrun}; do
    limit=$(limit_of "${BENCH_TIMEOUT:-300}")   # seconds: the device's calls are 10 minutes each
    [ "$limit" -gt 15 ] || { echo "bench $b: skipped, the deadline has passed" | tee -a "$OUT/summary.txt"; continue; }
    case $b in
      optimizers) EMBER_BUILD_DIR=build-gpu timeout "$limit" bash bench/optimizers.sh 1,10,100 cuda > "$OUT/bench-optimizers.md" 2>&1 ;;
      speedrun) EMBER_BUILD_DIR=build-gpu timeout "$limit" bash bench/speedrun.sh "${SPEEDRUN_ROUNDS:-3}" 0.93 \
                  configs/fashion_mnist_speedrun_gpu.toml cuda > "$OUT/bench-speedrun.md" 2>&1 ;;
      offload_search|offload_host|offload_step) EMBER_BUILD_DIR=build-gpu timeout "$limit" bash bench/offload.sh "${b#offload_}" \
                  > "$OUT/bench-$b.md" 2>&1 ;;
      observability) EMBER_BUILD_DIR=build-gpu timeout "$limit" bash bench/observability.sh 1 200 > "$OUT/bench-observability.md" 2>&1 ;;
      lm_gpu) EMBER_BUILD_DIR=build-gpu timeout "$limit" bash bench/lm_gpu.sh ${LM_GPU_ARGS:-10 4 3} > "$OUT/bench-lm_gpu.md" 2>&1 ;;
      cross_entropy) EMBER_BUILD_DIR=build-gpu timeout "$limit" bash bench/cross_entropy.sh 16 5 cuda > "$OUT/bench-cross_entropy.md" 2>&1 ;;
      async_checkpoint) EMBER_BUILD_DIR=build-gpu timeout "$limit" bash bench/async_checkpoint.sh 1 cuda > "$OUT/bench-async_checkpoint.md" 2>&1 ;;
      *) EMBER_BUILD_DIR=build-gpu timeout "$limit" bash "bench/$b.sh" > "$OUT/bench-$b.md" 2>&1 ;;
    esac
    echo "bench $b: exit $?" | tee -a "$OUT/summary.txt"
  done
fi
