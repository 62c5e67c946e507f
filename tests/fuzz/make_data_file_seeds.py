#!/usr/bin/env python3
"""Writes the seeds of tests/fuzz/corpus/data_files/: small data files of the kinds users bring,
made with the Python packages that write them.

usage: make_data_file_seeds.py OUT_DIR
Each seed is one kind byte (tests/fuzz/data_file_inputs.h) followed by the file's bytes:
  0 .npy (numpy.save, format versions 1 and 2), 1 JPEG and PNG (Pillow: RGB, grayscale, palette,
  RGBA, progressive JPEG), 2 CSV (with quoting), 3 JSON Lines, 4 a WebDataset tar shard (tarfile:
  .npy and .cls members, one sample without .cls; plain, gzip and xz). Run once with the LibTorch venv's Python
  (scripts/setup.sh installs numpy and Pillow there); the seeds are committed."""
import io
import os
import sys
import tarfile


def write(out_dir, name, kind, data):
    with open(os.path.join(out_dir, name), "wb") as f:
        f.write(bytes([kind]) + data)


def npy_bytes(a, version=None):
    import numpy as np
    from numpy.lib import format as npformat

    buf = io.BytesIO()
    if version is None:
        np.save(buf, a)
    else:
        npformat.write_array(buf, a, version=version)
    return buf.getvalue()


def main():
    out = sys.argv[1]
    import numpy as np
    from PIL import Image

    write(out, "f4.npy", 0, npy_bytes(np.arange(12, dtype=np.float32).reshape(3, 4)))
    write(out, "i8_v2.npy", 0, npy_bytes(np.arange(5, dtype=np.int64), version=(2, 0)))
    write(out, "bool_scalar.npy", 0, npy_bytes(np.bool_(True)))

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (9, 13, 3), dtype=np.uint8)
    for name, image, fmt, options in [
        ("rgb.jpg", Image.fromarray(pixels), "JPEG", {"quality": 90}),
        ("progressive.jpg", Image.fromarray(pixels), "JPEG", {"progressive": True}),
        ("gray.jpg", Image.fromarray(pixels[:, :, 0]), "JPEG", {}),
        ("rgb.png", Image.fromarray(pixels), "PNG", {}),
        ("rgba.png", Image.fromarray(np.dstack([pixels, pixels[:, :, :1]])), "PNG", {}),
        ("palette.png", Image.fromarray(pixels).convert("P"), "PNG", {}),
        ("gray16.png", Image.fromarray((pixels[:, :, 0].astype(np.uint16) * 257)), "PNG", {}),
    ]:
        buf = io.BytesIO()
        image.save(buf, fmt, **options)
        write(out, name, 1, buf.getvalue())

    write(out, "table.csv", 2, b'text,label,id\n"great, really ""great"" food",good,1\nbad food,poor,2\r\n"two\nlines",good,3\n')
    write(out, "table.jsonl", 3, b'{"text": "great food", "label": "good"}\n\n{"text": "caf\\u00e9", "label": 3}\n')
    write(out, "table_lists.jsonl", 3, b'{"text": "great food", "label": ["good", 3]}\n{"text": "none", "label": []}\n{"text": "one", "label": "a;b"}\n')

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        def add(name, data):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        for i in range(3):
            add(f"train/{i:04d}.npy", npy_bytes(np.full((2, 3), i, dtype=np.float32)))
            if i != 1:
                add(f"train/{i:04d}.cls", str(i).encode())
        add("__meta__.json", b"{}")
    write(out, "shard.tar", 4, buf.getvalue())
    # Compressed shards are decompressed into the cache first (zlib for gzip, libarchive for xz).
    import gzip
    import lzma

    write(out, "shard.tar.gz", 4, gzip.compress(buf.getvalue(), mtime=0))
    write(out, "shard.tar.xz", 4, lzma.compress(buf.getvalue()))


if __name__ == "__main__":
    main()
