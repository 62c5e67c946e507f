#!/usr/bin/env bash
# libFuzzer runs of the TOML/--set parser + validator, of the checkpoint reader and of the readers of
# a model folder's files and of data files (docs/build.md, "Fuzzing"). Builds fuzz_config,
# fuzz_checkpoint, fuzz_model_files and fuzz_data_files with clang, libFuzzer, ASan and UBSan into
# build-fuzz/, then runs each on a working copy of the seed corpus (tests/fuzz/corpus/):
#   scripts/fuzz.sh [SECONDS]        each target for SECONDS (default 120)
#   scripts/fuzz.sh replay FILE...   runs saved inputs (crash-*, or the suite's fuzz-findings/*.bin)
# The config target validates against the schemas of the plugins in build/plugins (the normal
# build, made first if missing). Needs clang (Debian's clang-14 ships libFuzzer in libclang-rt-14-dev).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
command -v clang++ >/dev/null || { echo "fuzz.sh: clang++ not found (Debian: apt-get install clang)" >&2; exit 2; }
torch_prefix=$(bash scripts/setup.sh | tail -n 1)
[ -d build/plugins ] || bash scripts/build.sh
export EMBER_PLUGIN_PATH="$root/build/plugins"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [ ! -f build-fuzz/CMakeCache.txt ]; then
  # The clang build makes its own precompiled header (GCC's cannot be used).
  CXX=clang++ cmake -S . -B build-fuzz "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$torch_prefix" \
    -DEMBER_FUZZ=ON -DEMBER_SANITIZE=address,undefined -DEMBER_BUILD_TESTS=OFF >/dev/null
fi
cmake --build build-fuzz -j"$(nproc)" --target fuzz_config fuzz_checkpoint fuzz_model_files fuzz_data_files
# LibTorch keeps process-lifetime allocations (registries, thread pools): leaks are not findings.
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$root/tests/sanitizers/ubsan.supp"

if [ "${1:-}" = replay ]; then
  shift
  status=0
  for f in "$@"; do
    case "$(basename "$f")" in
      checkpoint*|*ckpt*) target=checkpoint ;;
      model_files*) target=model_files ;;
      data_files*) target=data_files ;;
      *) target=${EMBER_FUZZ_TARGET:-config} ;;
    esac
    echo "== $target $f"
    build-fuzz/tests/fuzz/fuzz_$target "$f" || status=1
  done
  exit $status
fi

seconds=${1:-120}
status=0
for which in config checkpoint model_files data_files; do
  work=build-fuzz/corpus-$which
  mkdir -p "$work" build-fuzz/findings
  echo "== fuzz_$which for ${seconds}s"
  # -timeout: an input that takes longer is a hang (a finding); -rss_limit_mb: so is runaway memory.
  # The fuzzer's own status decides (a finding exits non-zero); grep only filters what is shown.
  set +e
  build-fuzz/tests/fuzz/fuzz_$which "$work" "tests/fuzz/corpus/$which" "tests/fuzz/regressions/$which" -max_total_time="$seconds" -timeout=10 \
    -rss_limit_mb=4096 -max_len=65536 -print_final_stats=1 -artifact_prefix=build-fuzz/findings/$which- 2>&1 |
    grep -E "^(stat::|INFO: seed corpus|#[0-9]+ +DONE|==[0-9]+==|ember fuzz finding|SUMMARY)|Test unit written"
  fuzz_status=${PIPESTATUS[0]}
  set -e
  [ "$fuzz_status" -eq 0 ] || { echo "fuzz_$which: finding (exit $fuzz_status), input saved under build-fuzz/findings/" >&2; status=1; }
done
exit $status
