"""Precision benchmark: steps per second and peak memory of fp32, amp16 ("16-mixed") and bf16
("bf16-mixed") on two models, in Ember and in plain PyTorch (torch.autocast + torch.amp.GradScaler,
the reference the issue names), side by side in one run.

  cnn          models/cnn's default widths on 28x28 images, batch 64
  transformer  models/transformer: one encoder block, d_model 128, 4 heads, ff 512, sequences of
               64, batch 32

Every variant runs as its own process, interleaved over `rounds`, on data it cannot learn (random
labels), with Adam. Epoch 0 is warm-up and dropped; the best remaining epoch is reported (least
disturbed by other load on a shared machine), with the peak resident memory of the process (CPU)
or the peak CUDA memory allocated (GPU) and ratios to Ember fp32 on the same model.

    python bench/precision.py [--rounds 2] [--device cpu|cuda] [--threads 1] [--steps 16] [--epochs 3]
    python bench/precision.py --torch-worker MODEL PRECISION DEVICE STEPS EPOCHS THREADS   (internal)
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {
    "cnn": dict(batch=64, shape=[1, 28, 28], toml='name = "cnn"'),
    "transformer": dict(batch=32, shape=[64, 128], toml='name = "transformer"\nd_model = 128\nnhead = 4\ndim_feedforward = 512'),
}
PRECISIONS = {"fp32": "32-true", "amp16": "16-mixed", "bf16": "bf16-mixed"}


# ------------------------------------------------------------------------------------------------
# The PyTorch side (a worker process per variant).
def torch_worker(model, precision, device, steps, epochs, threads):
    import resource

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    torch.manual_seed(0)

    from overhead import Net as Cnn  # models/cnn, the same network bench/overhead.py trains

    class Transformer(nn.Module):  # models/transformer
        def __init__(self):
            super().__init__()
            self.layer1 = nn.TransformerEncoderLayer(128, 4, dim_feedforward=512, dropout=0.1)
            self.head = nn.Linear(128, 10)

        def forward(self, x):
            return self.head(self.layer1(x.transpose(0, 1)).mean(0))

    spec = MODELS[model]
    net = (Cnn() if model == "cnn" else Transformer()).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    n = steps * spec["batch"]
    x = torch.randn(n, *spec["shape"], device=device)
    y = torch.randint(0, 10, (n,), device=device)
    dtype = {"fp32": None, "amp16": torch.float16, "bf16": torch.bfloat16}[precision]
    scaler = torch.amp.GradScaler(device, enabled=precision == "amp16")
    dev_type = torch.device(device).type
    if dev_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    net.train()
    for e in range(epochs):
        if dev_type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        perm = torch.randperm(n, device=device)
        for i in range(steps):
            idx = perm[i * spec["batch"]:(i + 1) * spec["batch"]]
            with torch.autocast(dev_type, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = F.cross_entropy(net(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        if dev_type == "cuda":
            torch.cuda.synchronize()
        print(f"epoch {e} {time.perf_counter() - t0:.4f}", flush=True)
    if dev_type == "cuda":
        print(f"peak_mb {torch.cuda.max_memory_allocated() / 2**20:.1f}")


# ------------------------------------------------------------------------------------------------
# The driver.
def run(cmd, cwd=None):
    """Runs cmd; returns (stdout+stderr, peak RSS in MB of that process)."""
    p = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}\n{out[-2000:]}")
    return out, usage.ru_maxrss / 1024.0


def ember_config(model, steps, epochs, threads, accelerator):
    spec = MODELS[model]
    shape = ", ".join(map(str, spec["shape"]))
    return f"""[trainer]
max_epochs = {epochs}
limit_val_batches = 0
num_sanity_val_steps = 0
enable_checkpointing = false
enable_model_summary = false
logger = false
num_threads = {threads}
accelerator = "{accelerator}"
[model]
{spec["toml"]}
[data]
name = "synthetic"
noise = 30.0
shape = [{shape}]
num_train = {steps * spec["batch"]}
num_val = 0
num_test = 0
batch_size = {spec["batch"]}
[optimizer]
name = "adam"
lr = 0.002
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=16, help="steps per epoch")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--models", default="cnn,transformer")
    ap.add_argument("--build", default=os.environ.get("EMBER_BUILD_DIR", os.path.join(ROOT, "build")))
    ap.add_argument("--torch-worker", nargs=6)
    a = ap.parse_args()
    if a.torch_worker:
        m, p, d, s, e, t = a.torch_worker
        torch_worker(m, p, d, int(s), int(e), int(t))
        return
    engine = os.path.join(a.build, "engine", "engine")
    env_threads = str(a.threads)
    os.environ["OMP_NUM_THREADS"] = env_threads
    epoch_re = re.compile(r"^Epoch (\d+)/\d+ .*\(([0-9.]+)s\)$", re.M)
    results = {}  # (model, impl, precision) -> (epoch seconds list, peak MB)
    with tempfile.TemporaryDirectory() as work:
        for r in range(a.rounds):
            for model in a.models.split(","):
                cfg = os.path.join(work, f"{model}.toml")
                with open(cfg, "w") as f:
                    f.write(ember_config(model, a.steps, a.epochs, a.threads, a.device))
                for prec, lightning in PRECISIONS.items():
                    out, rss = run([engine, cfg, "--set", f'trainer.precision="{lightning}"'], cwd=work)
                    times = [float(t) for i, t in epoch_re.findall(out) if int(i) > 0]
                    m = re.search(r"peak cuda memory ([0-9.]+) MB", out)
                    key = (model, "ember", prec)
                    results.setdefault(key, ([], 0.0))
                    results[key] = (results[key][0] + times, max(results[key][1], float(m.group(1)) if m else rss))
                    out, rss = run([sys.executable, __file__, "--torch-worker", model, prec, a.device, str(a.steps), str(a.epochs), env_threads])
                    times = [float(l.split()[2]) for l in out.splitlines() if l.startswith("epoch ") and int(l.split()[1]) > 0]
                    m = re.search(r"peak_mb ([0-9.]+)", out)
                    key = (model, "pytorch", prec)
                    results.setdefault(key, ([], 0.0))
                    results[key] = (results[key][0] + times, max(results[key][1], float(m.group(1)) if m else rss))
            print(f"round {r + 1}/{a.rounds} done", file=sys.stderr, flush=True)
    mem_label = "peak CUDA MB" if a.device.startswith("cuda") else "peak RSS MB"
    for model in a.models.split(","):
        spec = MODELS[model]
        print(f"\n### {model}: batch {spec['batch']}, input {spec['shape']}, Adam, {a.steps} steps/epoch, "
              f"{a.rounds} rounds x {a.epochs - 1} timed epochs, device {a.device}, {a.threads} thread(s)\n")
        print(f"| variant | best ms/step | steps/s | vs Ember fp32 (speed) | {mem_label} | vs Ember fp32 (memory) |")
        print("|---|---|---|---|---|---|")
        base_t = min(results[(model, "ember", "fp32")][0]) / a.steps
        base_m = results[(model, "ember", "fp32")][1]
        for impl in ("ember", "pytorch"):
            for prec in PRECISIONS:
                times, mem = results[(model, impl, prec)]
                t = min(times) / a.steps
                print(f"| {'Ember' if impl == 'ember' else 'PyTorch'} {prec} | {t * 1000:.1f} | {1 / t:.1f} | "
                      f"{base_t / t:.2f}x | {mem:.0f} | {mem / base_m:.2f}x |")


if __name__ == "__main__":
    main()
