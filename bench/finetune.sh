#!/usr/bin/env bash
# Fine-tuning all-MiniLM-L6-v2 on small_fine_foods (configs/fine_foods_minilm.toml), side by side in
# one run: Ember (`engine` with --set overrides) and Hugging Face transformers driven by a
# LightningModule + lightning.Trainer (bench/finetune.py), same weights (one classification head
# drawn for both), tokens, splits, train order, padding, batch size, AdamW, warmup + cosine, gradient
# clipping and epochs, on the same LibTorch wheel. Per precision and side: steady-state training
# samples/s (bench/finetune.py says how it is timed), test accuracy, peak RSS, wall time, and the
# ratios Ember / Lightning. Printed first: the CPU model and its SIMD flags, torch and Lightning
# versions, the machine's load.
#   bash bench/finetune.sh     # 1 epoch fp32 (113 batches + val + test), bf16-mixed 4 batches: ~30 min idle (estimate)
#   FINETUNE_LIMIT=6 FINETUNE_EVAL_LIMIT=2 FINETUNE_PRECISIONS=32-true bash bench/finetune.sh   # a quick check of the script
# Knobs (environment): FINETUNE_EPOCHS (1), FINETUNE_LIMIT (training batches per epoch, 0 = all),
# FINETUNE_MAX_LENGTH (128), FINETUNE_PRECISIONS ("32-true,bf16-mixed"), FINETUNE_BF16_LIMIT
# (batches of the throughput-only runs of precisions other than 32-true, 4; 0 = run them like fp32),
# FINETUNE_WARMUP_BATCHES (2: left out of samples/s), FINETUNE_BATCH_SIZE (32), FINETUNE_EVAL_LIMIT (val and
# test batches, -1 = all; a smaller count makes the accuracy a smoke check only), FINETUNE_GROUP_BY_LENGTH
# (1: both sides batch texts of similar length, Ember by data.group_by_length, Python by transformers'
# get_length_grouped_indices on the same generator; default 0, plain shuffled batches), FINETUNE_EMBER_UNPAD
# (Ember's bert.unpad: auto (default), true, false = compute the padding as transformers does).
# Exits non-zero when a side fails or a side's test accuracy is missing.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
build=${EMBER_BUILD_DIR:-build}
torch_prefix=${EMBER_TORCH_PREFIX:-$(bash scripts/setup.sh | tail -n 1)}   # EMBER_TORCH_PREFIX: a given LibTorch (the GPU machine's), no set-up
cmake --build "$build" --target engine ember_plugin_bert ember_plugin_text_classification ember_plugin_single_device \
  ember_plugin_fp32 ember_plugin_bf16 ember_plugin_csv ember_plugin_model_summary ember_plugin_cosine ember_plugin_checkpoint \
  ember_plugin_throughput >/dev/null
python=$(cd "$torch_prefix/../../../../../.." && pwd)/bin/python   # the venv that holds the torch wheel
[ -x "$python" ] || { echo "finetune: no Python venv next to LibTorch ($torch_prefix): run scripts/setup.sh" >&2; exit 1; }
"$python" -c "import lightning" 2>/dev/null || "$python" -m pip install -q "lightning==2.6.*" >/dev/null
"$python" -c "import transformers, tokenizers, safetensors" 2>/dev/null ||
  { echo "finetune: transformers/tokenizers/safetensors missing from $python's venv: run scripts/setup.sh" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //') ($(nproc) usable cpus)"
echo "cpu flags: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|avx512f|avx512_bf16|avx512_fp16|amx_bf16|amx_tile|amx_fp16|fma)$' | tr '\n' ' ')"
"$python" -c "import torch, lightning, transformers; print(f'torch {torch.__version__} (cpu capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads), lightning {lightning.__version__}, transformers {transformers.__version__}')"
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg) (the sides run one after the other: compare ratios, not absolute rates)"
echo

"$python" bench/finetune.py bench --engine "$build/engine/engine" --work "$work" \
  --epochs "${FINETUNE_EPOCHS:-1}" --limit-train-batches "${FINETUNE_LIMIT:-0}" --max-length "${FINETUNE_MAX_LENGTH:-128}" \
  --batch-size "${FINETUNE_BATCH_SIZE:-32}" --precisions "${FINETUNE_PRECISIONS:-32-true,bf16-mixed}" \
  --throughput-only-limit "${FINETUNE_BF16_LIMIT:-4}" --limit-eval-batches "${FINETUNE_EVAL_LIMIT:--1}" --warmup-batches "${FINETUNE_WARMUP_BATCHES:-2}" \
  --ember-unpad "${FINETUNE_EMBER_UNPAD:-auto}" $([ "${FINETUNE_GROUP_BY_LENGTH:-0}" = 1 ] && echo --group-by-length)
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
