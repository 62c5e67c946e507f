#!/usr/bin/env bash
# Training-loop overhead, side by side in one run. The same model, data sizes, optimizer and
# threads, trained by
#   - a hand-written LibTorch loop (bench/handwritten_loop.cpp) stepping torch::optim::Adam: the
#     baseline,
#   - the same hand-written loop on ember::Fabric (bench/fabric_loop.cpp, libember.so, single_device,
#     32-true) with the same optimizer kernel (torch::optim::Adam, the plain per-tensor path),
#   - Ember (engine + plugins) with the same Adam kernel (optimizer.fused = false): with its default
#     csv logger and progress lines (the like-for-like row: the engine's own overhead), and with
#     the logger off,
#   - Ember with its defaults, which step Adam with ATen's fused kernel (faster than the baseline's
#     per-tensor Adam on small models, so it hides the loop's overhead rather than measuring it),
#   - a plain PyTorch loop and PyTorch Lightning (bench/overhead.py), on the same LibTorch wheel
#     (torch.optim.Adam's per-tensor path on the CPU, as the baseline).
# Two models: `cnn` (models/cnn's default widths: compute-bound, ~100 ms/step on one core) and
# `mlp` (32 -> 32 -> 10, batch 32: so small that per-step framework overhead is what is measured).
# Variants run interleaved, `rounds` times each, so a noisy neighbour slows them alike. Every
# variant trains on data it cannot learn (random labels; for Ember, synthetic data with noise 30):
# learnable data drives gradients towards denormal floats, which are slow on x86 and would make the
# comparison about the data rather than the loop. Each run's first epoch is warm-up and dropped.
# Reported: the best epoch (least disturbed by other load) and the median, and their ratio to the
# baseline's.
#   bash bench/overhead.sh [rounds] [threads]        (BENCH_MODELS="mlp" runs one model only)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
rounds=${1:-3}; threads=${2:-1}
build=${EMBER_BUILD_DIR:-build}
torch_prefix=${EMBER_TORCH_PREFIX:-$(bash scripts/setup.sh | tail -n 1)}   # EMBER_TORCH_PREFIX: a given LibTorch (the GPU machine's), no set-up
cmake --build "$build" --target engine bench_handwritten_loop bench_fabric_loop ember_plugin_cnn ember_plugin_mlp ember_plugin_synthetic \
  ember_plugin_single_device ember_plugin_fp32 ember_plugin_csv >/dev/null
python=$(cd "$torch_prefix/../../../../../.." && pwd)/bin/python   # the venv that holds the torch wheel
[ -x "$python" ] || python=python3
"$python" -c "import lightning" 2>/dev/null || "$python" -m pip install -q "lightning==2.6.*" >/dev/null
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=$threads

epoch_times() {  # "epoch <i> <seconds>" lines without epoch 0 -> one number per line
  awk '$1 == "epoch" && $2 > 0 { print $3 }'
}
ember_epochs() {  # the engine's epoch summary lines: "Epoch i/M ... (12.34s)"
  sed -n 's/^Epoch \([0-9]*\)\/[0-9]* .*(\([0-9.]*\)s)$/epoch \1 \2/p'
}
stats() {  # file -> "min median"
  sort -n "$1" | awk '{ v[NR] = $1 } END { m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2; print v[1], m }'
}

bench_model() {
  local model=$1 n=$2 bs=$3 epochs=$4 model_toml=$5 shape=$6
  cat > "$work/bench.toml" <<TOML
[trainer]
max_epochs = $epochs
limit_val_batches = 0
num_sanity_val_steps = 0
enable_checkpointing = false
enable_model_summary = false
num_threads = $threads
[model]
$model_toml
[data]
name = "synthetic"
noise = 30.0
shape = $shape
num_train = $n
num_val = 0
num_test = 0
batch_size = $bs
[optimizer]
name = "adam"
lr = 0.002
TOML
  local v
  for v in base fabric ember bare fused torch light; do : > "$work/$v"; done
  for _ in $(seq "$rounds"); do
    "$build/bench/bench_handwritten_loop" "$model" "$n" "$bs" "$epochs" "$threads" | epoch_times >> "$work/base"
    "$build/bench/bench_fabric_loop" "$model" "$n" "$bs" "$epochs" "$threads" 2>/dev/null | epoch_times >> "$work/fabric"
    (cd "$work" && "$root/$build/engine/engine" bench.toml --set optimizer.fused=false 2>&1 | ember_epochs | epoch_times) >> "$work/ember"
    (cd "$work" && "$root/$build/engine/engine" bench.toml --set optimizer.fused=false --set trainer.logger=false 2>&1 |
      ember_epochs | epoch_times) >> "$work/bare"
    (cd "$work" && "$root/$build/engine/engine" bench.toml 2>&1 | ember_epochs | epoch_times) >> "$work/fused"
    "$python" bench/overhead.py torch "$model" "$n" "$bs" "$epochs" "$threads" | epoch_times >> "$work/torch"
    "$python" bench/overhead.py lightning "$model" "$n" "$bs" "$epochs" "$threads" 2>/dev/null | epoch_times >> "$work/light"
  done
  local steps=$(( (n + bs - 1) / bs ))
  read -r bmin bmed < <(stats "$work/base")
  echo "### $model: $n samples, batch $bs, Adam, $threads thread(s), $steps steps/epoch, $rounds rounds x $((epochs - 1)) timed epochs"
  echo
  echo "| variant | best ms/step | median ms/step | best vs hand-written | median vs hand-written |"
  echo "|---|---|---|---|---|"
  local name file
  for pair in "hand-written LibTorch loop (C++, torch::optim::Adam):base" \
              "the same loop on Ember Fabric (plain Adam, as hand-written):fabric" \
              "Ember, same Adam (optimizer.fused=false; csv logger, progress lines):ember" \
              "Ember, same Adam, logger off:bare" "Ember defaults (ATen's fused Adam; csv logger, progress lines):fused" \
              "plain PyTorch loop (Python):torch" "PyTorch Lightning 2.6 Trainer:light"; do
    name=${pair%:*}; file=${pair##*:}  # names may hold colons: the file is after the last one
    read -r tmin tmed < <(stats "$work/$file")
    awk -v name="$name" -v a="$tmin" -v m="$tmed" -v ba="$bmin" -v bm="$bmed" -v s="$steps" \
      'BEGIN { printf "| %s | %.3f | %.3f | %.3f | %.3f |\n", name, 1000 * a / s, 1000 * m / s, a / ba, m / bm }'
  done
  echo
}

for model in ${BENCH_MODELS:-mlp cnn}; do
  case $model in
    mlp) bench_model mlp 32000 32 3 $'name = "mlp"\ninput_size = 32\nhidden = [32]\nnum_classes = 10' "[32]" ;;
    cnn) bench_model cnn 6400 128 3 $'name = "cnn"' "[1, 28, 28]" ;;
  esac
done
