#!/usr/bin/env bash
# offload (ZeRO-Offload) benchmarks. Three parts, each runnable alone:
#   bash bench/offload.sh host [sizes=10,100,500]
#       the host optimizer step: ATen's fused CPU AdamW vs torch::optim::AdamW over fp32 masters,
#       and the copies around it (bench_offload; on CUDA too when a GPU is present).
#   bash bench/offload.sh step [layers=8] [d_model=512]
#       transformer step time (s/step and tokens/s) under single_device, offload and
#       offload + offload_params, on the default device (the GPU when one is present).
#   bash bench/offload.sh search
#       the largest transformer that trains under single_device / offload / offload_params, with
#       its tokens/s: for each variant, the sizes in LAYERS (at D_MODEL) are tried in order until
#       one fails (out of memory); meant for a GPU. Settings (environment): D_MODEL=4096 NHEAD=32
#       LAYERS="1 2 4 8 16 24 32 40 48" SEQ=512 BATCH=4 PRECISION=bf16-mixed COMPUTE_DTYPE=bf16
#       VARIANTS="single_device offload offload_params" SHORT=2 LONG=4.
#   bash bench/offload.sh          (host, then step)
# Per-step time = (time of a run of LONG steps - time of SHORT steps) / (LONG - SHORT), which
# removes start-up (model construction, placement). tokens/s = BATCH * SEQ / that.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD:-$root/${EMBER_BUILD_DIR:-build}}
engine=${ENGINE:-$build/engine/engine}
mode=${1:-all}
# shellcheck source=bench/common.sh
source "$root/bench/common.sh"
work=$(mktemp -d /tmp/ember-bench-offload-XXXXXX)
trap 'rm -rf "$work"' EXIT
has_cuda=$(nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0)

host_part() {
  local sizes=${1:-10,100,500}
  echo "## host optimizer step (fp32 masters, AdamW)"
  nproc_line=$(nproc)
  echo "cpu cores: $nproc_line"
  "$build/bench/bench_offload" "$sizes" cpu bf16
  if [ "$has_cuda" = 1 ]; then
    echo
    echo "### with the device copies on cuda:0 (bf16 weights and gradients on the GPU)"
    "$build/bench/bench_offload" "$sizes" cuda:0 bf16
  fi
}

write_run() {  # layers d_model nhead seq batch steps
  local layers=$1 d=$2 nhead=$3 seq=$4 batch=$5
  {
    train_only_trainer_toml
    echo "precision = \"${PRECISION:-32-true}\""
    transformer_model_toml "$layers" "$d" "$nhead"
    cat <<TOML
[data]
name = "synthetic"
shape = [$seq, $d]
num_classes = 10
num_train = $((batch * ${LONG:-4} + batch))
num_val = 0
num_test = 0
batch_size = $batch
[optimizer]
name = "adamw"
lr = 0.0001
TOML
  } > "$work/run.toml"
}

variant_args() {  # variant -> engine arguments
  case $1 in
    single_device) echo "" ;;
    offload) echo "--plugins offload --set offload.compute_dtype=\"${COMPUTE_DTYPE:-auto}\"" ;;
    offload_params) echo "--plugins offload --set offload.offload_params=true --set offload.compute_dtype=\"${COMPUTE_DTYPE:-auto}\"" ;;
  esac
}

timed_run() {  # steps variant -> seconds, or "fail" (the error's last line in $work/err)
  local steps=$1 variant=$2 start end
  # shellcheck disable=SC2046
  start=$(date +%s.%N)
  if (cd "$work" && eval "\"$engine\" run.toml --set trainer.max_steps=$steps $(variant_args "$variant")" >/dev/null 2>"$work/err"); then
    end=$(date +%s.%N)
    calc "$end - $start"
  else
    echo fail
  fi
}

params_of() {  # layers d_model -> parameters of the transformer (encoder layers + classifier)
  awk "BEGIN { d = $2; l = $1; printf \"%.0f\", l * (4 * d * d + 4 * d + 2 * 4 * d * d + 4 * d + d + 4 * d) + d * 10 + 10 }"
}

step_part() {
  local layers=${1:-8} d=${2:-512} seq=${SEQ:-64} batch=${BATCH:-4}
  local short=${SHORT:-2} long=${LONG:-4}
  write_run "$layers" "$d" 8 "$seq" "$batch"
  echo "## transformer step: $layers layers, d_model $d ($(params_of "$layers" "$d") parameters), batch $batch x $seq tokens, AdamW, precision ${PRECISION:-32-true}, compute_dtype ${COMPUTE_DTYPE:-auto}"
  echo
  echo "| variant | s/step | tokens/s | vs single_device |"
  echo "|---|---:|---:|---:|"
  local base=""
  for variant in single_device offload offload_params; do
    a=$(timed_run "$short" "$variant")
    b=$(timed_run "$long" "$variant")
    if [ "$a" = fail ] || [ "$b" = fail ]; then
      echo "| $variant | failed: $(tail -n 1 "$work/err") | | |"
      continue
    fi
    s=$(calc "($b - $a) / ($long - $short)")
    [ -z "$base" ] && base=$s
    echo "| $variant | $s | $(calc "$batch * $seq / $s") | $(calc "$s / $base") |"
  done
}

search_part() {
  local d=${D_MODEL:-4096} nhead=${NHEAD:-32} seq=${SEQ:-512} batch=${BATCH:-4}
  local short=${SHORT:-2} long=${LONG:-4}
  echo "## largest transformer that trains: d_model $d, $nhead heads, batch $batch x $seq tokens, AdamW, precision ${PRECISION:-bf16-mixed}, offload compute_dtype ${COMPUTE_DTYPE:-bf16}"
  echo
  echo "| variant | layers | parameters | s/step | tokens/s | first size that failed |"
  echo "|---|---:|---:|---:|---:|---|"
  export PRECISION=${PRECISION:-bf16-mixed} COMPUTE_DTYPE=${COMPUTE_DTYPE:-bf16}
  for variant in ${VARIANTS:-single_device offload offload_params}; do
    local best="" best_s="" failed="none tried"
    for layers in ${LAYERS:-1 2 4 8 16 24 32 40 48}; do
      write_run "$layers" "$d" "$nhead" "$seq" "$batch"
      a=$(timed_run "$short" "$variant")
      b=fail
      [ "$a" != fail ] && b=$(timed_run "$long" "$variant")
      if [ "$a" = fail ] || [ "$b" = fail ]; then
        failed="$layers layers ($(params_of "$layers" "$d")): $(tail -n 1 "$work/err" | cut -c1-120)"
        break
      fi
      best=$layers
      best_s=$(calc "($b - $a) / ($long - $short)")
      failed="none"
    done
    if [ -z "$best" ]; then
      echo "| $variant | - | - | - | - | $failed |"
    else
      echo "| $variant | $best | $(params_of "$best" "$d") | $best_s | $(calc "$batch * $seq / $best_s") | $failed |"
    fi
  done
}

case $mode in
  host) shift; host_part "$@" ;;
  step) shift; step_part "$@" ;;
  search) search_part ;;
  all) host_part; echo; step_part ;;
  *) echo "usage: bash bench/offload.sh [host [sizes] | step [layers] [d_model] | search]" >&2; exit 2 ;;
esac
