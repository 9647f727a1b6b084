"""The fused path under Partial FC with the exact idle-row update: the update applied in the
backward (``fused_update=True``) and the row-sparse SGD's Triton kernel, on the GPU implementations,
train as torch's dense optimizer over the whole weight does with the torch implementation: the same
losses, every row, every state, to fp32 rounding (AdamW: to its normalisation of that rounding).
The catch-up itself runs before the fused forward, as torch operations on the sampled rows (the
same code as the torch implementation's); the kernels apply the step as before."""

from __future__ import annotations

import copy

import pytest
import torch
from fused_pairs import DEVICE, MARGINS, C, D

import shardfc
from shardfc.head import partial_fc

B = 6
STEPS = 5
OPT_KW = {"sgd": dict(lr=0.5, momentum=0.9, weight_decay=5e-3, nesterov=False),
          "adamw": dict(lr=0.05, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)}


def _run(impl: str, optimizer: str, dense: bool, **kw):
    torch.manual_seed(0)
    head = shardfc.ShardedMarginHead(D, C, margin=copy.deepcopy(MARGINS["arcface"]), impl=impl, device=DEVICE,
                                     sample_rate=0.1, sample_seed=4, **kw.pop("head", {}))
    if dense:
        cls = torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW
        opt = cls(head.parameters(), **OPT_KW[optimizer])
    else:
        opt = partial_fc.head_optimizer(head, optimizer, **OPT_KW[optimizer], **kw)
        if isinstance(opt, partial_fc.RowSparseSGD):
            opt.fused = impl != "torch"  # the row-sparse SGD's own kernel where the backward does not update
    losses = []
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = OPT_KW[optimizer]["lr"] * (1.0 if step % 2 else 0.4)
        g = torch.Generator().manual_seed(50 + step)
        x = torch.randn(B, D, generator=g, dtype=torch.float64).float() * 3
        y = torch.randint(0, C, (B,), generator=g)
        opt.zero_grad(set_to_none=False)
        loss = head(x.to(DEVICE), y.to(DEVICE))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    head.catch_up()
    state = opt.state[head.weight]
    keys = [k for k in ("momentum_buffer", "exp_avg", "exp_avg_sq") if k in state]
    return head, torch.tensor(losses), [head.weight.detach().double().cpu()] + [state[k].double().cpu() for k in keys]


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("fused_update", [True, False], ids=["update_in_backward", "update_in_step"])
def test_the_fused_path_trains_as_the_dense_optimizer(optimizer, fused_update):
    _, dense_losses, dense = _run("torch", optimizer, dense=True)
    head, losses, sparse = _run("triton", optimizer, dense=False, fused_update=fused_update)
    assert head.last_update == ("fused" if fused_update else head.last_update)
    assert _rel(losses, dense_losses) <= 1e-5
    assert len(sparse) == len(dense)
    # AdamW divides by √v: the kernels' and torch's fp32 summation orders of a small gradient differ
    # by its rounding, which the normalisation lifts to the update's scale (test_fused_update's
    # AdamW trajectory holds the same 1e-4); SGD's stay at fp32 rounding.
    tol = 1e-5 if optimizer == "sgd" else 1e-4
    for a, b in zip(sparse, dense):
        assert _rel(a, b) <= tol
