#!/usr/bin/env bash
# What the [metrics] table costs (bench/metrics.cpp): accuracy + macro-F1 + AUROC + confusion
# matrix updated on every training step and computed once per 50 steps, as a fraction of the step
# (models/cnn's Fashion-MNIST CNN, batch 128; a 32-32-10 MLP, batch 32), with binned (200) and
# exact AUROC; and the AUROC states' bytes as the samples grow. One thread, interleaved rounds,
# medians.
#   bash bench/metrics.sh [rounds]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
build=${EMBER_BUILD_DIR:-build}
cmake --build "$build" --target bench_metrics >/dev/null
OMP_NUM_THREADS=1 "$build/bench/bench_metrics" "${1:-5}"
# torchmetrics 1.9 (with Lightning in the LibTorch venv) on the same shapes, for comparison.
torch_prefix=${EMBER_TORCH_PREFIX:-$(bash scripts/setup.sh | tail -n 1)}
python=$(cd "$torch_prefix/../../../../../.." && pwd)/bin/python
"$python" -c "import torchmetrics" 2>/dev/null || "$python" -m pip install -q "torchmetrics==1.9.*" >/dev/null
echo
echo "| torchmetrics: model's batch | the same collection, 200 thresholds | exact auroc |"
echo "|---|---|---|"
"$python" bench/metrics.py "${1:-5}"
