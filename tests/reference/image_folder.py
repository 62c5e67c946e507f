"""Reference data for tests/image_folder_test.cpp, written with Pillow and read with torchvision.

  image_folder.py decode OUT            images of every kind PIL opens (RGB/gray JPEG, RGB/RGBA/LA/
                                        palette/gray PNG) and PIL's convert("RGB") pixels of each
                                        (OUT/<name>.rgb, raw HWC bytes; OUT/decode.json their sizes)
  image_folder.py layout ROOT           a folder with awkward class names, nested folders, upper-case
                                        extensions and non-images; prints torchvision ImageFolder's
                                        classes and samples as JSON
  image_folder.py fmnist OUT N_TRAIN N_TEST
                                        the first Fashion-MNIST images (Debian's idx files) as PNGs in
                                        OUT/train/<class>/ and OUT/test/<class>/
  image_folder.py resnet OUT            torchvision's resnet18 (seed 0, 3 classes) as OUT/resnet18.safetensors,
                                        six 32x32 PNGs in OUT/images/{a,b,c}/, and torchvision's softmax of
                                        each (eval mode, ToTensor + ImageNet Normalize) in OUT/probs.json
"""
import gzip
import json
import os
import sys

import numpy as np
from PIL import Image

rng = np.random.default_rng(7)


def smooth(h, w, c):
    # A photo-like image (smooth gradients plus noise): JPEG's usual content.
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)), ((x + y) * 127 // max(h + w - 2, 1))], -1)[..., :c]
    return np.clip(base + rng.integers(-20, 20, size=(h, w, c)), 0, 255).astype(np.uint8)


def decode(out):
    os.makedirs(out, exist_ok=True)
    images = {
        "rgb.jpg": (Image.fromarray(smooth(37, 53, 3), "RGB"), {"quality": 90}),
        "gray.jpg": (Image.fromarray(smooth(40, 31, 1)[..., 0], "L"), {"quality": 85}),
        "rgb420.jpg": (Image.fromarray(smooth(64, 48, 3), "RGB"), {"quality": 75, "subsampling": 2}),
        "rgb.png": (Image.fromarray(smooth(21, 17, 3), "RGB"), {}),
        "rgba.png": (Image.fromarray(np.concatenate([smooth(19, 23, 3), rng.integers(0, 256, (19, 23, 1), dtype=np.uint8)], -1), "RGBA"), {}),
        "la.png": (Image.fromarray(np.concatenate([smooth(12, 9, 1), rng.integers(0, 256, (12, 9, 1), dtype=np.uint8)], -1), "LA"), {}),
        "gray.png": (Image.fromarray(smooth(15, 14, 1)[..., 0], "L"), {}),
        "palette.png": (Image.fromarray(smooth(16, 20, 3), "RGB").quantize(17), {}),
    }
    sizes = {}
    for name, (img, kw) in images.items():
        img.save(os.path.join(out, name), **kw)
        rgb = np.asarray(Image.open(os.path.join(out, name)).convert("RGB"))
        rgb.tofile(os.path.join(out, name + ".rgb"))
        sizes[name] = [int(rgb.shape[0]), int(rgb.shape[1])]
    json.dump(sizes, open(os.path.join(out, "decode.json"), "w"))


def layout(root):
    from torchvision.datasets import ImageFolder
    for cls, files in {"b": ["z.png", "a.JPG", "sub/c.jpeg", "sub/deeper/d.png"], "B": ["x.png", "notes.txt"],
                       "a_cls": ["1.png", "10.png", "2.png"], "10": ["k.jpg"], "9": ["k.png"], "empty": []}.items():
        os.makedirs(os.path.join(root, cls), exist_ok=True)
        for f in files:
            path = os.path.join(root, cls, f)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if f.endswith(".txt"):
                open(path, "w").write("not an image")
            else:
                Image.fromarray(smooth(8, 8, 3), "RGB").save(path, format="JPEG" if f.lower().endswith(("jpg", "jpeg")) else "PNG")
    ds = ImageFolder(root, allow_empty=True)
    print(json.dumps({"classes": ds.classes, "samples": [[p, c] for p, c in ds.samples]}))


def fmnist(out, n_train, n_test):
    src = "/usr/share/datasets/fashion-mnist"
    def read(kind, n):
        with gzip.open(f"{src}/{kind}-images-idx3-ubyte.gz") as f:
            x = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28)[:n]
        with gzip.open(f"{src}/{kind}-labels-idx1-ubyte.gz") as f:
            y = np.frombuffer(f.read(), np.uint8, offset=8)[:n]
        return x, y
    for split, kind, n in (("train", "train", n_train), ("test", "t10k", n_test)):
        x, y = read(kind, n)
        for c in range(10):
            os.makedirs(os.path.join(out, split, str(c)), exist_ok=True)
        for i, (img, label) in enumerate(zip(x, y)):
            Image.fromarray(img, "L").save(os.path.join(out, split, str(label), f"{i:05d}.png"))


def resnet(out):
    import torch
    import torchvision
    from safetensors.torch import save_file
    from torchvision.datasets import ImageFolder
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=3).eval()
    # Batch-norm statistics that are not the identity, so loading the buffers matters.
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    for c in "abc":
        os.makedirs(os.path.join(out, "images", c), exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(out, "resnet18.safetensors"))
    for i in range(6):
        Image.fromarray(smooth(32, 32, 3), "RGB").save(os.path.join(out, "images", "abc"[i % 3], f"{i}.png"))
    t = torchvision.transforms.Compose([torchvision.transforms.ToTensor(),
                                        torchvision.transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    ds = ImageFolder(os.path.join(out, "images"), transform=t)
    with torch.no_grad():
        probs = {p: model(ds[i][0].unsqueeze(0)).softmax(1)[0].tolist() for i, (p, _) in enumerate(ds.samples)}
    json.dump(probs, open(os.path.join(out, "probs.json"), "w"))


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "decode":
        decode(sys.argv[2])
    elif cmd == "layout":
        layout(sys.argv[2])
    elif cmd == "fmnist":
        fmnist(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif cmd == "resnet":
        resnet(sys.argv[2])
    else:
        sys.exit(__doc__)
