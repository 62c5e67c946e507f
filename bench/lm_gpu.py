"""GPT-2 124M of configs/gpt2_124m_gpu.toml in plain PyTorch, nanoGPT's train_gpt2 recipe, for
bench/lm_gpu.sh: the same shape (12 x 12 x 768, context 1,024, vocabulary 50,304), pre-norm blocks,
GELU (tanh) MLP, tied embeddings, no biases (nanoGPT's bias = False; the bench runs Ember with
model.bias = false too), causal scaled_dot_product_attention (flash), bf16 autocast, fused AdamW
(6e-4, betas (0.9, 0.95), weight decay 0.1 on the matrices and embeddings only: nanoGPT's groups,
as the config's `no_weight_decay_1d`), clipping at 1.0, micro-batches of 16 x 1,024 random
windows of the same token file Ember trains on (pinned, copied without a sync), gradient
accumulation. `compile` wraps the model in torch.compile as nanoGPT does.

  lm_gpu.py eager|compile TOKENS_U16 ACCUMULATE STEPS WARMUP_STEPS OUT_JSON

Times STEPS optimizer steps after WARMUP_STEPS (compilation and cuDNN/cuBLAS autotuning happen
there), synchronising before each clock read (LM_GPU_SMOKE=1: tiny shapes on the CPU, a check
of the bench itself). OUT_JSON: {"variant", "tokens_per_s", "step_s",
"loss", "peak_mb"}. LM_GPU_PROFILE=TRACE_JSON: after the timed steps, one more optimizer step
under torch.profiler (CPU and CUDA activities), its Chrome trace written to TRACE_JSON for
bench/kernel_breakdown.py.
"""
import json
import os
import sys
import time

import numpy as np
import torch

import gpt_reference

VOCAB, CONTEXT, LAYERS, HEADS, WIDTH, BATCH = 50304, 1024, 12, 12, 768, 16
SMOKE = os.environ.get("LM_GPU_SMOKE") == "1"   # a check of the bench itself on a CPU: tiny shapes
if SMOKE:
    CONTEXT, LAYERS, HEADS, WIDTH, BATCH = 64, 1, 2, 64, 2


def Gpt():
    return gpt_reference.Gpt(VOCAB, CONTEXT, LAYERS, HEADS, WIDTH)


def main():
    variant, tokens_file, accumulate, steps, warmup, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True   # trainer.float32_matmul_precision = "high"
    torch.backends.cudnn.allow_tf32 = True
    data = np.memmap(tokens_file, dtype=np.uint16, mode="r")
    train = torch.from_numpy(data[: int(len(data) * 0.9)].astype(np.int64))
    dev = torch.device("cpu" if SMOKE else "cuda")
    model = Gpt().to(dev)
    opt = torch.optim.AdamW(gpt_reference.decay_groups(model, 0.1), lr=6e-4, betas=(0.9, 0.95), fused=not SMOKE)
    step_model = torch.compile(model) if variant == "compile" else model

    def batch():
        starts = torch.randint(len(train) - CONTEXT - 1, (BATCH,))
        x = torch.stack([train[s : s + CONTEXT] for s in starts.tolist()])
        y = torch.stack([train[s + 1 : s + 1 + CONTEXT] for s in starts.tolist()])
        if dev.type == "cuda":
            x, y = x.pin_memory(), y.pin_memory()
        return x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)

    def step():
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(accumulate):
            x, y = batch()
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = step_model(x, y) / accumulate
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return total

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    sync()
    wall = time.perf_counter() - start
    tokens = steps * accumulate * BATCH * CONTEXT
    trace = os.environ.get("LM_GPU_PROFILE")
    if trace:
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with torch.profiler.profile(activities=activities) as prof:
            with torch.profiler.record_function("ProfilerStep#0"):
                step()
            sync()
        prof.export_chrome_trace(trace)
    json.dump({"variant": variant, "tokens_per_s": tokens / wall, "step_s": wall / steps, "loss": float(loss),
               "peak_mb": torch.cuda.max_memory_allocated() / 2**20 if dev.type == "cuda" else 0.0}, open(out, "w"))


if __name__ == "__main__":
    main()
