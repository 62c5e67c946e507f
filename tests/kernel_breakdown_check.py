"""bench/kernel_breakdown.py on two made-up traces whose sums are known: kernels land in their
kinds (Triton before the names it fused, flash attention before matrix products), the totals, the
kernel counts and the GPU's busy fraction come out as computed by hand, and a trace without its step
range, or without operators, is refused. Run: kernel_breakdown_check.py BENCH_DIR"""
import json
import os
import subprocess
import sys
import tempfile

script = os.path.join(sys.argv[1], "kernel_breakdown.py")


def trace(path, kernels, step=True, ops=True):
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}] if ops else []
    if step:
        events.append({"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#4", "ts": 0, "dur": 10_000})
    t = 100
    for name, us, gap in kernels:
        events.append({"ph": "X", "cat": "kernel", "name": name, "ts": t, "dur": us})
        t += us + gap
    json.dump({"traceEvents": events}, open(path, "w"))


def run(*args):
    return subprocess.run([sys.executable, script, *args], capture_output=True, text=True)


with tempfile.TemporaryDirectory() as d:
    a, b = os.path.join(d, "a.json"), os.path.join(d, "b.json")
    # a: 2,000 us of GPU time in 2,500 us from first to last kernel (two 250 us gaps): 80% busy.
    trace(a, [("sm90_xmma_gemm_bf16bf16_bf16f32", 1000, 250), ("flash_fwd_kernel", 400, 250),
              ("vectorized_layer_norm_kernel", 300, 0), ("void at::native::vectorized_elementwise_kernel<GeluCUDA>", 200, 0),
              ("void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>", 100, 0)])
    # b: no gaps, a Triton kernel whose name holds layer_norm and gelu.
    trace(b, [("nvjet_tst_128x256", 1000, 0), ("triton_per_fused_add_native_layer_norm_gelu_0", 300, 0),
              ("multi_tensor_apply_kernel<FusedAdamMathFunctor>", 100, 0)])
    r = run(f"Ember={a}", f"compiled={b}")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    expect = ["| matrix products (cuBLAS, CUTLASS) | 1.0 | 1.0 |",
              "| attention (flash / memory-efficient) | 0.4 | 0.0 |",
              "| fused by torch.compile (Triton) | 0.0 | 0.3 |",
              "| layer norm | 0.3 | 0.0 |",
              "| GELU | 0.2 | 0.0 |",
              "| copies, casts and fills | 0.1 | 0.0 |",
              "| optimizer and clipping (multi-tensor) | 0.0 | 0.1 |",
              "| **all kernels** | 2.0 | 1.4 |",
              "| kernels launched | 5 | 3 |",
              "| GPU busy (of first kernel to last) | 80.0% | 100.0% |"]
    for line in expect:
        assert line in out, f"missing {line!r} in\n{out}"
    assert "softmax" not in out, out  # kinds no trace has are left out
    trace(a, [("gemm", 10, 0)], step=False)
    r = run(f"Ember={a}")
    assert r.returncode != 0 and "has no ProfilerStep range" in r.stderr, r
    trace(a, [("gemm", 10, 0)], ops=False)
    r = run(f"Ember={a}")
    assert r.returncode != 0 and "holds no operators" in r.stderr, r
print("kernel_breakdown_check: ok")
