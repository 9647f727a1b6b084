"""The fused row-sparse SGD against the torch RowSparseSGD (the reference), under the interpreter."""

from __future__ import annotations

import pytest
import torch
from fused_pairs import DEVICE

import shardfc
from shardfc.head.partial_fc import RowGrad, RowSparseSGD

N, D = 45, 20


def _run(fused, dtype, kind, momentum, nesterov, wd, steps=3):
    g = torch.Generator().manual_seed(5)
    p = torch.nn.Parameter((torch.randn(N, D, generator=g) * 0.1).to(DEVICE, dtype))
    grads = [(torch.randn(N, D, generator=g) * 0.05).to(DEVICE, dtype) for _ in range(steps)]
    rows = [torch.randperm(N, generator=g)[:17].sort().values.to(DEVICE) for _ in range(steps)]
    step = {"k": 0}

    def sampled():
        k = step["k"]
        if kind == "compact":
            return {p: RowGrad(rows[k], grads[k][rows[k]])}
        if kind == "rows":
            return {p: rows[k]}
        return {}

    opt = RowSparseSGD([p], lr=0.3, momentum=momentum, weight_decay=wd, nesterov=nesterov, sampled_rows=sampled, fused=fused)
    for k in range(steps):
        step["k"] = k
        p.grad = None if kind == "compact" else grads[k].clone()
        opt.step()
    buf = opt.state[p].get("momentum_buffer")
    return p.detach().float().cpu(), None if buf is None else buf.float().cpu()


@pytest.mark.parametrize("kind", ["compact", "rows", "dense"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("momentum,nesterov,wd", [(0.9, False, 5e-4), (0.9, True, 0.0), (0.0, False, 1e-3)])
def test_fused_sgd_matches_torch(kind, dtype, momentum, nesterov, wd):
    """fp32: three steps, to fp32 rounding. bf16: one step, each element within one bf16 ulp of
    torch's: the fp32 update is the same, but Triton 3.9's interpreter truncates fp32 → bf16
    (measured: half of random values differ from round-to-nearest-even), where a GPU rounds to
    nearest even as torch does."""
    steps = 3 if dtype == torch.float32 else 1
    ref_p, ref_b = _run(False, dtype, kind, momentum, nesterov, wd, steps)
    got_p, got_b = _run(True, dtype, kind, momentum, nesterov, wd, steps)
    assert (got_b is None) == (ref_b is None)
    for got, ref in ((got_p, ref_p), (got_b, ref_b)):
        if ref is None:
            continue
        if dtype == torch.float32:
            assert float((got - ref).abs().max()) <= 1e-6 * float(ref.abs().max())
        else:
            assert bool(((got - ref).abs() <= ref.abs() * 2.0**-7).all())


def test_untouched_rows_stay_bit_identical():
    before = _run(False, torch.float32, "compact", 0.9, False, 5e-4, steps=0)[0]
    after = _run(True, torch.float32, "compact", 0.9, False, 5e-4, steps=1)[0]
    g = torch.Generator().manual_seed(5)
    torch.randn(N, D, generator=g), torch.randn(N, D, generator=g)
    touched = torch.randperm(N, generator=g)[:17]
    untouched = torch.ones(N, dtype=torch.bool)
    untouched[touched] = False
    assert torch.equal(after[untouched], before[untouched])
    assert not torch.equal(after[~untouched], before[~untouched])


def test_fused_true_says_why_not():
    p = torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.float64, device=DEVICE))
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=r"fused=True\) cannot serve this parameter: parameters of torch.float64"):
        RowSparseSGD([p], lr=0.1, fused=True).step()
    q = torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.bfloat16, device=DEVICE))
    q.grad = torch.ones_like(q)
    with pytest.raises(ValueError, match=r"rounding='stochastic' \(the kernel rounds to nearest\)"):
        RowSparseSGD([q], lr=0.1, rounding="stochastic", fused=True).step()
    with pytest.raises(TypeError, match="fused must be None"):
        RowSparseSGD([q], lr=0.1, fused="yes")


@pytest.mark.skipif(DEVICE.type == "cuda", reason="on CUDA the automatic choice is the fused kernel")
def test_automatic_is_off_on_the_cpu():
    head = shardfc.ShardedMarginHead(4, 10, sample_rate=0.5)
    head.weight.grad = torch.ones_like(head.weight)
    opt = shardfc.head_optimizer(head, "sgd", lr=0.1)
    assert opt.fused is None
    assert opt._fused_update(head.weight, None, opt.param_groups[0]) is False
