"""The GPT the plain-PyTorch sides of bench/lm_char.py and bench/lm_gpu.py train: nanoGPT's GPT-2
layout as Ember's `gpt` model builds it (pre-norm blocks, LayerNorm without bias, causal
scaled_dot_product_attention, GELU (tanh) MLP, tied embeddings, no biases), with its initialisation
rule (normal 0.02; residual projections 0.02 / sqrt(2 x layers)), and nanoGPT's optimizer groups
(weight decay on the parameters of 2 or more dimensions only, as `optimizer.no_weight_decay_1d`)."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.width, self.heads = width, heads
        self.ln_1 = nn.LayerNorm(width, bias=False)
        self.c_attn = nn.Linear(width, 3 * width, bias=False)
        self.attn_proj = nn.Linear(width, width, bias=False)
        self.ln_2 = nn.LayerNorm(width, bias=False)
        self.c_fc = nn.Linear(width, 4 * width, bias=False)
        self.mlp_proj = nn.Linear(4 * width, width, bias=False)

    def forward(self, x):
        n, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(self.width, dim=2)
        q, k, v = (z.view(n, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(n, t, c)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, vocab, context, layers, heads, width):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width, bias=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, ids, targets):
        x = self.wte(ids) + self.wpe(torch.arange(ids.size(1), device=ids.device))
        for block in self.h:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        # (float32 for the loss, as autocast gives cross_entropy; a no-op in float32 runs)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def decay_groups(model, weight_decay):
    """nanoGPT's configure_optimizers groups: matrices and embeddings decay, 1-d parameters do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
