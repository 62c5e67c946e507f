"""torchmetrics' side of bench/metrics.sh: the same collection (multiclass accuracy, macro-F1,
AUROC with 200 thresholds or exact, confusion matrix) updated on the same shapes every step and
computed once per 50 steps, on one thread; microseconds per step (median of `rounds`)."""
import sys
import time

import torch
import torchmetrics as tm
from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC, MulticlassConfusionMatrix, MulticlassF1Score

torch.set_num_threads(1)
torch.manual_seed(0)
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5


def per_step_us(batch, thresholds, steps):
    logits = torch.randn(batch, 10)
    target = torch.randint(0, 10, (batch,))
    c = tm.MetricCollection({
        "accuracy": MulticlassAccuracy(10), "f1": MulticlassF1Score(10, average="macro"),
        "auroc": MulticlassAUROC(10, thresholds=thresholds), "confusion": MulticlassConfusionMatrix(10)})
    best = []
    for _ in range(rounds):
        t = time.perf_counter()
        for k in range(1, steps + 1):
            c.update(logits, target)
            if k % 50 == 0:
                c.compute()
                c.reset()
        best.append((time.perf_counter() - t) / steps * 1e6)
    return sorted(best)[len(best) // 2]


for name, batch, steps in (("cnn, batch 128", 128, 200), ("mlp 32-32-10, batch 32", 32, 400)):
    print(f"| {name} | {per_step_us(batch, 200, steps):.1f} us | {per_step_us(batch, None, steps):.1f} us |")
