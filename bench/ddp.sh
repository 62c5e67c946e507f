#!/usr/bin/env bash
# ddp overhead and scaling on CPU: single_device vs ddp with 1 rank (same batch: the cost of the
# bucketed all-reduce machinery), and ddp with 2 ranks vs 1 (per-rank batch fixed: throughput).
# Per-step time = (time of a long run - time of a short run) / (step difference), which removes
# start-up (process launch, MPI join, data generation). Every variant runs `rounds` times,
# interleaved; the median is reported.
#   bash bench/ddp.sh [rounds=3] [threads_per_rank=1]
set -euo pipefail
rounds=${1:-3}
threads=${2:-1}
root=$(cd "$(dirname "$0")/.." && pwd)
engine=${ENGINE:-$root/build/engine/engine}
work=$(mktemp -d /tmp/ember-bench-ddp-XXXXXX)
trap 'rm -rf "$work"' EXIT
# shellcheck source=bench/common.sh
source "$root/bench/common.sh"
CALC_DIGITS=6
{
  train_only_trainer_toml
  echo "num_threads = $threads"
  cat <<TOML
[model]
name = "mlp"
input_size = 784
hidden = [512, 256]
num_classes = 10
[data]
name = "synthetic"
shape = [784]
num_classes = 10
num_train = 65536
num_val = 0
num_test = 0
batch_size = 64
shuffle = true
[optimizer]
name = "sgd"
lr = 0.01
TOML
} > "$work/run.toml"
short=20
long=220
run() {  # variant steps -> seconds
  local variant=$1 steps=$2 start end
  local args=(--set "trainer.max_steps=$steps")
  case $variant in
    single) args+=(--plugins single_device) ;;
    ddp1) args+=(--plugins ddp) ;;
    ddp2) args+=(--plugins ddp --set trainer.devices=2) ;;
  esac
  start=$(date +%s.%N)
  (cd "$work" && OMP_NUM_THREADS=$threads "$engine" run.toml "${args[@]}" >/dev/null 2>"$work/err") || { cat "$work/err"; exit 1; }
  end=$(date +%s.%N)
  calc "$end - $start"
}
declare -A per_step
for r in $(seq "$rounds"); do
  for v in single ddp1 ddp2; do
    a=$(run $v $short); b=$(run $v $long)
    per_step[$v]+="$(calc "($b - $a) * 1000 / ($long - $short)") "
  done
done
median() { printf '%s\n' $1 | sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
s=$(median "${per_step[single]}"); d1=$(median "${per_step[ddp1]}"); d2=$(median "${per_step[ddp2]}")
echo "mlp 784-512-256-10, batch 64 per rank, $threads thread(s) per rank, median of $rounds rounds"
echo
echo "| variant | ms/step | samples/s | vs single_device |"
echo "|---|---|---|---|"
printf '| single_device | %.3f | %.0f | 1.000 |\n' "$s" "$(calc "64000 / $s")"
printf '| ddp, 1 rank | %.3f | %.0f | %.3f (time) |\n' "$d1" "$(calc "64000 / $d1")" "$(calc "$d1 / $s")"
printf '| ddp, 2 ranks | %.3f | %.0f | %.3f (throughput) |\n' "$d2" "$(calc "128000 / $d2")" "$(calc "(128000 / $d2) / (64000 / $s)")"
