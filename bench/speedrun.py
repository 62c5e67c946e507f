"""The Python sides of bench/speedrun.sh: configs/fashion_mnist_speedrun.toml's recipe in plain
PyTorch and in PyTorch Lightning, on the same LibTorch wheel Ember is built against.

The same network (models/cnn's `speedrun` architecture), data (the Debian package's idx files,
all 60,000 training images, normalized with the same mean/std), data order (Ember's shuffle:
randperm seeded with seed * 1000003 + epoch + 1), augmentation (horizontal flip, random crop with
padding), optimizer (SGD, Nesterov momentum, weight decay), schedule (OneCycleLR per step), loss
(cross-entropy with label smoothing) and evaluation (test accuracy after every epoch).

Prints "epoch <i> <seconds of epochs so far> <test acc> <elapsed since training started>" per
epoch (an epoch's time includes its evaluation) and a final "summary" line with samples/s (over
the epochs' time, evaluation included, the same for every side) and peak RSS.

    python speedrun.py {torch|lightning} <config.toml> [device]
    python speedrun.py ember <config.toml> <engine> [engine args...]   (the engine, timed the same way)

Each side uses its framework's defaults where the recipe does not say otherwise:
  - torch: torch.get_num_threads() intra-op threads (PyTorch picks the physical cores), no
    DataLoader workers (batches are index_select on in-memory tensors, as in Ember), fp32,
    contiguous (NCHW) memory format, denormals not flushed, torch.optim.SGD's default
    (foreach) implementation.
  - lightning: Trainer(max_epochs, accelerator="auto") with Lightning's defaults (progress bar,
    model summary, checkpointing and the CSV/TensorBoard logger as installed, sanity check of 2
    val batches), validation on the test split every epoch.
"""
import gzip
import os
import resource
import sys
import time
import tomllib

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

MEAN, STD = 0.2860, 0.3530


def process_seconds():
    """Seconds since this process started (interpreter start-up and imports included)."""
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
# Smoke test of the bench itself: at most this many training batches per epoch, and one
# evaluation batch (all sides).
LIMIT = int(os.environ.get("SPEEDRUN_LIMIT_BATCHES", "0")) or None


def load_idx(root, images, labels):
    with gzip.open(os.path.join(root, images)) as f:
        x = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 1, 28, 28)
    with gzip.open(os.path.join(root, labels)) as f:
        y = np.frombuffer(f.read(), np.uint8, offset=8)
    x = (torch.from_numpy(x.copy()).float() / 255.0 - MEAN) / STD
    return x, torch.from_numpy(y.astype(np.int64))


class SpeedrunNet(nn.Module):
    """models/cnn with architecture = "speedrun": five 3x3 conv + batch-norm + ReLU layers
    (widths w, 2w, 2w, 4w, 4w; max-pool after the 2nd and 4th), global max-pool, linear head."""

    def __init__(self, w, classes=10):
        super().__init__()
        widths = [1, w, 2 * w, 2 * w, 4 * w, 4 * w]
        self.convs = nn.ModuleList(nn.Conv2d(widths[i], widths[i + 1], 3, padding=1, bias=False) for i in range(5))
        self.bns = nn.ModuleList(nn.BatchNorm2d(widths[i + 1]) for i in range(5))
        self.fc = nn.Linear(4 * w, classes)

    def forward(self, x):
        for i in range(5):
            x = F.relu(self.bns[i](self.convs[i](x)))
            if i in (1, 3):
                x = F.max_pool2d(x, 2)
        return self.fc(torch.amax(x, dim=(2, 3)))


def augment(x, pad, flip, gen):
    """Per-sample horizontal flip and random crop after padding with the value of a black pixel."""
    n, _, h, w = x.shape
    if flip:
        mask = torch.rand(n, generator=gen) < 0.5
        x = torch.where(mask.view(n, 1, 1, 1).to(x.device), x.flip(3), x)
    if pad > 0:
        padded = F.pad(x, (pad, pad, pad, pad), value=(0.0 - MEAN) / STD)
        oy = torch.randint(0, 2 * pad + 1, (n,), generator=gen).to(x.device)
        ox = torch.randint(0, 2 * pad + 1, (n,), generator=gen).to(x.device)
        rows = (oy.view(n, 1) + torch.arange(h, device=x.device)).view(n, 1, h, 1).expand(n, x.size(1), h, w + 2 * pad)
        x = padded.gather(2, rows)
        cols = (ox.view(n, 1) + torch.arange(w, device=x.device)).view(n, 1, 1, w).expand(n, x.size(1), h, w)
        x = x.gather(3, cols)
    return x


class Recipe:
    def __init__(self, path):
        with open(path, "rb") as f:
            cfg = tomllib.load(f)
        t, m, d, o, s = cfg["trainer"], cfg["model"], cfg["data"], cfg["optimizer"], cfg["one_cycle"]
        self.epochs = t["max_epochs"]
        self.precision = str(t.get("precision", "32-true"))
        self.channels_last = t.get("channels_last", False)
        self.seed = t.get("seed", 0)
        self.width = m.get("width", 16)
        self.label_smoothing = m.get("label_smoothing", 0.0)
        self.batch_size = d["batch_size"]
        self.eval_batch_size = d.get("eval_batch_size", self.batch_size)
        self.flip = d.get("augment_flip", False)
        self.pad = d.get("augment_crop_padding", 0)
        self.lr = o["lr"]
        self.momentum = o.get("momentum", 0.0)
        self.nesterov = o.get("nesterov", False)
        self.weight_decay = o.get("weight_decay", 0.0)
        self.max_lr = s["max_lr"]
        self.pct_start = s.get("pct_start", 0.3)
        self.div_factor = s.get("div_factor", 25.0)
        self.final_div_factor = s.get("final_div_factor", 1e4)
        self.cycle_momentum = s.get("cycle_momentum", True)
        self.base_momentum = s.get("base_momentum", 0.85)
        self.max_momentum = s.get("max_momentum", 0.95)
        self.root = d.get("root", "/usr/share/datasets/fashion-mnist")

    def train_samples(self):
        return 60000

    def optimizer(self, params, total_steps):
        opt = torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, nesterov=self.nesterov,
                              weight_decay=self.weight_decay)
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=self.max_lr, total_steps=total_steps, pct_start=self.pct_start, div_factor=self.div_factor,
            final_div_factor=self.final_div_factor, cycle_momentum=self.cycle_momentum,
            base_momentum=self.base_momentum, max_momentum=self.max_momentum)
        return opt, sched


def epoch_order(n, seed, epoch):
    """Ember's shuffle (engine/src/data/data_loader.cpp)."""
    g = torch.Generator().manual_seed(seed * 1000003 + epoch + 1)
    return torch.randperm(n, generator=g)


def autocast_dtype(r, device):
    """trainer.precision: "bf16-mixed" and "16-mixed" autocast the forward; "auto" follows Ember's
    rule (bf16 on GPUs of compute capability >= 8 and on CPUs with AVX512-BF16/AMX, else fp32)."""
    p = r.precision
    if p == "auto":
        if device.startswith("cuda"):
            p = "bf16-mixed" if torch.cuda.get_device_capability()[0] >= 8 else "16-mixed"
        else:
            with open("/proc/cpuinfo") as f:
                flags = next((l.split(":", 1)[1].split() for l in f if l.startswith("flags")), [])
            p = "bf16-mixed" if {"avx512_bf16", "amx_bf16"} & set(flags) else "32-true"
    return {"bf16-mixed": torch.bfloat16, "bf16": torch.bfloat16, "16-mixed": torch.float16}.get(p)


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def plain(r, device):
    torch.manual_seed(r.seed)
    x, y = load_idx(r.root, "train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz")
    tx, ty = load_idx(r.root, "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
    x, y, tx, ty = x.to(device), y.to(device), tx.to(device), ty.to(device)
    net = SpeedrunNet(r.width).to(device)
    fmt = torch.channels_last if r.channels_last else torch.contiguous_format
    net = net.to(memory_format=fmt)
    dtype = autocast_dtype(r, device)
    autocast = lambda: torch.autocast(device.split(":")[0], dtype=dtype, enabled=dtype is not None)  # noqa: E731
    steps_per_epoch = (len(x) + r.batch_size - 1) // r.batch_size
    opt, sched = r.optimizer(net.parameters(), r.epochs * steps_per_epoch)
    gen = torch.Generator().manual_seed(r.seed + 1)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    start = time.perf_counter()
    samples = 0
    train_time = 0.0
    for epoch in range(r.epochs):
        t0 = time.perf_counter()
        net.train()
        order = epoch_order(len(x), r.seed, epoch).to(device)
        for b in range(min(steps_per_epoch, LIMIT or steps_per_epoch)):
            idx = order[b * r.batch_size:(b + 1) * r.batch_size]
            xb = augment(x.index_select(0, idx), r.pad, r.flip, gen).contiguous(memory_format=fmt)
            with autocast():
                logits = net(xb)
            loss = F.cross_entropy(logits.float(), y.index_select(0, idx), label_smoothing=r.label_smoothing)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            samples += len(idx)
        net.eval()
        correct = 0
        with torch.no_grad():
            for b in range(0, r.eval_batch_size if LIMIT else len(tx), r.eval_batch_size):
                with autocast():
                    logits = net(tx[b:b + r.eval_batch_size].contiguous(memory_format=fmt))
                correct += (logits.argmax(1) == ty[b:b + r.eval_batch_size]).sum().item()
        train_time += time.perf_counter() - t0
        print(f"epoch {epoch} {train_time:.2f} {correct / (r.eval_batch_size if LIMIT else len(tx)):.4f} "
              f"{time.perf_counter() - start:.2f}", flush=True)
    print(f"summary samples_per_sec {samples / train_time:.1f} peak_rss_mb {peak_rss_mb():.0f}"
          + (f" peak_cuda_mb {torch.cuda.max_memory_allocated() / 2**20:.0f}" if device.startswith("cuda") else "")
          + f" process_s {process_seconds():.1f}", flush=True)


def lightning(r, device):
    import lightning.pytorch as pl

    class Batches(torch.utils.data.Dataset):
        """Whole batches by index_select on in-memory tensors, in Ember's order."""

        def __init__(self, x, y, bs, shuffle):
            self.x, self.y, self.bs, self.shuffle, self.epoch = x, y, bs, shuffle, 0
            self.order = torch.arange(len(x))

        def set_epoch(self, epoch):
            self.order = epoch_order(len(self.x), r.seed, epoch) if self.shuffle else torch.arange(len(self.x))

        def __len__(self):
            return (len(self.x) + self.bs - 1) // self.bs

        def __getitem__(self, b):
            idx = self.order[b * self.bs:(b + 1) * self.bs]
            return self.x[idx], self.y[idx]

    x, y = load_idx(r.root, "train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz")
    tx, ty = load_idx(r.root, "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
    train = Batches(x, y, r.batch_size, True)
    test = Batches(tx, ty, r.eval_batch_size, False)
    steps_per_epoch = len(train)
    gen = torch.Generator().manual_seed(r.seed + 1)
    state = {"start": None, "train_time": 0.0, "samples": 0}

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = SpeedrunNet(r.width)

        def training_step(self, batch, _):
            xb, yb = batch
            loss = F.cross_entropy(self.net(augment(xb, r.pad, r.flip, gen)), yb, label_smoothing=r.label_smoothing)
            self.log("train_loss", loss, prog_bar=True)
            state["samples"] += len(yb)
            return loss

        def validation_step(self, batch, _):
            xb, yb = batch
            self.log("val_acc", (self.net(xb).argmax(1) == yb).float().mean(), prog_bar=True)

        def configure_optimizers(self):
            opt, sched = r.optimizer(self.parameters(), r.epochs * steps_per_epoch)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Timing(pl.Callback):
        def on_train_epoch_start(self, trainer, module):
            train.set_epoch(trainer.current_epoch)
            if state["start"] is None:
                state["start"] = time.perf_counter()
            self.t0 = time.perf_counter()

        def on_validation_epoch_end(self, trainer, module):
            if not trainer.sanity_checking and hasattr(self, "t0"):
                state["train_time"] += time.perf_counter() - self.t0
                del self.t0
                acc = trainer.callback_metrics["val_acc"].item()
                print(f"epoch {trainer.current_epoch} {state['train_time']:.2f} {acc:.4f} "
                      f"{time.perf_counter() - state['start']:.2f}", flush=True)

    torch.manual_seed(r.seed)
    loader = lambda ds: torch.utils.data.DataLoader(ds, batch_size=None, shuffle=False)  # noqa: E731
    trainer = pl.Trainer(max_epochs=r.epochs, accelerator="gpu" if device.startswith("cuda") else "cpu", devices=1,
                         callbacks=[Timing()], default_root_dir=os.environ.get("SPEEDRUN_WORK", "."),
                         limit_train_batches=LIMIT, limit_val_batches=1 if LIMIT else None)
    trainer.fit(Module(), loader(train), loader(test))
    print(f"summary samples_per_sec {state['samples'] / state['train_time']:.1f} peak_rss_mb {peak_rss_mb():.0f}"
          + (f" peak_cuda_mb {torch.cuda.max_memory_allocated() / 2**20:.0f}" if device.startswith("cuda") else "")
          + f" process_s {process_seconds():.1f}", flush=True)


def ember(path, engine_argv):
    """Runs the engine and reads its progress lines: "Validation ... val_acc=X ... (t s)" after every
    epoch and "Epoch i/M ... (t s)" (which includes that validation). Training starts at the "run
    folder" line, logged after the data and model are set up."""
    import re
    import subprocess

    t0 = time.perf_counter()
    if LIMIT:
        engine_argv = engine_argv + ["--set", f"trainer.limit_train_batches={LIMIT}", "--set", "trainer.limit_val_batches=1"]
    proc = subprocess.Popen(engine_argv + [path], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    start = None
    train_time = 0.0
    epoch = 0
    peak_cuda = ""
    tail = []
    for line in proc.stderr:
        tail = (tail + [line])[-20:]
        now = time.perf_counter()
        if start is None and "run folder" in line:
            start = now
        m = re.search(r"peak cuda memory ([0-9.]+) MB", line)
        if m:
            peak_cuda = f" peak_cuda_mb {float(m.group(1)):.0f}"
        m = re.match(r"^Epoch (\d+)/\d+ .*\(([0-9.]+)s\)$", line.strip())
        if m and start is not None:
            train_time += float(m.group(2))
            acc = re.search(r"val_acc=([0-9.]+)", line)
            print(f"epoch {epoch} {train_time:.2f} {float(acc.group(1)) if acc else float('nan'):.4f} {now - start:.2f}",
                  flush=True)
            epoch += 1
    if proc.wait() != 0:
        sys.stderr.write("".join(tail))
        sys.exit(f"engine failed with exit code {proc.returncode}")
    samples = epoch * (LIMIT * Recipe(path).batch_size if LIMIT else Recipe(path).train_samples())
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0
    print(f"summary samples_per_sec {samples / train_time:.1f} peak_rss_mb {rss:.0f}{peak_cuda} "
          f"process_s {time.perf_counter() - t0:.1f}", flush=True)


if __name__ == "__main__":
    which, path = sys.argv[1], sys.argv[2]
    if which == "ember":
        ember(path, sys.argv[3:])
        sys.exit(0)
    device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
    {"torch": plain, "lightning": lightning}[which](Recipe(path), device)
