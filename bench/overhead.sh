#!/usr/bin/env bash
# Training-loop overhead: the same CNN (models/cnn's default widths), data sizes, optimizer and
# threads, trained by
#   - a hand-written LibTorch loop (bench/handwritten_loop.cpp): the baseline,
#   - Ember (engine + plugins) with its defaults (csv logger, progress lines) and barebones,
#   - a plain PyTorch loop and PyTorch Lightning (bench/overhead.py), from the same LibTorch wheel.
# Variants run interleaved, `rounds` times each, so a noisy neighbour slows them alike. Every
# variant trains on data it cannot learn (random labels; for Ember, synthetic data with noise
# 30): learnable data drives gradients towards denormal floats, which are slow on x86 and would
# make the comparison about the data rather than the loop. Reports the median epoch time (each
# run's first epoch dropped as warm-up) and the ratio to the baseline.
#   bash bench/overhead.sh [samples] [batch_size] [epochs] [threads] [rounds]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
n=${1:-6400}; bs=${2:-128}; epochs=${3:-3}; threads=${4:-1}; rounds=${5:-3}
build=${EMBER_BUILD_DIR:-build}
torch_prefix=$(bash scripts/setup.sh | tail -n 1)
cmake --build "$build" --target engine bench_handwritten_loop ember_plugin_cnn ember_plugin_synthetic \
  ember_plugin_single_device ember_plugin_fp32 ember_plugin_csv >/dev/null
python=$(cd "$torch_prefix/../../../../../.." && pwd)/bin/python   # the venv that holds the torch wheel
[ -x "$python" ] || python=python3
"$python" -c "import lightning" 2>/dev/null || "$python" -m pip install -q "lightning==2.6.*" >/dev/null
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat > "$work/bench.toml" <<TOML
[trainer]
max_epochs = $epochs
limit_val_batches = 0
num_sanity_val_steps = 0
enable_checkpointing = false
enable_model_summary = false
num_threads = $threads
[model]
name = "cnn"
[data]
name = "synthetic"
noise = 30.0
shape = [1, 28, 28]
num_train = $n
num_val = 0
num_test = 0
batch_size = $bs
[optimizer]
name = "adam"
lr = 0.002
TOML

median_of_epochs() {  # reads "epoch <i> <seconds>" lines, drops epoch 0, prints the median
  awk '$1 == "epoch" && $2 > 0 { print $3 }' | sort -n | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
ember_epochs() {  # the engine's epoch summary lines: "Epoch i/M ... (12.34s)"
  sed -n 's/^Epoch \([0-9]*\)\/[0-9]* .*(\([0-9.]*\)s)$/epoch \1 \2/p'
}

export OMP_NUM_THREADS=$threads
: > "$work/base"; : > "$work/ember"; : > "$work/bare"; : > "$work/torch"; : > "$work/light"
for round in $(seq "$rounds"); do
  "$build/bench/bench_handwritten_loop" "$n" "$bs" "$epochs" "$threads" >> "$work/base"
  (cd "$work" && "$root/$build/engine/engine" bench.toml 2>&1 | ember_epochs) >> "$work/ember"
  (cd "$work" && "$root/$build/engine/engine" bench.toml --set trainer.logger=false 2>&1 | ember_epochs) >> "$work/bare"
  "$python" bench/overhead.py torch "$n" "$bs" "$epochs" "$threads" >> "$work/torch"
  "$python" bench/overhead.py lightning "$n" "$bs" "$epochs" "$threads" 2>/dev/null >> "$work/light"
done
base=$(median_of_epochs < "$work/base"); ember=$(median_of_epochs < "$work/ember"); bare=$(median_of_epochs < "$work/bare")
torch_t=$(median_of_epochs < "$work/torch"); light=$(median_of_epochs < "$work/light")

steps=$(( (n + bs - 1) / bs ))
echo "CNN (conv 32/64, fc 128), $n samples of 1x28x28, batch $bs, Adam, $threads thread(s), $steps steps/epoch;"
echo "median over $rounds interleaved rounds of epochs 1..$((epochs - 1)) (epoch 0 is warm-up)"
echo
echo "| variant | s/epoch | ms/step | vs hand-written LibTorch |"
echo "|---|---|---|---|"
row() { awk -v name="$1" -v t="$2" -v b="$base" -v s="$steps" 'BEGIN { printf "| %s | %.3f | %.2f | %.3f |\n", name, t, 1000 * t / s, t / b }'; }
row "hand-written LibTorch loop (C++)" "$base"
row "Ember (csv logger, progress lines)" "$ember"
row "Ember (logger off)" "$bare"
row "plain PyTorch loop (Python)" "$torch_t"
row "PyTorch Lightning 2.6 Trainer" "$light"
