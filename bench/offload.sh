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
#       its tokens/s, MFU and peak device memory: for each variant the sizes (layers at D_MODEL)
#       are tried in order until one fails; meant for a GPU. PLAN lists variant:layers in the
#       order they run (default "single_device:16 offload:F offload_params:F offload:F+2
#       single_device:20 single_device:24", F = the layers the available host memory holds at 16
#       bytes a parameter; F+2 must be refused at start-up). Other settings (environment):
#       D_MODEL=4096 NHEAD=32 SEQ=512 BATCH=4 PRECISION=bf16-mixed
#       COMPUTE_DTYPE=bf16 VARIANTS="single_device offload offload_params" STEPS=5
#       THROUGHPUT_WINDOW=3 RUN_TIMEOUT=300 HOST_RESERVE_GB=16. Rates come from the throughput
#       monitor inside the run (start-up and the first steps left out).
#   bash bench/offload.sh          (host, then step)
# step: per-step time = (time of a run of LONG steps - time of SHORT steps) / (LONG - SHORT),
# which removes start-up (model construction, placement). tokens/s = BATCH * SEQ / that.
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

variant_args() {  # variant [more plugins] -> engine arguments
  local more=${2:+,$2}
  case $1 in
    single_device) echo "${2:+--plugins $2}" ;;
    offload) echo "--plugins offload$more --set offload.compute_dtype=\"${COMPUTE_DTYPE:-auto}\"" ;;
    offload_params) echo "--plugins offload$more --set offload.offload_params=true --set offload.compute_dtype=\"${COMPUTE_DTYPE:-auto}\"" ;;
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

# One run of STEPS training steps with the throughput and device_stats monitors; prints
# "samples/s mfu peak_device_mb" from the last logged step (the rate over the last THROUGHPUT_WINDOW
# steps, so model construction, placement and the first steps' warm-up are left out), or "fail".
measured_run() {  # variant
  local variant=$1 root_dir="$work/runs"
  rm -rf "$root_dir"
  # shellcheck disable=SC2046
  local rc=0
  (cd "$work" && eval "timeout ${RUN_TIMEOUT:-300} \"$engine\" run.toml --set trainer.max_steps=${STEPS:-5} \
          --set trainer.logger=true --set trainer.log_every_n_steps=1 --set throughput.window_size=${THROUGHPUT_WINDOW:-3} \
          --set 'trainer.default_root_dir=\"$root_dir\"' $(variant_args "$1" csv,throughput,device_stats)" >/dev/null 2>"$work/err") || rc=$?
  if [ $rc -ne 0 ]; then
    # A run killed from outside (the kernel's OOM killer: 137, the timeout: 124) says nothing itself.
    [ $rc -gt 100 ] && echo "exit $rc ($( [ $rc = 124 ] && echo "over RUN_TIMEOUT" || echo "killed: out of host memory?"))" >> "$work/err"
    echo fail
    return
  fi
  local csv
  csv=$(find "$root_dir" -name metrics.csv | head -n 1)
  awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
           $(col["train|device|samples_per_sec"]) != "" { s = $(col["train|device|samples_per_sec"]);
             m = ("train|device|mfu" in col) ? $(col["train|device|mfu"]) : "" }
           { for (k in col) if (k ~ /cuda_peak_allocated_mb/ && $(col[k]) != "" && $(col[k]) + 0 > peak) peak = $(col[k]) + 0 }
           END { printf "%s %s %s\n", s, (m == "" ? "-" : m), (peak > 0 ? peak : "-") }' "$csv"
}

# Layers of d_model that the host memory holds under offload: fp32 masters and gradients and
# AdamW's two moments, 16 bytes a parameter, with HOST_RESERVE_GB (16) left for the rest of the
# process (LibTorch and CUDA's own, the data; 11 GiB measured on the H100 machine).
offload_layers_that_fit() {  # d_model
  local avail
  avail=$(awk '/MemAvailable/ { print $2 * 1024 }' /proc/meminfo)
  awk -v a="$avail" -v d="$1" -v r="${HOST_RESERVE_GB:-16}" 'BEGIN { per = 12 * d * d + 13 * d; printf "%d", (a - r * 1e9) / (16 * per) }'
}

search_part() {
  local d=${D_MODEL:-4096} nhead=${NHEAD:-32} seq=${SEQ:-512} batch=${BATCH:-4}
  export PRECISION=${PRECISION:-bf16-mixed} COMPUTE_DTYPE=${COMPUTE_DTYPE:-bf16}
  local fit
  fit=$(offload_layers_that_fit "$d")
  echo "## largest transformer that trains: d_model $d, $nhead heads, batch $batch x $seq tokens, AdamW, precision $PRECISION, offload compute_dtype $COMPUTE_DTYPE"
  echo
  echo "host: $(nproc) cores, $(awk '/MemTotal/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo) memory, $(awk '/MemAvailable/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo) available; $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo 'no GPU')"
  echo "tokens/s over the last ${THROUGHPUT_WINDOW:-3} of ${STEPS:-5} steps (throughput monitor, synchronized); peak = device_stats' largest cuda_peak_allocated_mb"
  echo "offload sizes: $fit layers is what the available host memory holds at 16 bytes a parameter"
  echo
  echo "| variant | layers | parameters | s/step | tokens/s | MFU | peak device MB | outcome |"
  echo "|---|---:|---:|---:|---:|---:|---:|---|"
  # Each variant: its sizes in order, until one fails. Interleaved so that a short call still
  # gets one size of each: the sizes that fit first, then the ones expected to fail.
  local plan=${PLAN:-single_device:16 offload:$fit offload_params:$fit offload:$((fit + 2)) single_device:20 single_device:24}
  local step variant layers failed=" "
  for step in $plan; do
    variant=${step%%:*}; layers=${step#*:}
    case " ${VARIANTS:-single_device offload offload_params} " in *" $variant "*) ;; *) continue ;; esac
    case $failed in *" $variant "*) continue ;; esac
    write_run "$layers" "$d" "$nhead" "$seq" "$batch"
    read -r sps mfu peak <<<"$(measured_run "$variant")"
    if [ "$sps" = fail ]; then
      echo "| $variant | $layers | $(params_of "$layers" "$d") | | | | | failed: $(grep -v '^\s*$' "$work/err" | tail -n 1 | cut -c1-160) |"
      failed+="$variant "
      continue
    fi
    echo "| $variant | $layers | $(params_of "$layers" "$d") | $(calc "$batch / $sps") | $(calc "$sps * $seq") | $mfu | $peak | trained |"
  done
}

case $mode in
  host) shift; host_part "$@" ;;
  step) shift; step_part "$@" ;;
  search) search_part ;;
  all) host_part; echo; step_part ;;
  *) echo "usage: bash bench/offload.sh [host [sizes] | step [layers] [d_model] | search]" >&2; exit 2 ;;
esac
