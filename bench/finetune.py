"""bench/finetune.sh's driver and its Python side: configs/fine_foods_minilm.toml's fine-tune run by
Ember and by Hugging Face transformers + PyTorch Lightning, side by side, on the same LibTorch wheel.

Alike on both sides:
  - weights: one model folder made for the run (<work>/model): all-MiniLM-L6-v2's config,
    vocabulary and encoder weights plus a classification head drawn once (normal(0, 0.02) weights,
    zero bias, as models/bert initialises a fresh head), so both sides start from the same tensors;
  - tokens: the folder's tokenizer.json through the `tokenizers` package (truncation to
    max_length, no padding) on the Python side, Ember's WordPiece on the other (identical ids:
    tests/wordpiece_test.cpp); each batch padded to its longest text, with an attention mask;
  - splits and order: the 4,000 training reviews split 3,600 train / 400 val by a randperm seeded
    with trainer.seed (text_classification's rule), train order per epoch from Ember's shuffle
    (randperm seeded with seed * 1000003 + epoch + 1), the last short batch kept; with
    --group-by-length, Ember's data.group_by_length and, on the Python side, transformers'
    get_length_grouped_indices (what a Trainer with group_by_length uses) on that same generator;
  - model: BertModel (AutoModel of the folder, no pooler, sdpa attention) -> mean over real tokens
    -> dropout(0.1) -> linear, i.e. models/bert with pooling = "mean" (which by default, unpad =
    auto, leaves the padding out of its per-token work where BertModel computes it: --ember-unpad
    false makes Ember compute it too);
  - optimizer: AdamW(lr, weight_decay, betas 0.9/0.999, eps 1e-8) in two groups, Hugging Face
    Trainer's: biases and LayerNorm weights without weight decay, the rest with it (the config's
    `optimizer.no_weight_decay = ["bias", "LayerNorm.weight"]`; 40 tensors decay, 63 do not);
    PyTorch's default AdamW implementation (foreach) against Ember's default (ATen's fused kernel);
  - schedule: linear warmup from warmup_start_factor over `warmup` steps, then cosine to 0 over the
    run's optimizer steps (the `cosine` plugin's formula), stepped after every optimizer step;
  - gradient clipping by norm 1.0, cross-entropy on float32 logits, validation on the val split
    after each epoch with a checkpoint of the best val_acc, then one test pass over the test split
    with that checkpoint's weights (the config's test_after_fit, test_ckpt = "best");
  - each framework's defaults otherwise: progress output on, model summary on, a CSV logger
    (log_every_n_steps = 10 on the Lightning side; Ember logs every step, as its throughput
    callback needs), no sanity-check batches, intra-op threads as LibTorch picks.

Training samples/s (steady state) is measured the same way on both sides, by Ember's `throughput`
callback with window_size = 1 and by the TrainRate callback below, which copies it: one interval per
training batch, from the end of the previous batch (or, for an epoch's first batch, from its start)
to the end of this one, after the optimizer step; validation is outside every interval. The rate is
the samples of the batches after the first `warmup_batches` over the sum of their intervals.

    python finetune.py bench --engine ENGINE --work DIR [--epochs N] [--limit-train-batches N]
                       [--max-length N] [--precisions 32-true,bf16-mixed] [--throughput-only-limit N]
                       [--group-by-length]
    python finetune.py lightning SPEC.json        (one side; bench runs it)
"""
import argparse
import csv
import glob
import json
import math
import os
import resource
import subprocess
import sys
import time

CACHE = os.environ.get("EMBER_CACHE", os.path.expanduser("~/.cache/ember"))
CONFIG = "configs/fine_foods_minilm.toml"
ASSET_FILES = ("config.json", "vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def read_jsonl(path, text_col, label_col):
    texts, labels = [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                texts.append(row[text_col])
                labels.append(str(row[label_col]))
    return texts, labels


def epoch_order(n, seed, epoch, lengths=None, batch_size=None):
    """Ember's shuffle (engine/src/data/data_loader.cpp); with lengths, its length grouping, which is
    transformers' get_length_grouped_indices on the same generator."""
    import torch
    g = torch.Generator().manual_seed(seed * 1000003 + epoch + 1)
    if lengths is not None:
        from transformers.trainer_pt_utils import get_length_grouped_indices
        return get_length_grouped_indices(lengths, batch_size, generator=g)
    return torch.randperm(n, generator=g).tolist()


def lr_factor(step, warmup, total, start_factor):
    """The cosine plugin's closed form (sdk/support/include/ember/support/lr_schedule.h), eta_min 0."""
    if step < warmup:
        return start_factor + (1.0 - start_factor) * step / warmup
    span = total - warmup
    if span <= 0:
        return 1.0
    return (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / span))) / 2.0


def steady_rate(intervals, warmup_batches):
    """intervals: [(samples, seconds)] per training batch, in order. Samples/s after the warm-up."""
    rest = intervals[warmup_batches:]
    seconds = sum(s for _, s in rest)
    if not rest or seconds <= 0:
        raise SystemExit(f"finetune: only {len(intervals)} timed training batch(es), {warmup_batches} of them warm-up: "
                         "nothing left to measure (raise --limit-train-batches or lower --warmup-batches)")
    return sum(n for n, _ in rest) / seconds, len(rest)


# ---- the Lightning side ---------------------------------------------------------------------------

def lightning_side(spec):
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from safetensors.torch import load_file
    from tokenizers import Tokenizer
    from transformers import AutoModel

    seed, bs = spec["seed"], spec["batch_size"]
    model_dir = spec["model_dir"]
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(spec["max_length"])

    texts, names = read_jsonl(spec["train_file"], "review", "score")
    labels_sorted = sorted(set(names))
    label_id = {n: i for i, n in enumerate(labels_sorted)}
    ids = [e.ids for e in tok.encode_batch(texts)]
    y = [label_id[n] for n in names]
    n_val = min(len(ids) - 1, round(spec["val_split"] * len(ids)))
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed)).tolist()
    val = ([ids[i] for i in perm[:n_val]], [y[i] for i in perm[:n_val]])
    train = ([ids[i] for i in perm[n_val:]], [y[i] for i in perm[n_val:]])
    test_texts, test_names = read_jsonl(spec["test_file"], "review", "score")
    test = ([e.ids for e in tok.encode_batch(test_texts)], [label_id[n] for n in test_names])

    def collate(seqs, labels):
        longest = max(len(s) for s in seqs)
        x = torch.zeros(len(seqs), longest, dtype=torch.long)  # [PAD] is id 0
        mask = torch.zeros(len(seqs), longest, dtype=torch.long)
        for i, s in enumerate(seqs):
            x[i, :len(s)] = torch.tensor(s)
            mask[i, :len(s)] = 1
        return x, mask, torch.tensor(labels)

    class Batches(torch.utils.data.Dataset):
        """Whole batches, padded to their longest text, in Ember's order."""

        def __init__(self, split, shuffle):
            self.seqs, self.labels = split
            self.shuffle = shuffle
            self.order = list(range(len(self.seqs)))

        def set_epoch(self, epoch):
            if self.shuffle:
                lengths = [len(q) for q in self.seqs] if spec.get("group_by_length") else None
                self.order = epoch_order(len(self.seqs), seed, epoch, lengths, bs)

        def __len__(self):
            return (len(self.seqs) + bs - 1) // bs

        def __getitem__(self, b):
            idx = self.order[b * bs:(b + 1) * bs]
            return collate([self.seqs[i] for i in idx], [self.labels[i] for i in idx])

    train_ds, val_ds, test_ds = Batches(train, True), Batches(val, False), Batches(test, False)
    limit = spec["limit_train_batches"] or len(train_ds)
    steps = spec["epochs"] * min(limit, len(train_ds))
    head = load_file(os.path.join(model_dir, "model.safetensors"))

    class Classifier(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.encoder = AutoModel.from_pretrained(model_dir, add_pooling_layer=False, attn_implementation="sdpa")
            self.encoder.train()  # from_pretrained returns it in eval mode (dropout off), and Lightning keeps modes
            self.dropout = torch.nn.Dropout(0.1)
            self.classifier = torch.nn.Linear(self.encoder.config.hidden_size, len(labels_sorted))
            with torch.no_grad():
                self.classifier.weight.copy_(head["classifier.weight"])
                self.classifier.bias.copy_(head["classifier.bias"])

        def forward(self, x, mask):
            h = self.encoder(input_ids=x, attention_mask=mask).last_hidden_state
            m = mask.unsqueeze(-1).to(h.dtype)
            pooled = (h * m).sum(1) / m.sum(1).clamp_min(1e-9)
            return self.classifier(self.dropout(pooled))

        def _step(self, batch, phase):
            x, mask, yb = batch
            logits = self(x, mask)
            loss = F.cross_entropy(logits.float(), yb)
            self.log(f"{phase}_loss", loss, prog_bar=True, batch_size=len(yb))
            self.log(f"{phase}_acc", (logits.argmax(1) == yb).float().mean(), prog_bar=True, batch_size=len(yb))
            return loss

        def training_step(self, batch, _):
            return self._step(batch, "train")

        def validation_step(self, batch, _):
            self._step(batch, "val")

        def test_step(self, batch, _):
            self._step(batch, "test")

        def configure_optimizers(self):
            # Hugging Face Trainer's groups, as the config's optimizer.no_weight_decay sets them.
            named = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
            undecayed = [p for n, p in named if n.endswith(".bias") or n.endswith("LayerNorm.weight")]
            decayed = [p for n, p in named if not (n.endswith(".bias") or n.endswith("LayerNorm.weight"))]
            if (len(decayed), len(undecayed)) != (40, 63):
                raise SystemExit(f"finetune: {len(decayed)} decayed / {len(undecayed)} undecayed tensors, Ember has 40 / 63")
            opt = torch.optim.AdamW([{"params": decayed, "weight_decay": spec["weight_decay"]},
                                     {"params": undecayed, "weight_decay": 0.0}], lr=spec["lr"])
            sched = torch.optim.lr_scheduler.LambdaLR(
                opt, lambda t: lr_factor(t, spec["warmup"], steps, spec["warmup_start_factor"]))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class TrainRate(pl.Callback):
        """Ember's throughput callback with window_size = 1 (see the module's docstring)."""

        def __init__(self):
            self.intervals, self.last = [], None

        def on_train_epoch_start(self, trainer, module):
            train_ds.set_epoch(trainer.current_epoch)
            self.last = None

        def on_train_batch_start(self, trainer, module, batch, i):
            if self.last is None:
                self.last = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, i):
            now = time.perf_counter()
            self.intervals.append((len(batch[2]), now - self.last))
            self.last = now

    torch.manual_seed(seed)
    rate = TrainRate()
    loader = lambda ds: torch.utils.data.DataLoader(ds, batch_size=None, shuffle=False)  # noqa: E731
    trainer = pl.Trainer(max_epochs=spec["epochs"], accelerator="cpu", devices=1, precision=spec["precision"],
                         gradient_clip_val=1.0, log_every_n_steps=10, num_sanity_val_steps=0,
                         callbacks=[rate, ModelCheckpoint(monitor="val_acc", mode="max")],
                         logger=CSVLogger(spec["run_dir"], name="lightning"), default_root_dir=spec["run_dir"],
                         limit_train_batches=spec["limit_train_batches"] or None,
                         limit_val_batches=spec["limit_eval_batches"] if spec["limit_eval_batches"] >= 0 else None,
                         limit_test_batches=spec["limit_eval_batches"] if spec["limit_eval_batches"] > 0 else None)
    module = Classifier()
    trainer.fit(module, loader(train_ds), loader(val_ds))
    test_acc = None
    if spec["limit_eval_batches"] != 0:
        result = trainer.test(module, loader(test_ds), ckpt_path="best", verbose=False)
        test_acc = result[0]["test_acc"]
    sps, timed = steady_rate(rate.intervals, spec["warmup_batches"])
    print("RESULT " + json.dumps({"samples_per_sec": sps, "timed_batches": timed, "batches": len(rate.intervals),
                                  "test_acc": test_acc}), flush=True)


# ---- the Ember side: its run folder's metrics.csv -------------------------------------------------

def ember_results(run_root, warmup_batches):
    files = glob.glob(os.path.join(run_root, "**", "metrics.csv"), recursive=True)
    if len(files) != 1:
        raise SystemExit(f"finetune: expected one metrics.csv under {run_root}, found {len(files)}")
    intervals, test_acc = [], None
    with open(files[0], newline="") as f:
        for row in csv.DictReader(f):
            bps, sps = row.get("train|batches_per_sec", ""), row.get("train|samples_per_sec", "")
            if bps and sps:
                seconds = 1.0 / float(bps)
                intervals.append((float(sps) * seconds, seconds))
            if row.get("test_acc"):
                test_acc = float(row["test_acc"])
    if not intervals:
        raise SystemExit(f"finetune: {files[0]} holds no train|samples_per_sec: did the throughput callback run?")
    sps, timed = steady_rate(intervals, warmup_batches)
    return {"samples_per_sec": sps, "timed_batches": timed, "batches": len(intervals), "test_acc": test_acc}


# ---- the driver -----------------------------------------------------------------------------------

def make_model_dir(work, seed):
    """all-MiniLM-L6-v2's folder plus one classification head, the starting point of both sides."""
    import torch
    from safetensors.torch import load_file, save_file

    src = os.path.join(CACHE, "all-minilm-l6-v2")
    if not os.path.isfile(os.path.join(src, "model.safetensors")):
        raise SystemExit(f"finetune: {src}/model.safetensors not found: run scripts/setup.sh (installs all-MiniLM-L6-v2)")
    dst = os.path.join(work, "model")
    os.makedirs(dst, exist_ok=True)
    for name in ASSET_FILES:
        os.symlink(os.path.join(src, name), os.path.join(dst, name))
    tensors = load_file(os.path.join(src, "model.safetensors"))
    if any(k.startswith("classifier.") for k in tensors):
        raise SystemExit(f"finetune: {src}/model.safetensors already has a classifier: expected a bare encoder")
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    g = torch.Generator().manual_seed(seed)
    tensors["classifier.weight"] = torch.randn(2, cfg["hidden_size"], generator=g) * cfg["initializer_range"]
    tensors["classifier.bias"] = torch.zeros(2)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def run_timed(argv, log_path):
    """Runs argv with its output in log_path; returns (exit code, wall seconds, peak RSS MB)."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, time.perf_counter() - t0, usage.ru_maxrss / 1024.0


def fail(side, log_path, why):
    with open(log_path, errors="replace") as f:
        tail = f.readlines()[-25:]
    sys.stderr.write(f"--- last lines of {log_path} ---\n" + "".join(tail))
    raise SystemExit(f"finetune: the {side} side failed: {why}")


def bench(args):
    work = os.path.abspath(args.work)
    model_dir = make_model_dir(work, args.seed)
    train_file = os.path.join(CACHE, "small_fine_foods", "train.jsonl")
    test_file = os.path.join(CACHE, "small_fine_foods", "test.jsonl")
    for f in (train_file, test_file):
        if not os.path.isfile(f):
            raise SystemExit(f"finetune: {f} not found: run scripts/setup.sh (installs small_fine_foods)")
    n_train = 4000 - round(0.1 * 4000)
    batches = math.ceil(n_train / args.batch_size)
    rows = []
    for precision in args.precisions:
        throughput_only = precision != "32-true" and args.throughput_only_limit > 0
        limit = args.throughput_only_limit if throughput_only else args.limit_train_batches
        epochs = 1 if throughput_only else args.epochs
        per_epoch = min(limit, batches) if limit else batches
        total = epochs * per_epoch
        warmup = max(1, round(0.1 * total))
        if total <= args.warmup_batches:
            raise SystemExit(f"finetune: {total} training batches for {precision}, {args.warmup_batches} of them warm-up: "
                             "raise the batch limit")
        # Throughput-only runs skip evaluation: their accuracy after a few steps says nothing.
        limit_eval = 0 if throughput_only else args.limit_eval_batches
        spec = {"seed": args.seed, "batch_size": args.batch_size, "max_length": args.max_length, "model_dir": model_dir,
                "train_file": train_file, "test_file": test_file, "val_split": 0.1, "epochs": epochs,
                "limit_train_batches": limit, "limit_eval_batches": limit_eval, "lr": args.lr,
                "weight_decay": args.weight_decay, "warmup": warmup, "warmup_start_factor": 0.01,
                "precision": precision, "warmup_batches": args.warmup_batches, "group_by_length": args.group_by_length}
        tag = precision.replace("-", "_")
        results = {}
        for side in ("ember", "lightning"):
            run_dir = os.path.join(work, f"{side}_{tag}")
            os.makedirs(run_dir)
            log_path = run_dir + ".log"
            if side == "ember":
                argv = [args.engine, CONFIG, "--plugins", "throughput"]
                sets = {"trainer.default_root_dir": json.dumps(run_dir), "trainer.precision": json.dumps(precision),
                        "trainer.max_epochs": epochs, "trainer.limit_train_batches": limit if limit else 1.0,
                        "trainer.num_sanity_val_steps": 0,
                        "trainer.log_every_n_steps": 1, "trainer.seed": args.seed,
                        "trainer.test_after_fit": "false" if throughput_only else "true",
                        "model.model_dir": json.dumps(model_dir), "data.tokenizer_dir": json.dumps(model_dir),
                        "data.train_file": json.dumps(train_file), "data.test_file": json.dumps(test_file),
                        "data.max_length": args.max_length, "data.batch_size": args.batch_size,
                        "optimizer.lr": args.lr, "optimizer.weight_decay": args.weight_decay,
                        "cosine.warmup": warmup, "cosine.warmup_start_factor": 0.01,
                        "throughput.window_size": 1, "data.group_by_length": "true" if args.group_by_length else "false",
                        "model.unpad": json.dumps(args.ember_unpad)}
                if limit_eval >= 0:
                    sets["trainer.limit_val_batches"] = limit_eval
                    sets["trainer.limit_test_batches"] = max(limit_eval, 1)
                for k, v in sets.items():
                    argv += ["--set", f"{k}={v}"]
            else:
                spec_path = run_dir + ".json"
                with open(spec_path, "w") as f:
                    json.dump(dict(spec, run_dir=run_dir), f)
                argv = [sys.executable, os.path.abspath(__file__), "lightning", spec_path]
            print(f"  {precision:10s} {side:9s} ({total} training batches{', throughput only' if throughput_only else ''}) ...",
                  file=sys.stderr, flush=True)
            code, wall, rss = run_timed(argv, log_path)
            if code != 0:
                fail(side, log_path, f"exit code {code}")
            if side == "ember":
                r = ember_results(run_dir, args.warmup_batches)
            else:
                with open(log_path, errors="replace") as f:
                    lines = [l for l in f if l.startswith("RESULT ")]
                if not lines:
                    fail(side, log_path, "no RESULT line")
                r = json.loads(lines[-1][len("RESULT "):])
            if not throughput_only and r["test_acc"] is None:
                fail(side, log_path, "no test accuracy: the accuracy comparison is impossible")
            r.update(wall_s=wall, peak_rss_mb=rss, throughput_only=throughput_only, total_batches=total)
            results[side] = r
        rows.append((precision, results))

    print("batches: " + ("grouped by length (both sides)" if args.group_by_length else "shuffled, padded to their longest text") +
          f"; Ember's bert.unpad = {args.ember_unpad} (transformers' BertModel computes the padding)")
    print(f"{'precision':12s} {'side':10s} {'samples/s':>10s} {'timed batches':>14s} {'test acc':>9s} "
          f"{'peak RSS':>10s} {'wall':>9s}")
    ok = True
    for precision, results in rows:
        for side in ("ember", "lightning"):
            r = results[side]
            acc = "n/a" if r["test_acc"] is None else f"{r['test_acc']:.4f}"
            print(f"{precision:12s} {side:10s} {r['samples_per_sec']:10.2f} {r['timed_batches']:>6d} of {r['batches']:<5d} "
                  f"{acc:>9s} {r['peak_rss_mb']:7.0f} MB {r['wall_s']:7.1f} s")
        e, l = results["ember"], results["lightning"]
        line = (f"{precision:12s} Ember / Lightning: samples/s {e['samples_per_sec'] / l['samples_per_sec']:.2f}x, "
                f"peak RSS {e['peak_rss_mb'] / l['peak_rss_mb']:.2f}x, wall {e['wall_s'] / l['wall_s']:.2f}x")
        if e["throughput_only"]:
            line += f" (throughput only: {e['total_batches']} training batches, no evaluation)"
        else:
            diff = (e["test_acc"] - l["test_acc"]) * 100
            line += f", test accuracy {diff:+.1f} points"
            if abs(diff) > 1.0:
                ok = False
        print(line)
    if not ok:
        print("note: the test accuracies differ by more than 1 point (dropout draws differ between the sides; "
              "a short run is noisy)")


def main():
    which = sys.argv[1] if len(sys.argv) > 1 else ""
    if which == "lightning" and len(sys.argv) == 3:
        with open(sys.argv[2]) as f:
            lightning_side(json.load(f))
        return
    if which != "bench":
        raise SystemExit(__doc__)
    p = argparse.ArgumentParser(prog="finetune.py bench")
    p.add_argument("--engine", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--limit-train-batches", type=int, default=0, help="training batches per epoch; 0 = all (113)")
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precisions", default="32-true,bf16-mixed")
    p.add_argument("--throughput-only-limit", type=int, default=4,
                   help="precisions other than 32-true train this many batches, one epoch, no evaluation; 0 = as 32-true")
    p.add_argument("--limit-eval-batches", type=int, default=-1, help="val and test batches; -1 = all")
    p.add_argument("--warmup-batches", type=int, default=2, help="first training batches left out of samples/s")
    p.add_argument("--ember-unpad", default="auto", choices=("auto", "true", "false"),
                   help="Ember's bert.unpad: leave the padding out of the encoder's per-token work (default auto, as configured)")
    p.add_argument("--group-by-length", action="store_true",
                   help="batch texts of similar length on both sides (Ember: data.group_by_length; Python: transformers' grouping)")
    args = p.parse_args(sys.argv[2:])
    args.precisions = [s for s in args.precisions.split(",") if s]
    bench(args)


if __name__ == "__main__":
    main()
