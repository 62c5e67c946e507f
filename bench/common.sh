# shellcheck shell=bash
# Shared by the bench scripts: source "$(dirname "$0")/common.sh".

# calc EXPR: floating-point arithmetic (awk), printed with CALC_DIGITS decimals (default 3).
calc() { awk "BEGIN { printf \"%.${CALC_DIGITS:-3}f\", $* }"; }

# The [trainer] section of a run that only trains, for as many steps as --set trainer.max_steps
# says: no sanity check, progress bar, summary, checkpoints or logger to time along with it.
# Extra trainer keys follow on the lines after it.
train_only_trainer_toml() {
  cat <<TOML
[trainer]
max_epochs = -1
num_sanity_val_steps = 0
enable_progress_bar = false
enable_model_summary = false
enable_checkpointing = false
logger = false
TOML
}

# The [model] section of the transformer classifier (10 classes, no dropout, feed-forward 4 x d):
#   transformer_model_toml layers d_model nhead
transformer_model_toml() {
  local layers=$1 d=$2 nhead=$3
  cat <<TOML
[model]
name = "transformer"
d_model = $d
nhead = $nhead
dim_feedforward = $((4 * d))
num_layers = $layers
dropout = 0.0
num_classes = 10
TOML
}

# The memory benches (sharded.sh, mesh.sh): the transformer on synthetic sequences, trained with
# AdamW, one thread per rank. Prints the run.toml:
#   memory_bench_toml layers d_model seq_len batch_size
memory_bench_toml() {
  local layers=$1 d=$2 seq=$3 batch=$4
  train_only_trainer_toml
  echo "num_threads = 1"
  transformer_model_toml "$layers" "$d" 8
  cat <<TOML
[data]
name = "synthetic"
shape = [$seq, $d]
num_classes = 10
num_train = 1200
num_val = 0
num_test = 0
batch_size = $batch
[optimizer]
name = "adamw"
lr = 0.0001
TOML
}

# probe_run ranks steps [args...] -> seconds: $work/run.toml with the memory_probe plugin
# ($engine, $probe_dir), on `ranks` ranks for `steps` steps; the probe's lines stay in $work/err.
probe_run() {
  local ranks=$1 steps=$2 start end
  shift 2
  start=$(date +%s.%N)
  (cd "$work" && OMP_NUM_THREADS=1 "$engine" run.toml --plugin-path "$probe_dir" --plugins memory_probe \
     --set "trainer.max_steps=$steps" --set "trainer.devices=$ranks" "$@" >/dev/null 2>"$work/err") || { cat "$work/err" >&2; exit 1; }
  end=$(date +%s.%N)
  calc "$end - $start"
}
