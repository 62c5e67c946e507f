"""The Python side of bench/overhead.sh: the same CNN and data sizes, trained by a plain PyTorch
loop and by PyTorch Lightning's Trainer (its parity-benchmark settings: no checkpointing, logger,
progress bar or summary). Prints one line per epoch: "epoch <i> <seconds>".

    python overhead.py {torch|lightning} {cnn|mlp} <samples> <batch_size> <epochs> <threads>
"""
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.drop_conv = nn.Dropout(0.25)
        self.fc1 = nn.Linear(64 * 7 * 7, 128)
        self.drop_fc = nn.Dropout(0.5)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.drop_conv(x).flatten(1)
        x = self.drop_fc(F.relu(self.fc1(x)))
        return self.fc2(x)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(F.relu(self.fc1(x)))


MODEL = Net
SHAPE = (1, 28, 28)


class BatchDataset(torch.utils.data.Dataset):
    """Whole batches by index_select, as Ember's and the C++ loop's data path do."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, idx):
        idx = torch.as_tensor(idx)
        return self.x[idx], self.y[idx]


def loader(n, bs):
    torch.manual_seed(0)
    x, y = torch.randn(n, *SHAPE), torch.randint(0, 10, (n,))
    sampler = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(range(n)), bs, drop_last=False)
    return torch.utils.data.DataLoader(BatchDataset(x, y), sampler=sampler, batch_size=None)


def plain(n, bs, epochs):
    net = MODEL()
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    data = loader(n, bs)
    net.train()
    for e in range(epochs):
        t0 = time.perf_counter()
        for xb, yb in data:
            loss = F.cross_entropy(net(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"epoch {e} {time.perf_counter() - t0:.4f}", flush=True)


def lightning(n, bs, epochs):
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = MODEL()

        def training_step(self, batch, _):
            xb, yb = batch
            loss = F.cross_entropy(self.net(xb), yb)
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=2e-3)

    class EpochTimer(pl.Callback):
        def on_train_epoch_start(self, trainer, module):
            self.t0 = time.perf_counter()

        def on_train_epoch_end(self, trainer, module):
            print(f"epoch {trainer.current_epoch} {time.perf_counter() - self.t0:.4f}", flush=True)

    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[EpochTimer()])
    trainer.fit(Module(), loader(n, bs))


if __name__ == "__main__":
    which, model, n, bs, epochs, threads = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
    if model == "mlp":
        MODEL, SHAPE = Mlp, (32,)
    torch.set_num_threads(threads)
    {"torch": plain, "lightning": lightning}[which](n, bs, epochs)
