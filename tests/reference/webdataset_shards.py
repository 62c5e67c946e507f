"""Reference shards for tests/webdataset_test.cpp, written with the webdataset package's ShardWriter
and read back with its own WebDataset reader.

  webdataset_shards.py arrays OUT N MAXCOUNT
      N samples (keys 000000...) as OUT/train-%06d.tar, MAXCOUNT per shard: "npy" = float32
      [id*10, id*10+1, id*10+2, id*10+3], "cls" = id % 3; prints, as JSON, webdataset's own reading
      (ids in order and the sum of each sample's array) and each shard's sample count
  webdataset_shards.py images ROOT OUT MAXCOUNT
      the images of an image folder ROOT (torchvision's ImageFolder order) as OUT/img-%06d.tar:
      "png" or "jpg" (the file's bytes as they are) and "cls" (the class index)
  webdataset_shards.py check ROOT SHARD...
      reads the shards (`engine data pack`'s) with webdataset's reader and prints, as JSON, whether
      they hold exactly the images of ROOT (ImageFolder) with their classes, and in which order
"""
import glob
import hashlib
import json
import os
import sys

import numpy as np
import webdataset as wds
from torchvision.datasets import ImageFolder


def arrays(out, n, maxcount):
    os.makedirs(out, exist_ok=True)
    with wds.ShardWriter(os.path.join(out, "train-%06d.tar"), maxcount=maxcount, verbose=0) as sink:
        for i in range(n):
            sink.write({"__key__": "%06d" % i, "npy": np.arange(4, dtype=np.float32) + 10 * i, "cls": i % 3})
    shards = sorted(glob.glob(os.path.join(out, "train-*.tar")))
    ids, sums = [], []
    for array, label in wds.WebDataset(shards, shardshuffle=False).decode().to_tuple("npy", "cls"):
        ids.append(int(array[0]) // 10)
        sums.append(float(array.sum()))
        assert label == ids[-1] % 3
    counts = [sum(1 for _ in wds.WebDataset(s, shardshuffle=False)) for s in shards]
    print(json.dumps({"ids": ids, "sums": sums, "shards": [os.path.basename(s) for s in shards], "counts": counts}))


def images(root, out, maxcount):
    os.makedirs(out, exist_ok=True)
    folder = ImageFolder(root)
    with wds.ShardWriter(os.path.join(out, "img-%06d.tar"), maxcount=maxcount, verbose=0) as sink:
        for i, (path, label) in enumerate(folder.samples):
            ext = os.path.splitext(path)[1].lower().lstrip(".")
            with open(path, "rb") as f:
                sink.write({"__key__": "%06d" % i, "jpg" if ext == "jpeg" else ext: f.read(), "cls": label})


def check(root, shards):
    folder = ImageFolder(root)
    digest = {}
    for index, (path, label) in enumerate(folder.samples):
        with open(path, "rb") as f:
            digest[(hashlib.sha1(f.read()).hexdigest(), label)] = index
    seen = []
    for sample in wds.WebDataset(shards, shardshuffle=False):
        data = sample.get("png", sample.get("jpg"))
        seen.append(digest.get((hashlib.sha1(data).hexdigest(), int(sample["cls"])), -1))
    print(json.dumps({"same": sorted(seen) == list(range(len(folder.samples))), "order": seen}))


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "arrays":
        arrays(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif cmd == "images":
        images(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif cmd == "check":
        check(sys.argv[2], sys.argv[3:])
    else:
        sys.exit("unknown command " + cmd)
