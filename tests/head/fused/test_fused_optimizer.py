"""The fused row-sparse SGD against the torch RowSparseSGD (the reference), under the interpreter."""

from __future__ import annotations

import pytest
import torch
from fused_pairs import DEVICE

import shardfc
from shardfc.head.partial_fc import RowGrad, RowSparseSGD

N, D = 45, 20


def _run(fused, dtype, kind, momentum, nesterov, wd, steps=3, grad_scale=None):
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
        if grad_scale is not None:  # set before each step, as shardfc train's head clip does
            opt.grad_scale = torch.tensor([grad_scale], device=DEVICE)
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


@pytest.mark.parametrize("kind", ["compact", "rows", "dense"])
def test_fused_sgd_divides_every_gradient_by_the_grad_scale_set_before_the_step(kind):
    ref_p, ref_b = _run(False, torch.float32, kind, 0.9, False, 5e-4, grad_scale=4.0)
    got_p, got_b = _run(True, torch.float32, kind, 0.9, False, 5e-4, grad_scale=4.0)
    unscaled, _ = _run(False, torch.float32, kind, 0.9, False, 5e-4)
    assert float((ref_p - unscaled).abs().max()) > 1e-3  # the scale matters at this size
    for got, ref in ((got_p, ref_p), (got_b, ref_b)):
        assert float((got - ref).abs().max()) <= 1e-6 * float(ref.abs().max())


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


def test_fusable_by_dtype_rounding_and_device(monkeypatch):
    from types import SimpleNamespace

    from shardfc.head.fused import optimizer

    def param(dtype=torch.float32, device="cpu"):
        return SimpleNamespace(dtype=dtype, device=torch.device(device))  # what fusable reads of a parameter

    monkeypatch.setattr(optimizer, "interpreting", lambda: False)
    assert optimizer.fusable(param(device="cuda"), "nearest") is None
    assert optimizer.fusable(param(torch.bfloat16, "meta"), "nearest") is None
    assert optimizer.fusable(param(torch.float32, "cuda"), "stochastic") is None  # fp32 is never rounded
    assert optimizer.fusable(param(torch.float16, "cuda"), "stochastic") == "rounding='stochastic' (the kernel rounds to nearest)"
    assert optimizer.fusable(param(torch.float64, "cuda"), "nearest") == "parameters of torch.float64 (fp32/bf16/fp16 only)"
    assert optimizer.fusable(param(), "nearest") == "parameters on cpu, not CUDA"
    monkeypatch.setattr(optimizer, "interpreting", lambda: True)
    assert optimizer.fusable(param(), "nearest") is None
    assert optimizer.fusable(param(device="mps"), "nearest") == "parameters on mps, not CUDA"  # the interpreter runs on the CPU


def _regions(regions, names):
    """Each region as (its tensor's name, part with tensors named, bytes, streamed): a tensor is named
    by its storage (a region of rows is a view of the tensor)."""
    def name(x):
        if not isinstance(x, torch.Tensor):
            return x
        return next(k for k, v in names.items() if v.untyped_storage()._cdata == x.untyped_storage()._cdata)
    return [(name(r.tensor), tuple(name(p) for p in r.part), r.nbytes, r.streamed) for r in regions]


def test_row_sgd_on_the_meta_device_notes_what_it_would_touch_and_launches_nothing():
    from shardfc.head.fused.optimizer import row_sgd_
    from shardfc.head.fused.traffic import recording

    meta = torch.device("meta")
    p, buf = torch.empty(100, 8, device=meta), torch.empty(100, 8, device=meta)
    grad, idx = torch.empty(100, 8, device=meta, dtype=torch.bfloat16), torch.empty(30, dtype=torch.int64, device=meta)
    names = {"p": p, "buf": buf, "grad": grad, "idx": idx}
    seen = []
    with recording(lambda *launch: seen.append(launch)):
        row_sgd_(p, buf, grad, idx, True, 0.1, 0.9, 0.0, False)
        row_sgd_(p, None, grad, idx, False, 0.1, 0.0, 0.0, False)
        row_sgd_(p, None, grad, None, False, 0.1, 0.0, 0.0, False)
        row_sgd_(p, buf, grad, idx[:0], True, 0.1, 0.9, 0.0, False)  # no rows: nothing
    rows = [("p", ("rows", "idx", 0, 30), 30 * 32, False), ("buf", ("rows", "idx", 0, 30), 30 * 32, False)]
    idx_span = ("idx", ("span", 0, 240), 240, False)
    assert [(k, _regions(r, names), _regions(w, names), f) for k, r, w, f in seen] == [
        ("row_sgd", rows + [("grad", ("rows", "idx", 0, 30), 30 * 16, False), idx_span], rows, 0.0),
        ("row_sgd", rows[:1] + [("grad", ("span", 0, 30 * 16), 30 * 16, False), idx_span], rows[:1], 0.0),
        ("row_sgd", [("p", ("span", 0, 3200), 3200, False), ("grad", ("span", 0, 1600), 1600, False)],
         [("p", ("span", 0, 3200), 3200, False)], 0.0),
    ]


@pytest.mark.parametrize("nesterov", [False, True])
def test_row_sgd_by_itself_with_the_numbers_given_and_a_gradient_scale(nesterov):
    """``row_sgd_`` called directly (no optimizer, no ``hyper`` tensor): compact rows, momentum, weight
    decay and the clipping's ``grad_scale``, one row, and no row."""
    from shardfc.head.fused.optimizer import row_sgd_

    g = torch.Generator().manual_seed(3)
    p, buf = torch.randn(40, 20, generator=g), torch.randn(40, 20, generator=g)
    grad, idx = torch.randn(5, 20, generator=g), torch.tensor([3, 7, 8, 21, 39])
    want_p, want_b = p.clone(), buf.clone()
    gi = grad / 2.0 + 1e-2 * want_p[idx]
    want_b[idx] = want_b[idx] * 0.9 + gi
    want_p[idx] -= 0.5 * (gi + 0.9 * want_b[idx] if nesterov else want_b[idx])
    row_sgd_(p, buf, grad, idx, False, 0.5, 0.9, 1e-2, nesterov, grad_scale=torch.tensor([2.0]))
    torch.testing.assert_close(buf, want_b)
    torch.testing.assert_close(p, want_p)
    one = torch.ones(1, 20)
    row_sgd_(p, None, one, torch.tensor([5]), False, 0.25, 0.0, 0.0, nesterov)
    torch.testing.assert_close(p[5], want_p[5] - 0.25)
    before = p.clone()
    row_sgd_(p, None, one[:0], torch.tensor([], dtype=torch.int64), False, 0.25, 0.0, 0.0, nesterov)
    assert torch.equal(p, before)
