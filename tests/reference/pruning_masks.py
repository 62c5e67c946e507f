# Recomputes the pruning plugin's masks with PyTorch's torch.nn.utils.prune (tests/pruning_test.cpp).
#
#   python pruning_masks.py METHOD AMOUNT GLOBAL DIM NORM SEED CKPT_0 CKPT_1 ... CKPT_n
#
# CKPT_e is the checkpoint taken at the last step of epoch e, before that epoch's pruning: it holds
# the weights the pruning ranks and the masks of the prunings before it. For each e < n this
# script prunes CKPT_e's weights as PyTorch does (after restoring CKPT_e's masks with
# custom_from_mask, so amounts apply to what is not pruned yet, and seeding PyTorch's generator
# with SEED + the number of prunings before, for the random methods) and compares the result with
# the masks CKPT_{e+1} holds. It also checks that every checkpoint's weights are zero wherever its
# masks prune. Prints one line per mismatch and exits 1, or prints "ok N" (masks compared).
import sys

import torch
from torch.nn.utils import prune


def load(path):
    c = torch.load(path)
    return c["state_dict"], c["callbacks"]["pruning"]


def main():
    method, amount_text, use_global, dim, norm, seed = sys.argv[1:7]
    paths = sys.argv[7:]
    amount = int(amount_text) if amount_text.lstrip("-").isdigit() else float(amount_text)
    use_global = use_global == "true"
    dim, norm, seed = int(dim), float(norm), int(seed)
    names = list(load(paths[-1])[1]["masks"].keys())
    bad = 0
    compared = 0
    for e in range(len(paths) - 1):
        weights, state = load(paths[e])
        holders = []
        for n in names:
            h = torch.nn.Module()
            h.register_parameter("w", torch.nn.Parameter(weights[n].clone()))
            if state["prunings"] > 0:
                prune.custom_from_mask(h, "w", state["masks"][n].to(weights[n].dtype))
            holders.append(h)
        torch.manual_seed(seed + state["prunings"])
        if use_global:
            fn = {"l1_unstructured": prune.L1Unstructured, "random_unstructured": prune.RandomUnstructured}[method]
            prune.global_unstructured([(h, "w") for h in holders], pruning_method=fn, amount=amount)
        else:
            for h in holders:
                if method == "l1_unstructured":
                    prune.l1_unstructured(h, "w", amount=amount)
                elif method == "random_unstructured":
                    prune.random_unstructured(h, "w", amount=amount)
                elif method == "ln_structured":
                    prune.ln_structured(h, "w", amount=amount, n=norm, dim=dim)
                else:
                    prune.random_structured(h, "w", amount=amount, dim=dim)
        _, next_state = load(paths[e + 1])
        for n, h in zip(names, holders):
            ours = next_state["masks"][n]
            theirs = h.w_mask.bool()
            compared += 1
            if not torch.equal(ours, theirs):
                bad += 1
                print(f"epoch {e}: {n}: {int((ours != theirs).sum())} entries differ "
                      f"(pruned: ours {int((~ours).sum())}, PyTorch {int((~theirs).sum())})")
    for p in paths[1:]:
        weights, state = load(p)
        for n in names:
            if (weights[n][~state["masks"][n]] != 0).any():
                bad += 1
                print(f"{p}: {n} has non-zero pruned entries")
    if bad:
        sys.exit(1)
    print(f"ok {compared}")


main()
