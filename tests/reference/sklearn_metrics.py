"""Generates classification and regression data and scikit-learn's values for them (and for the
edge cases: a class absent from the targets, one class only, tied scores), written as JSON for
tests/metric_library_test.cpp, which computes the same with <ember/support/metrics.h>.

    python tests/reference/sklearn_metrics.py OUT.json
"""
import json
import math
import sys

import numpy as np
from sklearn import metrics as skm
from sklearn.calibration import calibration_curve
from sklearn.preprocessing import label_binarize

rng = np.random.default_rng(20261126)
cases = []


def softmax(x):
    e = np.exp(x - x.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def ece(correct, conf, bins):
    # scikit-learn's calibration_curve gives the per-bin means of the non-empty bins; the bins'
    # shares come from the same binning (searchsorted over the inner edges).
    prob_true, prob_pred = calibration_curve(correct, conf, n_bins=bins, strategy="uniform")
    edges = np.linspace(0.0, 1.0, bins + 1)
    ids = np.searchsorted(edges[1:-1], conf)
    counts = np.bincount(ids, minlength=bins)
    counts = counts[counts > 0] / len(conf)
    gap = np.abs(prob_true - prob_pred)
    return {"l1": float((gap * counts).sum()), "l2": float(math.sqrt((gap ** 2 * counts).sum())), "max": float(gap.max())}


def defined_mean(values, weights=None):
    pairs = [(v, 1.0 if weights is None else w) for v, w in zip(values, weights or [None] * len(values)) if v is not None]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else float("nan")


def multiclass_case(name, n, c, targets=None):
    logits = rng.normal(size=(n, c)) * 2.0
    y = rng.integers(0, c, size=n) if targets is None else targets
    # Informative scores: the target's logit raised.
    logits[np.arange(n), y] += 1.5
    probs = softmax(logits)
    pred = probs.argmax(1)
    labels = list(range(c))
    e = {}
    for avg in ("micro", "macro", "weighted"):
        e[f"precision {avg}"] = skm.precision_score(y, pred, labels=labels, average=avg, zero_division=0)
        e[f"recall {avg}"] = skm.recall_score(y, pred, labels=labels, average=avg, zero_division=0)
        e[f"f1 {avg}"] = skm.f1_score(y, pred, labels=labels, average=avg, zero_division=0)
        e[f"fbeta2 {avg}"] = skm.fbeta_score(y, pred, beta=2.0, labels=labels, average=avg, zero_division=0)
    e["accuracy micro"] = skm.accuracy_score(y, pred)
    # Macro accuracy is the mean per-class recall over every class (balanced_accuracy_score skips
    # the absent ones, so it is computed from recall_score here).
    e["accuracy macro"] = float(np.mean(skm.recall_score(y, pred, labels=labels, average=None, zero_division=0)))
    mcm = skm.multilabel_confusion_matrix(y, pred, labels=labels)
    tn, fp = mcm[:, 0, 0], mcm[:, 0, 1]
    e["specificity macro"] = float(np.mean(np.where(tn + fp > 0, tn / np.maximum(tn + fp, 1), 0.0)))
    e["accuracy top2"] = skm.top_k_accuracy_score(y, probs, k=2, labels=labels)
    present = [k for k in labels if (y == k).any() and (y != k).any()]
    auc = [skm.roc_auc_score(y == k, probs[:, k]) if k in present else None for k in labels]
    ap = [skm.average_precision_score(y == k, probs[:, k]) if (y == k).any() else None for k in labels]
    support = [float((y == k).sum()) for k in labels]
    e["auroc macro"] = defined_mean(auc)
    e["auroc weighted"] = defined_mean(auc, support)
    e["average_precision macro"] = defined_mean(ap)
    if len(present) == c:
        assert abs(e["auroc macro"] - skm.roc_auc_score(y, probs, multi_class="ovr", average="macro")) < 1e-12
        assert abs(e["average_precision macro"] - skm.average_precision_score(label_binarize(y, classes=labels), probs, average="macro")) < 1e-12
    e["average_precision micro"] = skm.average_precision_score(label_binarize(y, classes=labels), probs, average="micro")
    cal = ece((pred == y).astype(float), probs.max(1), 15)
    e["calibration_error l1"], e["calibration_error l2"], e["calibration_error max"] = cal["l1"], cal["l2"], cal["max"]
    e["perplexity"] = math.exp(skm.log_loss(y, probs, labels=labels))
    cases.append({"name": name, "task": "multiclass", "classes": c, "preds": logits.ravel().tolist(), "pred_shape": [n, c],
                  "target": y.tolist(), "target_shape": [n], "expect": e,
                  "confusion_matrix": skm.confusion_matrix(y, pred, labels=labels).ravel().tolist()})


def binary_case(name, n, y, probs, grid):
    pred = (probs >= 0.5).astype(int)
    e = {
        "accuracy micro": skm.accuracy_score(y, pred),
        "precision micro": skm.precision_score(y, pred, zero_division=0),
        "recall micro": skm.recall_score(y, pred, zero_division=0),
        "f1 micro": skm.f1_score(y, pred, zero_division=0),
        "fbeta2 micro": skm.fbeta_score(y, pred, beta=2.0, zero_division=0),
        "specificity micro": skm.recall_score(y, pred, pos_label=0, zero_division=0),
    }
    if 0 < y.sum() < n:
        e["auroc macro"] = skm.roc_auc_score(y, probs)
        if grid:
            # Scores on the grid of 101 thresholds (two decimals): the binned curves are exact.
            e["auroc binned101"] = e["auroc macro"]
        else:
            # (Scores off the bins' edges: an edge's side is a convention.)
            cal = ece(y.astype(float), probs, 15)
            e["calibration_error l1"], e["calibration_error max"] = cal["l1"], cal["max"]
    else:
        e["auroc macro"] = float("nan")
    if y.sum() > 0:
        e["average_precision macro"] = skm.average_precision_score(y, probs)
        if grid:
            e["average_precision binned101"] = e["average_precision macro"]
    cases.append({"name": name, "task": "binary", "classes": 2, "preds": probs.tolist(), "pred_shape": [n], "target": y.tolist(),
                  "target_shape": [n], "expect": e, "confusion_matrix": skm.confusion_matrix(y, pred, labels=[0, 1]).ravel().tolist()})


def multilabel_case(name, n, labels):
    y = (rng.random((n, labels)) < np.array([0.5, 0.3, 0.1, 0.7])[:labels]).astype(int)
    probs = np.clip(rng.random((n, labels)) * 0.6 + y * 0.35, 0, 1)
    pred = (probs >= 0.5).astype(int)
    e = {"accuracy micro": 1.0 - skm.hamming_loss(y, pred)}
    for avg in ("micro", "macro", "weighted"):
        e[f"precision {avg}"] = skm.precision_score(y, pred, average=avg, zero_division=0)
        e[f"recall {avg}"] = skm.recall_score(y, pred, average=avg, zero_division=0)
        e[f"f1 {avg}"] = skm.f1_score(y, pred, average=avg, zero_division=0)
        e[f"auroc {avg}"] = skm.roc_auc_score(y, probs, average=avg)
        e[f"average_precision {avg}"] = skm.average_precision_score(y, probs, average=avg)
    cases.append({"name": name, "task": "multilabel", "classes": labels, "preds": probs.ravel().tolist(), "pred_shape": [n, labels],
                  "target": y.ravel().tolist(), "target_shape": [n, labels], "expect": e,
                  # [L, 2, 2]: [[tn, fp], [fn, tp]] per label
                  "confusion_matrix": skm.multilabel_confusion_matrix(y, pred).ravel().tolist()})


multiclass_case("multiclass", 517, 5)
multiclass_case("multiclass, class 2 absent from the targets", 300, 4, targets=rng.choice([0, 1, 3], size=300))
yb = (rng.random(400) < 0.34).astype(int)
binary_case("binary, tied scores", 400, yb, np.round(np.clip(rng.random(400) * 0.7 + yb * 0.3, 0, 1), 2), grid=True)
binary_case("binary, continuous scores", 400, yb, np.clip(rng.random(400) * 0.7 + yb * 0.3, 0, 1), grid=False)
binary_case("binary, every target 1", 50, np.ones(50, dtype=int), np.round(rng.random(50), 2), grid=True)
binary_case("binary, every target 0", 50, np.zeros(50, dtype=int), np.round(rng.random(50), 2), grid=True)
multilabel_case("multilabel", 300, 4)

yr = rng.normal(size=200) * 3 + 1
pr = yr + rng.normal(size=200)
cases.append({"name": "regression", "task": "regression", "classes": 0, "preds": pr.tolist(), "pred_shape": [200], "target": yr.tolist(),
              "target_shape": [200], "expect": {"mae": skm.mean_absolute_error(yr, pr), "mse": skm.mean_squared_error(yr, pr),
                                                "rmse": skm.root_mean_squared_error(yr, pr), "r2": skm.r2_score(yr, pr)}})

# An undefined value (NaN) is written as null.
for case in cases:
    case["expect"] = {k: (None if isinstance(v, float) and math.isnan(v) else float(v)) for k, v in case["expect"].items()}
with open(sys.argv[1], "w") as f:
    json.dump(cases, f, allow_nan=False)
