#!/usr/bin/env python3
"""Writes the checkpoint seeds of tests/fuzz/corpus/checkpoint/ from real Ember checkpoints.

usage: make_checkpoint_seeds.py OUT_DIR NAME=FILE.ckpt...
For each checkpoint: NAME.file (mode byte 0 + the file as it is) and NAME.records (mode byte 1 +
its payload records in the record-list encoding of tests/fuzz/fuzz_inputs.h). Python's zipfile
only; run once when the checkpoint format changes (docs/build.md, "Fuzzing")."""
import os
import re
import struct
import sys
import zipfile

PAYLOAD = re.compile(r"^(data\.pkl|ember/types|data/[0-9]{1,7})$")


def records(path):
    out = b""
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            name = info.filename.split("/", 1)[1]  # drop the archive folder
            if PAYLOAD.match(name):
                data = z.read(info)
                out += name.encode() + b"\0" + struct.pack("<I", len(data)) + data
    return out


def main():
    out_dir = sys.argv[1]
    for arg in sys.argv[2:]:
        name, path = arg.split("=", 1)
        with open(path, "rb") as f:
            raw = f.read()
        with open(os.path.join(out_dir, name + ".file"), "wb") as f:
            f.write(b"\0" + raw)
        with open(os.path.join(out_dir, name + ".records"), "wb") as f:
            f.write(b"\1" + records(path))


if __name__ == "__main__":
    main()
