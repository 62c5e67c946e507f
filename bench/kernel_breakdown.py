"""Where the GPU time of one optimizer step goes, side by side: reads Chrome traces of one step each
(Ember's torch_profiler plugin, torch.profiler's export_chrome_trace) and sums the GPU kernels' time
per kind of work, so the gap between two runs of the same model shows which kernels make it.

  kernel_breakdown.py LABEL=TRACE.json [LABEL=TRACE.json ...]

Prints a markdown table (ms of GPU time per kind, the kernels launched, the GPU's busy fraction of
the span from the first kernel to the last) and each trace's ten longest kernels. A trace without
GPU kernels (a CPU run) is checked for its step range and operators only. Exit 1 when a trace
cannot be read or holds no operators.
"""
import json
import re
import sys
from collections import defaultdict

# First match wins: torch.compile's Triton kernels carry the names of the ops they fused.
KINDS = [
    ("fused by torch.compile (Triton)", r"^triton_"),
    ("attention (flash / memory-efficient)", r"flash|fmha|attention|sdpa"),
    ("matrix products (cuBLAS, CUTLASS)", r"gemm|cutlass|nvjet|xmma|cublas|sm90_|sm80_|ampere_|hopper|splitk"),
    ("layer norm", r"layer_?norm|LayerNorm|rms_?norm|RMSNorm"),
    ("softmax and cross-entropy", r"softmax|nll_loss|cross_entropy|SoftMax"),
    ("GELU", r"gelu|Gelu"),
    ("optimizer and clipping (multi-tensor)", r"adam|Adam|multi_tensor|foreach"),
    ("copies, casts and fills", r"copy|Copy|memcpy|Memcpy|memset|Memset|fill|Fill|CatArray|cast"),
    ("other element-wise and reductions", r"elementwise|reduce|Reduce|vectorized|unrolled"),
]
GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset"}


def kind_of(name):
    for kind, pattern in KINDS:
        if re.search(pattern, name):
            return kind
    return "other"


def read(path):
    try:
        with open(path) as f:
            trace = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"kernel_breakdown.py: cannot read {path}: {e}")
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X"]


def busy_fraction(intervals):
    if not intervals:
        return 0.0
    intervals.sort()
    busy, (start, end) = 0.0, intervals[0]
    first = start
    for s, e in intervals[1:]:
        if s > end:
            busy += end - start
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    return busy / max(end - first, 1e-9) if end > first else 1.0


def main():
    if len(sys.argv) < 2 or any("=" not in a for a in sys.argv[1:]):
        sys.exit(__doc__)
    runs = []
    for arg in sys.argv[1:]:
        label, path = arg.split("=", 1)
        events = read(path)
        ops = [e for e in events if e.get("cat") == "cpu_op"]
        if not ops:
            sys.exit(f"kernel_breakdown.py: {path} ({label}) holds no operators: was anything recorded?")
        if not any(e.get("name", "").startswith("ProfilerStep#") for e in events):
            sys.exit(f"kernel_breakdown.py: {path} ({label}) has no ProfilerStep range")
        gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
        runs.append((label, path, ops, gpu))
    if not any(gpu for _, _, _, gpu in runs):
        for label, path, ops, _ in runs:
            print(f"{label}: {len(ops)} operators recorded, no GPU kernels (a CPU run): the breakdown needs a GPU ({path})")
        return
    per_kind = []
    for label, _, _, gpu in runs:
        sums = defaultdict(float)
        for e in gpu:
            sums[kind_of(e["name"])] += e.get("dur", 0) / 1000.0
        per_kind.append(sums)
    kinds = [k for k, _ in KINDS] + ["other"]
    print("| GPU time per optimizer step, ms | " + " | ".join(label for label, *_ in runs) + " |")
    print("|---|" + "---|" * len(runs))
    for kind in kinds:
        if any(s.get(kind) for s in per_kind):
            print(f"| {kind} | " + " | ".join(f"{s.get(kind, 0.0):,.1f}" for s in per_kind) + " |")
    print("| **all kernels** | " + " | ".join(f"{sum(s.values()):,.1f}" for s in per_kind) + " |")
    print("| kernels launched | " + " | ".join(f"{len(gpu):,}" for _, _, _, gpu in runs) + " |")
    print("| GPU busy (of first kernel to last) | " +
          " | ".join(f"{busy_fraction([(e['ts'], e['ts'] + e.get('dur', 0)) for e in gpu]):.1%}" for _, _, _, gpu in runs) + " |")
    for label, _, _, gpu in runs:
        totals = defaultdict(lambda: [0.0, 0])
        for e in gpu:
            totals[e["name"]][0] += e.get("dur", 0) / 1000.0
            totals[e["name"]][1] += 1
        print(f"\n{label}: the ten longest kernels (ms in the step, calls)")
        for name, (ms, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:10]:
            print(f"  {ms:8.2f} {calls:5d}  {name[:110]}")


if __name__ == "__main__":
    main()
