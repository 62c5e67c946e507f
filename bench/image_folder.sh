#!/usr/bin/env bash
# Images decoded and augmented per second on the same cores: Ember's image_folder (libjpeg-turbo /
# libpng on the engine's loader threads, no Python) against torchvision's ImageFolder +
# DataLoader(num_workers) (PIL, one process per worker), on the same files:
#   - Fashion-MNIST's first N training images written as PNG and as JPEG by the bench (28x28,
#     evaluation transform: Resize(32) + CenterCrop(28) + normalise, as torchvision's recipe at 28),
#   - the same images upscaled to 224x224 RGB JPEGs (the training transform: RandomResizedCrop(224)
#     + flip + normalise).
# Ember's side is a one-epoch run whose model costs next to nothing (a 2-unit linear layer), timed
# by its epoch line (the loader's throughput, the header scan at setup excluded and reported apart);
# torchvision's side one pass of its DataLoader. Same batch (128), 2 workers each, interleaved
# rounds, medians; ratio = Ember / torchvision. The same files packed into WebDataset shards
# (`engine data pack`, 10,000 images a shard) and read by the webdataset plugin make a third column.
#   bash bench/image_folder.sh [N=60000] [N224=10000] [rounds=3] [workers=2]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
n=${1:-60000}; n224=${2:-10000}; rounds=${3:-3}; workers=${4:-2}
build=${EMBER_BUILD_DIR:-build}
torch_prefix=${EMBER_TORCH_PREFIX:-$(bash scripts/setup.sh | tail -n 1)}
python=$(cd "$torch_prefix/../../../../../.." && pwd)/bin/python
cmake --build "$build" --target engine ember_plugin_image_folder ember_plugin_webdataset ember_plugin_mlp ember_plugin_single_device ember_plugin_fp32 >/dev/null
data=${EMBER_BENCH_IMAGES:-$HOME/.cache/ember/bench-images}
if [ ! -f "$data/.complete-$n-$n224" ]; then
  rm -rf "$data"; mkdir -p "$data"
  "$python" bench/image_folder.py write "$data/small" "$n" 28
  "$python" bench/image_folder.py write "$data/large" "$n224" 224
  touch "$data/.complete-$n-$n224"
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

ember_pass() {  # folder size train count [shards] -> images/s of the epoch (from the folder, or its shard list)
  local folder=$1 size=$2 train=$3 count=$4 shards=${5:-}
  local source="name = \"image_folder\"
root = \"$folder\""
  [ -n "$shards" ] && source="name = \"webdataset\"
train = [\"$shards\"]"
  cat > "$work/bench.toml" <<TOML
[trainer]
max_epochs = 1
limit_val_batches = 0
num_sanity_val_steps = 0
enable_checkpointing = false
enable_model_summary = false
logger = false
[model]
name = "mlp"
input_size = $((3 * size * size))
hidden = [2]
[data]
$source
image_size = $size
augment = $([ "$train" = 1 ] && echo true || echo false)
batch_size = 128
num_workers = $workers
shuffle = $([ "$train" = 1 ] && echo true || echo false)
[optimizer]
name = "sgd"
lr = 0.001
TOML
  (cd "$work" && "$root/$build/engine/engine" bench.toml 2>&1) |
    sed -n 's/^Epoch 0\/0 .*(\([0-9.]*\)s)$/\1/p' | awk -v n="$count" '{ printf "%.1f\n", n / $1 }'
}
median() { sort -n | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

echo "| files | transform | Ember images/s | torchvision images/s | Ember / torchvision | Ember from shards images/s |"
echo "|---|---|---|---|---|---|"
for spec in "$data/small/png:28:0:$n:PNG 28x28" "$data/small/jpeg:28:0:$n:JPEG 28x28" "$data/large/jpeg224:224:1:$n224:JPEG 224x224"; do
  IFS=: read -r folder size train count label <<<"$spec"
  : > "$work/e"; : > "$work/t"; : > "$work/w"
  shards="$data/shards/$(basename "$folder")"
  if [ ! -f "$shards/$(basename "$folder").json" ]; then
    rm -rf "$shards"
    "$build/engine/engine" data pack "$folder" "$shards" >/dev/null
  fi
  for _ in $(seq "$rounds"); do
    ember_pass "$folder" "$size" "$train" "$count" >> "$work/e"
    ember_pass "$folder" "$size" "$train" "$count" "$shards/$(basename "$folder").json" >> "$work/w"
    OMP_NUM_THREADS=1 "$python" -W ignore bench/image_folder.py torchvision "$folder" "$size" "$train" "$workers" 128 >> "$work/t"
  done
  e=$(median < "$work/e"); t=$(median < "$work/t"); w=$(median < "$work/w")
  transform=$([ "$train" = 1 ] && echo "random resized crop + flip" || echo "resize 32 + centre crop 28")
  awk -v l="$label" -v tr="$transform" -v e="$e" -v t="$t" -v w="$w" 'BEGIN { printf "| %s | %s | %.0f | %.0f | %.2fx | %.0f |\n", l, tr, e, t, e / t, w }'
done
