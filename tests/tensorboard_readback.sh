#!/usr/bin/env bash
# The tensorboard logger, read back by TensorBoard's own event readers (tests/reference/tb_check.py):
#  1. csv and tensorboard together: every metrics.csv cell is a TensorBoard scalar (tag, step,
#     value), plus the config as text and hparams, and weight/gradient histograms;
#  2. ddp with 2 ranks: one event file (rank 0 only), equal to metrics.csv;
#  4. the [metrics] table's confusion matrix: one image per validation epoch, equal to the run
#     folder's PNG (where the build has cairo), and val_f1 a scalar like every metrics.csv cell;
#  3. resume: a run killed in epoch 1 (after rows past its last checkpoint reached the event
#     file) and resumed with --resume last shows in TensorBoard exactly the scalars of an
#     uninterrupted run, and still equals its own metrics.csv.
#   tensorboard_readback.sh <engine> <python with tensorboard> <test plugin dir> <scratch dir> <cairo: 1|0>
set -euo pipefail
engine=$(realpath "$1"); python=$2; plugins=$(realpath "$3"); work=$4; cairo=${5:-0}
check="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/reference/tb_check.py"
"$python" -c 'import tensorboard' 2>/dev/null || { echo "no tensorboard in $python (scripts/setup.sh installs it)"; exit 1; }
rm -rf "$work"; mkdir -p "$work"; cd "$work"
cat > run.toml <<'TOML'
[trainer]
max_epochs = 3
log_every_n_steps = 1
deterministic = true
enable_progress_bar = false
enable_model_summary = false
[model]
name = "mlp"
input_size = 8
hidden = [16]
[data]
name = "synthetic"
shape = [8]
num_train = 96
num_val = 32
batch_size = 16
[tensorboard]
histogram_every_n_steps = 4
max_queue = 1
TOML
run() { OMP_NUM_THREADS=1 "$engine" --plugin-path "$plugins" --plugins csv,tensorboard "$@" 2>>"$work/engine.log"; }
fail() { cat "$work/engine.log"; exit 1; }

mkdir one && (cd one && cp ../run.toml . && run run.toml) || fail
"$python" -W ignore "$check" match one/runs/run/version_0 --histograms

# Two ranks (ddp on CPU): only rank 0 logs, so one event file, and it equals metrics.csv.
mkdir ddp && (cd ddp && cp ../run.toml . && run run.toml --plugins ddp --set trainer.devices=2 --set trainer.max_epochs=1 --set trainer.accelerator='"cpu"') || fail
[ "$(ls ddp/runs/run/version_0/events.out.tfevents.* | wc -l)" = 1 ] || { ls ddp/runs/run/version_0; exit 1; }
"$python" -W ignore "$check" match ddp/runs/run/version_0

# Straight: 3 epochs. Split: killed at the start of step 9 (6 steps per epoch), resumed.
mkdir straight split
(cd straight && cp ../run.toml . && run run.toml) || fail
(cd split && cp ../run.toml . && { run run.toml --plugins chaos --set chaos.rank=0 --set chaos.step=9 || true; })
[ -f split/runs/run/version_0/checkpoints/last.ckpt ] || fail
# The killed session's file renamed as if a larger pid had written it later in time: the resumed
# session's file must still sort after it, or TensorBoard reads it first and keeps the steps its
# START drops (a CI run had pids 9999 and 10000: "10000" sorts first).
old=$(ls split/runs/run/version_0/events.out.tfevents.*)
stamp=$(basename "$old" | cut -d. -f4)
mv "$old" "split/runs/run/version_0/events.out.tfevents.$((stamp + 100)).host.99999.0"
(cd split && run run.toml --resume last) || fail
[ ! -e split/runs/run/version_1 ] || { echo "resume did not continue in its folder"; exit 1; }
[ "$(ls split/runs/run/version_0/events.out.tfevents.* | wc -l)" = 2 ] || { ls split/runs/run/version_0; exit 1; }
"$python" -W ignore "$check" same straight/runs/run/version_0 split/runs/run/version_0
"$python" -W ignore "$check" match split/runs/run/version_0

# The confusion matrix of [metrics] as an image per validation epoch (3), next to val_f1.
mkdir metrics && (cd metrics && cp ../run.toml . && printf '[metrics]\nnames = ["f1", "confusion_matrix"]\n' >> run.toml && run run.toml) || fail
"$python" -W ignore "$check" match metrics/runs/run/version_0
grep -q "val_f1" metrics/runs/run/version_0/metrics.csv || { head -1 metrics/runs/run/version_0/metrics.csv; exit 1; }
if [ "$cairo" = 1 ]; then "$python" -W ignore "$check" images metrics/runs/run/version_0 val_confusion_matrix 3; fi
