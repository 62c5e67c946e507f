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
