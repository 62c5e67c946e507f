"""Arrays for tests/tensor_files_test.cpp: a learnable 3-class problem (the class is the arg-max of
three fixed projections of 8 features), written with numpy.save and with safetensors.

  tensor_files.py OUT   OUT/{x_train,y_train,x_test,y_test}.npy, OUT/{train,test}.safetensors,
                        OUT/x_fortran.npy (Fortran order), OUT/y_short.npy (fewer labels)
"""
import os
import sys

import numpy as np
from safetensors.numpy import save_file

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
rng = np.random.default_rng(3)
w = rng.normal(size=(8, 3))
for split, n in (("train", 600), ("test", 250)):
    x = rng.normal(size=(n, 8)).astype(np.float32)
    y = (x @ w).argmax(1).astype(np.int64)
    np.save(os.path.join(out, f"x_{split}.npy"), x)
    np.save(os.path.join(out, f"y_{split}.npy"), y)
    save_file({"inputs": x, "labels": y}, os.path.join(out, f"{split}.safetensors"))
np.save(os.path.join(out, "x_fortran.npy"), np.asfortranarray(rng.normal(size=(20, 8)).astype(np.float32)))
np.save(os.path.join(out, "y_short.npy"), np.zeros(10, dtype=np.int64))
