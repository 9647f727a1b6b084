"""The GPU implementations (``impl="triton"``: the fused forward; ``impl="gemm"``: GEMMs + epilogues;
both: the GEMM backward) against the torch path (the reference implementation) and the dense
float64 reference, one process, under Triton's interpreter at small shapes (53 classes: four
class chunks of the GEMM path, two splits each)."""

from __future__ import annotations

import pytest
import torch
from fused_pairs import DEVICE, MARGINS, C, D, data, rel, step

import shardfc
from shardfc.head.module import init_rows

FP32 = 1e-5
FAST = ("triton", "gemm")


@pytest.fixture(params=FAST)
def impl(request):
    return request.param


def _compare(impl, tol=FP32, data_kw=None, **kw):
    x, y, up = data(**(data_kw or {}))
    ref = step("torch", x, y, up, **kw)
    got = step(impl, x, y, up, **kw)
    assert got["impl"] == impl and ref["impl"] == "torch"
    if "rows" in ref:
        assert torch.equal(got["rows"], ref["rows"])
    for key in ("loss", "grad_x", "grad_w"):
        assert rel(got[key], ref[key]) < tol, (key, rel(got[key], ref[key]))
    return ref, got


@pytest.mark.parametrize("margin", sorted(MARGINS))
def test_every_margin_matches_torch_path(impl, margin):
    _compare(impl, margin=margin, reduction="none")


OPTIONS = {
    "subcenters": dict(subcenters=3),
    "partial_fc": dict(sample_rate=0.4),
    "partial_fc+sparse_grad+subcenters": dict(sample_rate=0.3, sparse_grad=True, subcenters=2),
    "filter": dict(interclass_filter_threshold=0.05),
    "filter+subcenters+partial": dict(interclass_filter_threshold=0.05, subcenters=2, sample_rate=0.5),
    "label_smoothing": dict(label_smoothing=0.1, margin="cosface"),
    "smoothing+sphereface+sum": dict(label_smoothing=0.2, margin="sphereface", reduction="sum"),
    "grad_added_in_place": dict(grad_first=True, steps=2),
    "partial_fc_added_in_place": dict(grad_first=True, sample_rate=0.4),
    "no_in_place": dict(weight_grad_in_place=False, margin="magface"),
    "chunk_size_is_moot": dict(chunk_size=4),
    "bf16_centres": dict(dtype=torch.bfloat16),
}


@pytest.mark.parametrize("case", list(OPTIONS.values()), ids=list(OPTIONS))
def test_options_match_torch_path(impl, case):
    tol = 2e-2 if case.get("dtype") == torch.bfloat16 else FP32
    _compare(impl, tol=tol, **case)


def test_filter_removes_classes(impl):
    """The filter case above is not vacuous: at this threshold it changes the loss."""
    x, y, up = data()
    plain = step(impl, x, y, up)
    filtered = step(impl, x, y, up, interclass_filter_threshold=0.05)
    assert rel(filtered["loss"], plain["loss"]) > 1e-3


@pytest.mark.parametrize("where", ["all_ignored", "one_shard_region", "one_sample"])
def test_odd_batches(impl, where):
    kw = {
        "all_ignored": dict(data_kw=dict(B=5, ignore=False)),
        "one_shard_region": dict(data_kw=dict(low=C - 3, high=C)),
        "one_sample": dict(data_kw=dict(B=1, ignore=False)),
    }[where]
    if where == "all_ignored":
        x, y, up = data(B=5, ignore=False)
        y[:] = -1
        ref, got = step("torch", x, y, up), step(impl, x, y, up)
        assert float(got["loss"]) == float(ref["loss"]) == 0.0
        assert rel(got["grad_w"], ref["grad_w"]) == 0.0 and float(got["grad_w"].abs().max()) == 0.0
        return
    _compare(impl, **kw)


def test_fp32_against_dense_float64_reference(impl):
    x, y, up = data()
    margin = MARGINS["arcface"]
    got = step(impl, x, y, up, reduction="none", label_smoothing=0.1)
    W = init_rows(0, C, D, 0, device=DEVICE).double().cpu().requires_grad_()
    xr = x.double().requires_grad_()
    ref = shardfc.reference_loss(xr, W, y, margin, label_smoothing=0.1, reduction="none")
    ref.backward(up.double())
    assert rel(got["loss"], ref.detach()) < FP32
    assert rel(got["grad_x"], xr.grad) < FP32
    assert rel(got["grad_w"], W.grad) < FP32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_compute_within_torch_paths_error(impl, dtype):
    """Under autocast both paths multiply in ``dtype``; the fast one may not be less exact."""
    x, y, up = data()
    W = init_rows(0, C, D, 0, device=DEVICE).double().cpu().requires_grad_()
    xr = x.double().requires_grad_()
    ref = shardfc.reference_loss(xr, W, y, MARGINS["arcface"], reduction="none")
    ref.backward(up.double())
    errs = {}
    for name in ("torch", impl):
        out = step(name, x, y, up, autocast=dtype, reduction="none")
        errs[name] = {k: rel(out[k], r) for k, r in (("loss", ref.detach()), ("grad_x", xr.grad), ("grad_w", W.grad))}
    for key, err in errs[impl].items():
        assert err <= 2 * errs["torch"][key] + 2e-3, (key, errs)


def test_devices_mode_two_shards(impl):
    x, y, up = data()
    out = {}
    for name in ("torch", impl):
        head = shardfc.ShardedMarginHead(D, C, devices=[DEVICE, DEVICE], impl=name, subcenters=2)
        xr = x.to(DEVICE, copy=True).requires_grad_()
        head(xr, y.to(DEVICE)).backward()
        out[name] = (xr.grad.cpu(), [w.grad.cpu() for w in head.shard_weights])
    assert rel(out[impl][0], out["torch"][0]) < FP32
    for a, b in zip(out[impl][1], out["torch"][1]):
        assert rel(a, b) < FP32


def test_target_gradient_goes_to_the_sub_centre_the_margin_used(impl):
    """Two centres of the target class equal in bf16 but not in fp32: the margin (fp32 target
    products) picks the second; the kernels' bf16 products tie. The gradient must follow the
    margin's choice (as a dense head's autograd would), not the kernels' tie-break."""
    K = 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, D, generator=g).to(DEVICE)
    y = torch.tensor([5], device=DEVICE)
    head = shardfc.ShardedMarginHead(D, C, subcenters=K, impl=impl, device=DEVICE)
    with torch.no_grad():
        v = x[0] / x[0].norm() + 0.05 * torch.randn(D, generator=g).to(DEVICE)
        v = v.bfloat16().float()
        head.weight[5 * K] = v
        head.weight[5 * K + 1] = v + 1e-4 * x[0] / x[0].norm()  # below bf16's resolution, above fp32's
    xr = x.clone().requires_grad_()
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        head(xr, y).backward()
    grad = head.weight.grad
    assert float(grad[5 * K].abs().max()) == 0.0
    assert float(grad[5 * K + 1].abs().max()) > 0.0


@pytest.mark.parametrize("name", ["torch", "triton", "gemm"])
def test_fp16_keeps_small_softmax_gradients(name):
    """At a million classes the non-target softmax values are ≈ 1e-7 and the upstream gradient
    ≈ 1e-3: their products fall below fp16's normal range, and an fp16 operand holding them flushes
    every non-target centre's gradient to zero. Here, at 53 classes, the samples sit far enough from
    the other centres (cosine 0.35 to their own, s = 64) that every non-target class's softmax is
    below 1e-6 for every sample, and the upstream gradient is 1e-3: the same magnitudes."""
    Cs, Ds, Bs = 53, 256, 29
    W0 = init_rows(0, Cs, Ds, 0)  # drawn on the CPU and copied into the head: the same case on every device
    g = torch.Generator().manual_seed(5)
    y = torch.randint(0, Cs, (Bs,), generator=g)
    unit = W0 / W0.norm(dim=1, keepdim=True)
    side = torch.randn(Bs, Ds, generator=g)
    side = side - (side * unit[y]).sum(1, keepdim=True) * unit[y]
    x = 0.35 * unit[y] + (1 - 0.35**2) ** 0.5 * side / side.norm(dim=1, keepdim=True)
    up = torch.full((Bs,), 1e-3)
    p = torch.softmax(64 * (x.double() @ unit.double().t()), dim=1)
    far = p.max(dim=0).values < 1e-6
    far[y] = False
    assert int(far.sum()) >= 20  # the case is what it says

    Wd, xd = W0.double().requires_grad_(), x.double().requires_grad_()
    shardfc.reference_loss(xd, Wd, y, MARGINS["normsoftmax"].__class__(64.0), reduction="none").backward(up.double())
    head = shardfc.ShardedMarginHead(Ds, Cs, margin=MARGINS["normsoftmax"].__class__(64.0), impl=name,
                                     reduction="none", device=DEVICE)
    with torch.no_grad():
        head.weight.copy_(W0)
    xr = x.to(DEVICE, copy=True).requires_grad_()
    with torch.autocast(DEVICE.type, dtype=torch.float16):
        loss = head(xr, y.to(DEVICE))
    loss.backward(up.to(DEVICE))
    got = head.weight.grad.double().cpu()[far]
    assert int((got == 0).sum()) == 0
    assert float((got - Wd.grad[far]).norm() / Wd.grad[far].norm()) < 2e-2


@pytest.mark.parametrize("case", [dict(), dict(sample_rate=0.4, grad_first=True), dict(subcenters=2, dtype=torch.bfloat16),
                                  dict(margin="softmax", weight_grad_in_place=False)],
                         ids=["plain", "partial_fc_in_place", "subcenters_bf16", "raw_centres"])
def test_shard_above_the_operand_budget(impl, case, monkeypatch):
    """A shard whose compute-dtype copy would exceed OPERAND_BYTES: the step's pass computes the
    norms only, each chunk makes its own operand and the weight gradient reads the fp32 rows."""
    from shardfc.head.fused import chunks

    monkeypatch.setattr(chunks, "OPERAND_BYTES", 0)
    made = []
    real = chunks.operand_rows
    monkeypatch.setattr(chunks, "operand_rows", lambda *a, **k: made.append(1) or real(*a, **k))
    tol = 2e-2 if case.get("dtype") == torch.bfloat16 else FP32
    _compare(impl, tol=tol, **case)
    assert made  # the per-chunk operand ran


def _cfg(compute_dtype=torch.float32, margin="arcface", smoothing=0.0, K=1, impl="gemm"):
    import copy

    from shardfc.head.kernels import ShardConfig

    return ShardConfig(margin=copy.deepcopy(MARGINS[margin]), num_classes=C, label_smoothing=smoothing, chunk_size=None,
                       compute_dtype=compute_dtype, stats_dtype=torch.float32, subcenters=K, impl=impl)


def test_the_kernels_precision_and_dtypes_follow_the_compute_dtype(monkeypatch):
    """fp32 matmuls in full fp32 unless torch allows TF32; the operands rounded to the compute dtype,
    multiplied in it — but bf16 in fp32 under the interpreter, which has no bf16 dot."""
    import triton.language as tl

    from shardfc.head.fused import shard

    matmul, before = torch.backends.cuda.matmul, torch.backends.cuda.matmul.allow_tf32  # not a plain attribute
    try:
        matmul.allow_tf32 = False
        assert [shard._precision(_cfg(dt)) for dt in (torch.float32, torch.bfloat16, torch.float16)] == ["ieee", "tf32", "tf32"]
        assert shard._dtypes(_cfg(torch.bfloat16)) == dict(COMPUTE=tl.bfloat16, DOT=tl.float32, PRECISION="tf32")
        assert shard._dtypes(_cfg(torch.float16)) == dict(COMPUTE=tl.float16, DOT=tl.float16, PRECISION="tf32")
        assert shard._dtypes(_cfg(torch.float32)) == dict(COMPUTE=tl.float32, DOT=tl.float32, PRECISION="ieee")
        matmul.allow_tf32 = True
        assert shard._precision(_cfg(torch.float32)) == "tf32"
    finally:
        matmul.allow_tf32 = before
    monkeypatch.setattr(shard, "interpreting", lambda: False)
    assert shard._dtypes(_cfg(torch.bfloat16))["DOT"] == tl.bfloat16


def test_the_operands_a_cast_once_w_as_stored_unless_its_rows_are_strided():
    from shardfc.head.fused import shard

    a, w = torch.randn(4, 6), torch.randn(10, 6)
    a_k, w_k, n_cls, K = shard._common(a, w, _cfg(torch.bfloat16, K=2), None)
    assert (a_k.dtype, a_k.is_contiguous(), w_k is w, n_cls, K) == (torch.bfloat16, True, True, 5, 2)
    assert torch.equal(a_k, a.bfloat16())
    a_k, w_k, n_cls, _ = shard._common(a.t().contiguous().t(), w, _cfg(), torch.tensor([1, 3, 5, 7]))
    assert a_k.is_contiguous() and torch.equal(a_k, a) and n_cls == 4  # the rows scored, not the shard's
    strided = torch.randn(6, 10).t()  # stride(1) == 10
    _, w_k, n_cls, _ = shard._common(a, strided, _cfg(), None)
    assert w_k.stride() == (6, 1) and torch.equal(w_k, strided) and n_cls == 10
    assert shard._scored(w, None) == 10 and shard._scored(w, torch.tensor([2, 4, 6])) == 3


@pytest.mark.parametrize("margin,smoothing", [("arcface", 0.1), ("sphereface", 0.0)])
def test_a_shard_without_classes_has_the_statistics_of_an_empty_set(margin, smoothing):
    """No class on the shard: max −inf, sums 0, no target here (column −1, sub-centre 0, value and
    derivatives 0), the smoothing's sum and the norm's derivative only where they exist; and its
    backward: no gradient for the embeddings, the weight's (of no rows) empty."""
    from shardfc.head.fused import shard

    B = 3
    a, w, labels, norms = torch.randn(B, D), torch.empty(0, D), torch.full((B,), -1), torch.rand(B) + 1
    cfg = _cfg(margin=margin, smoothing=smoothing)
    st = shard.shard_forward(a, w, labels, norms, cfg)
    zeros = torch.zeros(B)
    assert torch.equal(st.row_max, torch.full((B,), float("-inf"))) and st.row_max.dtype == torch.float32
    for t in (st.sum_exp, st.target, st.target_draw):
        assert torch.equal(t, zeros) and t.dtype == torch.float32
    assert (st.logit_sum is None) == (smoothing == 0) and (st.logit_sum is None or torch.equal(st.logit_sum, zeros))
    needs_norm = cfg.margin.needs_norm
    assert needs_norm == (margin == "sphereface")
    assert (st.target_dnorm is None) != needs_norm and (st.target_dnorm is None or torch.equal(st.target_dnorm, zeros))
    assert (st.buffers, st.inv, st.operand) == (None, None, None)
    assert torch.equal(st.tcol, torch.full((B,), -1, dtype=torch.int32))
    assert torch.equal(st.tsub, torch.zeros(B, dtype=torch.int32))
    assert torch.equal(st.on_shard, torch.zeros(B, dtype=torch.bool))
    grad_sq = torch.full((1,), 7.0)
    grad_a, grad_w, _ = shard.shard_backward(a, w, labels, norms, st, torch.zeros(B), torch.ones(B), torch.full((B,), 0.5),
                                             cfg, grad_sq=grad_sq)
    assert torch.equal(grad_a, torch.zeros(B, D)) and grad_w.shape == (0, D) and float(grad_sq) == 0.0


def test_a_fused_update_of_a_copy_of_the_weight_is_refused():
    from shardfc.head.fused import chunks, shard

    w = torch.randn(8, D)
    a, labels = torch.randn(2, D), torch.tensor([1, 3])
    cfg = _cfg()
    st = shard.shard_forward(a, w, labels, None, cfg)
    update = chunks.RowUpdate(w.clone(), None, 0.1, 0.0, 0.0, False)
    with pytest.raises(ValueError) as err:
        shard.shard_backward(a, w, labels, None, st, st.row_max, st.sum_exp, torch.ones(2), cfg, update=update)
    assert str(err.value) == "a fused update needs the shard's weight itself (contiguous rows), not a copy of it"


def test_the_target_rows_gradient_reads_the_embeddings_before_their_cast():
    """bf16 compute: the embeddings given in fp32 and the same embeddings rounded to bf16 first make
    the same products (the kernels read the bf16 cast either way), so every weight-gradient row is
    the same — but the target rows, whose terms are formed from the embeddings as given."""
    from shardfc.head.fused import shard

    g = torch.Generator().manual_seed(5)
    a, w = torch.randn(6, D, generator=g), torch.randn(C, D, generator=g)
    labels = torch.tensor([3, 10, -1, 3, 40, 52])
    cfg = _cfg(torch.bfloat16, margin="cosface")
    grads = []
    for x in (a, a.bfloat16().float()):
        st = shard.shard_forward(x, w, labels, None, cfg)
        coef = torch.full((6,), 1 / 6)
        grads.append(shard.shard_backward(x, w, labels, None, st, st.row_max, st.sum_exp, coef, cfg)[1])
    targets = torch.zeros(C, dtype=torch.bool)
    targets[[3, 10, 40, 52]] = True
    assert torch.equal(grads[0][~targets], grads[1][~targets])
    assert bool((grads[0][targets] != grads[1][targets]).any(dim=1).all())



@pytest.mark.parametrize("K,dtype", [(1, torch.float32), (2, torch.bfloat16)])
def test_target_logits_from_the_label_rows_alone(K, dtype):
    """Per sample with a label here (0 included; −1: elsewhere): the best of its K sub-centres'
    cosines (the rows normalised, in the stats dtype, bf16 rows read as they are), that sub-centre,
    and the margin's value and derivative there; zeros elsewhere. Against plain cosines in fp64."""
    from shardfc.head.fused import shard

    g = torch.Generator().manual_seed(7)
    a, w = torch.randn(4, D, generator=g), torch.randn(6 * K, D, generator=g).to(dtype)
    labels = torch.tensor([0, 5, -1, 2])
    cfg = _cfg(margin="cosface", K=K)
    on, sub, value, d_raw, d_norm = shard.target_logits(a, w, labels, None, cfg, None)
    assert on.tolist() == [True, True, False, True] and d_norm is None
    wd = w.double()
    cos = torch.stack([(wd[[int(y) * K + k for y in labels.clamp(min=0)]] @ a.double().t()).diagonal()
                       / wd[[int(y) * K + k for y in labels.clamp(min=0)]].norm(dim=1) for k in range(K)], dim=1)
    best, want_sub = cos.max(dim=1)
    want_value, want_draw, _ = cfg.margin.target(best.float(), None)
    assert sub.dtype == torch.int32 and sub[on].tolist() == want_sub[on].tolist()
    for got, want in ((value, want_value), (d_raw, want_draw)):
        assert got.dtype == torch.float32 and float(got[2]) == 0.0
        assert torch.allclose(got[on].double(), want[on].double(), rtol=D * 2.0**-24 * 64, atol=D * 2.0**-24 * 64)
