"""bench/image_folder.sh's data and torchvision side.

  image_folder.py write OUT N SIZE   the first N Fashion-MNIST training images as PNG and as JPEG
                                     (quality 90) in OUT/png/<class>/ and OUT/jpeg/<class>/; SIZE > 28:
                                     upscaled to SIZE x SIZE RGB JPEGs (OUT/jpeg<SIZE>/) as photo-sized
                                     inputs
  image_folder.py torchvision ROOT SIZE TRAIN WORKERS BATCH
                                     one pass of ImageFolder + DataLoader(num_workers, pin_memory off)
                                     with torchvision's ImageNet transforms (train: RandomResizedCrop +
                                     flip; eval: Resize(SIZE / 0.875) + CenterCrop), printing images/s
"""
import gzip
import os
import sys
import time

import numpy as np
from PIL import Image


def write(out, n, size):
    src = "/usr/share/datasets/fashion-mnist"
    with gzip.open(f"{src}/train-images-idx3-ubyte.gz") as f:
        x = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28)[:n]
    with gzip.open(f"{src}/train-labels-idx1-ubyte.gz") as f:
        y = np.frombuffer(f.read(), np.uint8, offset=8)[:n]
    kinds = ["png", "jpeg"] + ([f"jpeg{size}"] if size > 28 else [])
    for k in kinds:
        for c in range(10):
            os.makedirs(os.path.join(out, k, str(c)), exist_ok=True)
    for i, (img, label) in enumerate(zip(x, y)):
        im = Image.fromarray(img, "L")
        im.save(os.path.join(out, "png", str(label), f"{i:05d}.png"))
        im.save(os.path.join(out, "jpeg", str(label), f"{i:05d}.jpg"), quality=90)
        if size > 28:
            im.convert("RGB").resize((size, size), Image.BILINEAR).save(os.path.join(out, f"jpeg{size}", str(label), f"{i:05d}.jpg"), quality=90)


def torchvision_pass(root, size, train, workers, batch):
    import torch
    import torchvision.transforms as T
    from torchvision.datasets import ImageFolder
    torch.set_num_threads(1)
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    if train:
        t = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    else:
        t = T.Compose([T.Resize(int(size / 0.875)), T.CenterCrop(size), T.ToTensor(), norm])
    ds = ImageFolder(root, transform=t)
    loader = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=train, num_workers=workers, persistent_workers=False)
    start = time.perf_counter()
    n = 0
    for x, _ in loader:
        n += x.shape[0]
    print(f"{n / (time.perf_counter() - start):.1f}")


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1] == "torchvision":
        torchvision_pass(sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5]), int(sys.argv[6]))
