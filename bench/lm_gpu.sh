#!/usr/bin/env bash
# GPT-2 124M on one GPU (configs/gpt2_124m_gpu.toml: 12 x 12 x 768, context 1,024, vocabulary
# 50,304, bf16-mixed, fused AdamW, micro-batches of 16 x 1,024 tokens), nanoGPT's recipe with
# model.bias = false as nanoGPT trains it, side by side in one run:
#   - Ember: `engine --plugins throughput,csv,device_stats configs/gpt2_124m_gpu.toml`, with
#     trainer.activation_checkpointing none, selective and full, and with model.chunked_loss = true
#     (the output layer and cross-entropy a slice of tokens at a time, never the whole logits),
#     and with model.fused_cross_entropy = true (Ember's two-pass cross-entropy kernels on the
#     whole logits: `fused`),
#   - the same model and step in plain PyTorch (bench/lm_gpu.py), eager and with torch.compile
#     (nanoGPT's default).
#   - Ember with trainer.cuda_graph (no accumulation: an optimizer step after each micro-batch).
#   - profile: one optimizer step of Ember (torch_profiler plugin, after two warm-up steps) and of
#     each PyTorch variant that ran (one step after its timed ones) recorded, and their GPU time
#     per kind of kernel side by side (bench/kernel_breakdown.py): where the gap comes from.
# Each trains warm-up optimizer steps (not timed: compilation, autotuning, lazy loading of CUDA
# kernels; Ember: STEPS of them, PyTorch: WARMUP) and then STEPS timed steps of ACCUMULATE
# micro-batches, on the same token file (the Austen corpus, SentencePiece 8,192, built by the first
# Ember run). Ember's rate is its throughput monitor's over exactly the timed micro-batches
# (throughput.window_size, logged at the last step); PyTorch's is timed around the timed steps. MFU for all
# with the same FLOPs per token (nanoGPT's estimate, which the gpt model reports: 6 x matmul
# parameters + 12 x layers x context x width) and the device's dense bf16 peak as Ember's
# throughput monitor looks it up. Peak memory: the caching allocator's peak (Ember: device_stats'
# cuda_peak_allocated_mb; PyTorch: max_memory_allocated over the timed steps).
#   bash bench/lm_gpu.sh [steps=10] [accumulate=8] [warmup=5]
# LM_GPU_SMOKE=1: tiny shapes on the CPU, to check the bench itself where there is no GPU.
# LM_GPU_VARIANTS: which rows to run (default all: "fused chunked selective full full_chunked graph eager compile profile"; Ember's
# plain row always runs, it makes the token file); ratios are against torch.compile when it ran.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
steps=${1:-10}; accumulate=${2:-8}; warmup=${3:-5}
build=$(cd "${EMBER_BUILD_DIR:-build}" && pwd)
torch_prefix=${EMBER_TORCH_PREFIX:-$(bash scripts/setup.sh | tail -n 1)}
# (EMBER_BENCH_NO_BUILD=1: the build is done, as under CTest, whose lm_gpu_bench_smoke runs this.)
[ "${EMBER_BENCH_NO_BUILD:-}" = 1 ] || cmake --build "$build" --target engine ember_plugin_gpt ember_plugin_text_lm ember_plugin_cosine ember_plugin_single_device \
  ember_plugin_bf16 ember_plugin_csv ember_plugin_checkpoint ember_plugin_throughput ember_plugin_device_stats ember_plugin_torch_profiler >/dev/null
python=$(cd "$torch_prefix/../../../../../.." && pwd)/bin/python
[ -x "$python" ] || python=python3
smoke=()
[ "${LM_GPU_SMOKE:-}" = 1 ] && smoke=(--set 'trainer.accelerator="cpu"' --set 'trainer.precision="32-true"' --set model.layers=1
  --set model.width=64 --set model.heads=2 --set data.batch_size=2 --set data.block_size=64 --set throughput.peak_tflops=1.0)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

ember() {  # name, activation checkpointing, micro-batches per optimizer step, extra arguments...
  # Twice the timed optimizer steps, logged every `timed` steps: the last value is the throughput
  # monitor's over exactly the last steps x accumulate micro-batches (the warm-up left out).
  local name=$1 ac=$2 acc=$3 timed=$((steps * accumulate / $3))
  shift 3
  (cd "$work" && "$build/engine/engine" --plugins throughput,csv,device_stats "$root/configs/gpt2_124m_gpu.toml" \
    --set model.bias=false --set trainer.max_steps=$((2 * timed)) --set trainer.accumulate_grad_batches="$acc" \
    --set trainer.activation_checkpointing=\""$ac"\" --set cosine.warmup=1 --set trainer.limit_val_batches=0 \
    --set trainer.log_every_n_steps="$timed" --set 'throughput.items="input_numel"' --set throughput.window_size=$((steps * accumulate)) \
    --set throughput.sync_cuda=false --set checkpoint.save_top_k=0 --set checkpoint.save_last=false \
    --set trainer.enable_progress_bar=false --set trainer.default_root_dir=\""$work/$name"\" "${smoke[@]}" "$@" 2>"$work/$name.log")
}
ember ember-none none "$accumulate" || { tail -5 "$work/ember-none.log"; exit 1; }
# text_lm names its token folder: "token file DIR" when cached, "tokenized into DIR" when it made it.
tokens=$(grep -oE '(token file|tokenized into) [^;]*' "$work/ember-none.log" | head -1 | sed -E 's/^(token file|tokenized into) //' || true)/tokens.u16
[ -f "$tokens" ] || { echo "lm_gpu.sh: no token file named in the first Ember run's log ($work/ember-none.log)"; exit 1; }
variants=" ${LM_GPU_VARIANTS:-fused chunked selective full full_chunked graph eager compile profile} "
runs() { [[ "$variants" == *" $1 "* ]]; }
if runs fused; then ember ember-fused none "$accumulate" --set model.fused_cross_entropy=true || { tail -5 "$work/ember-fused.log"; exit 1; }; fi
if runs chunked; then ember ember-chunked none "$accumulate" --set model.chunked_loss=true || { tail -5 "$work/ember-chunked.log"; exit 1; }; fi
if runs selective; then ember ember-selective selective "$accumulate" || { tail -5 "$work/ember-selective.log"; exit 1; }; fi
if runs full; then ember ember-full full "$accumulate" || { tail -5 "$work/ember-full.log"; exit 1; }; fi
if runs full_chunked; then
  ember ember-full-chunked full "$accumulate" --set model.chunked_loss=true || { tail -5 "$work/ember-full-chunked.log"; exit 1; }
fi
# trainer.cuda_graph (forward and backward replayed as one graph) takes no gradient accumulation:
# the same micro-batches, an optimizer step after each.
if [ "${LM_GPU_SMOKE:-}" != 1 ] && runs graph; then
  ember ember-graph none 1 --set trainer.cuda_graph=true || echo "(Ember with trainer.cuda_graph failed: $(grep -m1 error "$work/ember-graph.log"))"
fi
if runs profile; then
  # Batches [2 x accumulate, 3 x accumulate) of 4 optimizer steps: the third step, whole.
  ember ember-profile none "$accumulate" --plugins torch_profiler --set trainer.max_steps=4 --set torch_profiler.repeat=1 \
    --set torch_profiler.wait=$((2 * accumulate - 1)) --set torch_profiler.warmup=1 --set torch_profiler.active="$accumulate" \
    --set torch_profiler.print=false || { tail -5 "$work/ember-profile.log"; exit 1; }
fi
for v in eager compile; do
  runs "$v" || continue
  runs profile && export LM_GPU_PROFILE="$work/pytorch-$v.trace.json"
  "$python" -W ignore bench/lm_gpu.py "$v" "$tokens" "$accumulate" "$steps" "$warmup" "$work/pytorch-$v.json" >"$work/pytorch-$v.log" 2>&1 ||
    { tail -20 "$work/pytorch-$v.log"; exit 1; }
done
"$python" - "$work" "$steps" "$accumulate" <<'PY'
import csv, glob, json, os, re, sys
work, steps, accumulate = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
flops_per_token = 6 * (12 * (768 * 2304 + 768 * 768 + 2 * 768 * 3072) + 50304 * 768) + 12 * 12 * 1024 * 768
log = open(f"{work}/ember-none.log").read()
peak = float(re.search(r"peak ([0-9.]+) TFLOP/s", log).group(1)) * 1e12
device = re.search(r"peak [0-9.]+ TFLOP/s \(([^,]+),", log).group(1)
if device == "throughput.peak_tflops":
    device = "CPU smoke run (LM_GPU_SMOKE=1)"
# Model state in float32 (weights, gradients, AdamW's two moments): what the activations come on top of.
state_mb = 4 * 4 * (12 * (768 * 2304 + 768 * 768 + 2 * 768 * 3072 + 2 * 768) + 50304 * 768 + 1024 * 768 + 768) / 2**20
rows = []
for name, label in (("ember-none", "Ember"), ("ember-fused", "Ember, model.fused_cross_entropy = true"),
                    ("ember-chunked", "Ember, model.chunked_loss = true"),
                    ("ember-selective", "Ember, selective checkpointing"), ("ember-full", "Ember, full checkpointing"),
                    ("ember-full-chunked", "Ember, full checkpointing and model.chunked_loss = true"),
                    ("ember-graph", "Ember, trainer.cuda_graph, optimizer step every micro-batch")):
    found = glob.glob(f"{work}/{name}/**/metrics.csv", recursive=True)
    if not found: continue
    metrics = found[0]
    rs = list(csv.DictReader(open(metrics)))
    tps = [float(r["train|device|items_per_sec"]) for r in rs if r.get("train|device|items_per_sec")][-1]
    mem = max((float(r["device_stats/cuda_peak_allocated_mb"]) for r in rs if r.get("device_stats/cuda_peak_allocated_mb")), default=0.0)
    loss = [float(r["train_loss_step"]) for r in rs if r.get("train_loss_step")][-1]
    rows.append((label, tps, loss, mem))
for v, label in (("eager", "PyTorch eager"), ("compile", "PyTorch + torch.compile (nanoGPT)")):
    if not os.path.exists(f"{work}/pytorch-{v}.json"): continue
    r = json.load(open(f"{work}/pytorch-{v}.json"))
    rows.append((label, r["tokens_per_s"], r["loss"], r["peak_mb"]))
ref_label = "PyTorch + torch.compile (nanoGPT)" if any(r[0].startswith("PyTorch + torch.compile") for r in rows) else "Ember"
ref = next(r[1] for r in rows if r[0] == ref_label)
print(f"{device}; {steps} timed steps of {accumulate} x 16 x 1,024 tokens after the warm-up; peak {peak / 1e12:.1f} TFLOP/s (bf16, dense)")
print()
print(f"| variant | tokens/s | vs {'torch.compile' if ref_label != 'Ember' else 'Ember'} | MFU | last train loss | peak allocated MB | activations MB (peak - 16 B/param state) |")
print("|---|---|---|---|---|---|---|")
for label, tps, loss, mem in rows:
    print(f"| {label} | {tps:,.0f} | {tps / ref:.2f}x | {tps * flops_per_token / peak:.3f} | {loss:.3f} | {mem:,.0f} | {mem - state_mb:,.0f} |")
PY
if runs profile; then
  traces=("Ember=$(find "$work/ember-profile" -name 'trace-rank0.json' | head -1)")
  for v in eager compile; do [ -f "$work/pytorch-$v.trace.json" ] && traces+=("PyTorch $v=$work/pytorch-$v.trace.json"); done
  echo
  "$python" bench/kernel_breakdown.py "${traces[@]}"
fi
