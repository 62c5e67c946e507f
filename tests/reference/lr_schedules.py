# Prints the reference values (the rate and momentum before each step t = 0..n, the last one
# after the final step) embedded in tests/scheduler_test.cpp and tests/swa_test.cpp,
# computed by PyTorch's own schedulers. Run with the torch venv that scripts/setup.sh makes:
#   ~/.cache/ember/torch-2.11.0/bin/python tests/reference/lr_schedules.py
import torch
from torch.optim import SGD, Adam
from torch.optim.lr_scheduler import (CosineAnnealingLR, CyclicLR, LinearLR, OneCycleLR,
                                      ReduceLROnPlateau, SequentialLR, StepLR)
from torch.optim.swa_utils import SWALR


def opt(kind="sgd", lr=0.1):
    p = [torch.nn.Parameter(torch.zeros(1))]
    return SGD(p, lr=lr, momentum=0.9) if kind == "sgd" else Adam(p, lr=lr)


def run(name, make, steps, kind="sgd", lr=0.1, metrics=None):
    o = opt(kind, lr)
    s = make(o)
    lrs, moms = [], []
    for i in range(steps):
        g = o.param_groups[0]
        lrs.append(g["lr"])
        moms.append(g["betas"][0] if kind == "adam" else g["momentum"])
        o.step()
        if metrics is None:
            s.step()
        else:
            s.step(metrics[i])
    g = o.param_groups[0]  # after the last step: t = steps
    lrs.append(g["lr"])
    moms.append(g["betas"][0] if kind == "adam" else g["momentum"])
    fmt = lambda v: ", ".join(repr(float(x)) for x in v)
    print(f"// {name}\nlr: {{{fmt(lrs)}}}\nmomentum: {{{fmt(moms)}}}\n")


run("CyclicLR triangular base 0.001 max 0.006 up 5 down 3 (SGD momentum, cycle_momentum)",
    lambda o: CyclicLR(o, 0.001, 0.006, step_size_up=5, step_size_down=3), 20)
run("CyclicLR triangular2 base 0.001 max 0.006 up 4 (Adam: beta1 cycles)",
    lambda o: CyclicLR(o, 0.001, 0.006, step_size_up=4, mode="triangular2"), 20, kind="adam")
run("CyclicLR exp_range base 0.001 max 0.006 up 3 gamma 0.9, no momentum cycling",
    lambda o: CyclicLR(o, 0.001, 0.006, step_size_up=3, mode="exp_range", gamma=0.9, cycle_momentum=False), 14)
run("OneCycleLR max 0.1 total 20 cos",
    lambda o: OneCycleLR(o, max_lr=0.1, total_steps=20), 20)
run("OneCycleLR max 0.1 total 20 linear pct 0.25 (Adam)",
    lambda o: OneCycleLR(o, max_lr=0.1, total_steps=20, anneal_strategy="linear", pct_start=0.25), 20, kind="adam")
run("OneCycleLR max 0.1 total 20 three_phase div 10 final_div 100",
    lambda o: OneCycleLR(o, max_lr=0.1, total_steps=20, three_phase=True, div_factor=10, final_div_factor=100), 20)
run("LinearLR(1/3, 4) then CosineAnnealingLR(T_max 16, eta_min 0.001), base 0.1",
    lambda o: SequentialLR(o, [LinearLR(o, start_factor=1 / 3, total_iters=4),
                               CosineAnnealingLR(o, T_max=16, eta_min=0.001)], milestones=[4]), 20)
run("CosineAnnealingLR(T_max 10), base 0.1", lambda o: CosineAnnealingLR(o, T_max=10), 10)
run("StepLR(step 3, gamma 0.5), base 0.1", lambda o: StepLR(o, step_size=3, gamma=0.5), 10)
metrics = [1.0, 0.9, 0.895, 0.894, 0.893, 0.7, 0.71, 0.72, 0.73, 0.74, 0.75, 0.76, 0.5, 0.51, 0.52, 0.53]
run("ReduceLROnPlateau(min, factor 0.5, patience 2, threshold 0.01 rel, cooldown 1, min_lr 0.02), base 0.1, metrics "
    + repr(metrics),
    lambda o: ReduceLROnPlateau(o, mode="min", factor=0.5, patience=2, threshold=0.01, cooldown=1, min_lr=0.02),
    len(metrics), metrics=metrics)
metrics2 = [0.1, 0.2, 0.25, 0.26, 0.2, 0.3, 0.3, 0.3, 0.3, 0.305, 0.31]
run("ReduceLROnPlateau(max, factor 0.3, patience 1, threshold 0.02 abs), base 0.1, metrics " + repr(metrics2),
    lambda o: ReduceLROnPlateau(o, mode="max", factor=0.3, patience=1, threshold=0.02, threshold_mode="abs"),
    len(metrics2), metrics=metrics2)
run("SWALR(swa_lr 0.01, anneal_epochs 3, cos), lr0 0.05",
    lambda o: SWALR(o, swa_lr=0.01, anneal_epochs=3, anneal_strategy="cos"), 6, lr=0.05)
run("SWALR(swa_lr 0.01, anneal_epochs 4, linear), lr0 0.05",
    lambda o: SWALR(o, swa_lr=0.01, anneal_epochs=4, anneal_strategy="linear"), 6, lr=0.05)
run("SWALR(swa_lr 0.01, anneal_epochs 0), lr0 0.05",
    lambda o: SWALR(o, swa_lr=0.01, anneal_epochs=0), 4, lr=0.05)
