"""The character-level GPT of configs/austen_char_gpt.toml in plain PyTorch and in PyTorch
Lightning, for bench/lm_char.sh: the same model (nanoGPT's GPT-2 layout: pre-norm blocks, LayerNorm
without bias, GELU (tanh) MLP, tied embeddings, no biases), the same initialisation rule, data
(characters of the corpus in code point order, the last 10% for validation, random training
windows, 20 disjoint validation batches), optimizer (AdamW 1e-3, betas (0.9, 0.99), weight decay
0.1 on the matrices and embeddings, none on the LayerNorm scales: nanoGPT's groups, as the config's
`no_weight_decay_1d`), schedule (100 warmup steps from 1% of
the rate, then cosine to 1e-4), clipping (1.0) and evaluation cadence (every 250 steps).

  lm_char.py pytorch|lightning CORPUS_DIR STEPS THREADS OUT_JSON [SEED=0]

OUT_JSON: {"variant", "wall_s", "train_tokens", "evals": [[step, val_loss, elapsed_s], ...]}
"""
import json
import math
import pathlib
import sys
import time

import torch

import gpt_reference

BLOCK, BATCH, LAYERS, HEADS, WIDTH = 64, 12, 4, 4, 128
LR, MIN_LR, WARMUP, EVAL_EVERY, EVAL_BATCHES = 1e-3, 1e-4, 100, 250, 20


def Gpt(vocab):
    return gpt_reference.Gpt(vocab, BLOCK, LAYERS, HEADS, WIDTH)


def load(corpus):
    files = sorted(p for p in pathlib.Path(corpus).rglob("*") if p.is_file() and not p.name.startswith("."))
    text = "".join(p.read_text(encoding="utf-8") for p in files)
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text], dtype=torch.long)
    n_val = int(len(data) * 0.1)
    return len(chars), data[: len(data) - n_val], data[len(data) - n_val :]


def windows(data, starts):
    x = torch.stack([data[s : s + BLOCK] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + 1 + BLOCK] for s in starts.tolist()])
    return x, y


def lr_at(step, steps):
    if step < WARMUP:
        return LR * (0.01 + 0.99 * step / WARMUP)
    return MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (steps - WARMUP)))


def val_batches(val):
    starts = torch.arange(0, EVAL_BATCHES * BATCH) * BLOCK
    return [windows(val, starts[i * BATCH : (i + 1) * BATCH]) for i in range(EVAL_BATCHES)]


def run_pytorch(vocab, train, val, steps, seed):
    torch.manual_seed(seed)
    model = Gpt(vocab)
    opt = torch.optim.AdamW(gpt_reference.decay_groups(model, 0.1), lr=LR, betas=(0.9, 0.99))
    evals, vb = [], val_batches(val)
    start = time.perf_counter()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps)
        x, y = windows(train, torch.randint(len(train) - BLOCK, (BATCH,)))
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % EVAL_EVERY == 0:
            model.eval()
            with torch.no_grad():
                v = sum(model(bx, by).item() for bx, by in vb) / len(vb)
            model.train()
            evals.append([step, v, time.perf_counter() - start])
    return evals, time.perf_counter() - start


def run_lightning(vocab, train, val, steps, seed):
    import lightning as L
    from torch.utils.data import DataLoader, Dataset

    class Windows(Dataset):
        def __init__(self, data, stride, count):
            self.data, self.stride, self.count = data, stride, count

        def __len__(self):
            return self.count

        def __getitem__(self, i):
            s = i * self.stride
            return self.data[s : s + BLOCK], self.data[s + 1 : s + 1 + BLOCK]

    evals = []

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = Gpt(vocab)
            self.val_sum, self.val_n = 0.0, 0

        def training_step(self, batch, _):
            loss = self.model(*batch)
            self.log("train_loss", loss, on_step=True, on_epoch=True)
            return loss

        def validation_step(self, batch, _):
            loss = self.model(*batch)
            self.log("val_loss", loss)
            self.val_sum, self.val_n = self.val_sum + loss.item(), self.val_n + 1

        def on_validation_epoch_end(self):
            evals.append([self.global_step - 1, self.val_sum / self.val_n, time.perf_counter() - start])
            self.val_sum, self.val_n = 0.0, 0

        def configure_optimizers(self):
            opt = torch.optim.AdamW(gpt_reference.decay_groups(self, 0.1), lr=LR, betas=(0.9, 0.99))
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, steps) / LR)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    torch.manual_seed(seed)
    module = Module()
    trainer = L.Trainer(max_steps=steps, val_check_interval=EVAL_EVERY, limit_val_batches=EVAL_BATCHES, check_val_every_n_epoch=None,
                        num_sanity_val_steps=0, gradient_clip_val=1.0, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", devices=1, default_root_dir=str(pathlib.Path(sys.argv[5]).parent / "lightning_logs"))
    train_loader = DataLoader(Windows(train, 1, len(train) - BLOCK), batch_size=BATCH, shuffle=True)
    val_loader = DataLoader(Windows(val, BLOCK, EVAL_BATCHES * BATCH), batch_size=BATCH)
    start = time.perf_counter()
    trainer.fit(module, train_loader, val_loader)
    return evals, time.perf_counter() - start


if __name__ == "__main__":
    variant, corpus, steps, threads, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    seed = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    torch.set_num_threads(threads)
    vocab, train, val = load(corpus)
    evals, wall = (run_pytorch if variant == "pytorch" else run_lightning)(vocab, train, val, steps, seed)
    json.dump({"variant": variant, "seed": seed, "wall_s": wall, "train_tokens": steps * BATCH * BLOCK, "evals": evals}, open(out, "w"))
