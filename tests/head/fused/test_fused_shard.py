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
    every_other = torch.randn(10, 12)[:, ::2]  # stride(1) == 2
    _, w_k, _, _ = shard._common(a, every_other, _cfg(), None)
    assert w_k.stride() == (6, 1) and torch.equal(w_k, every_other)
    assert shard._scored(w, None) == 10 and shard._scored(w, torch.tensor([2, 4, 6])) == 3


@pytest.mark.parametrize("margin,smoothing", [("arcface", 0.1), ("sphereface", 0.0)])
def test_a_shard_without_classes_has_the_statistics_of_an_empty_set(margin, smoothing):
    """No class on the shard: max −inf, sums 0, no target here (column −1, sub-centre 0, value and
    derivatives 0), the smoothing's sum and the norm's derivative only where they exist; and its
    backward: no gradient for the embeddings, the weight's (of no rows) empty."""
    from shardfc.head.fused import chunks, shard

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
    assert st.tcol.dtype == st.tsub.dtype == torch.int32
    grad_sq = torch.full((1,), 7.0)
    grad_a, grad_w, _ = shard.shard_backward(a, w, labels, norms, st, torch.zeros(B), torch.ones(B), torch.full((B,), 0.5),
                                             cfg, grad_sq=grad_sq)
    assert torch.equal(grad_a, torch.zeros(B, D)) and grad_w.shape == (0, D) and float(grad_sq) == 0.0
    before = torch.get_default_dtype()
    try:  # the statistics in the stats dtype, not torch's default
        torch.set_default_dtype(torch.float64)
        st64 = shard.shard_forward(a, w, labels, norms, cfg)
    finally:
        torch.set_default_dtype(before)
    assert all(t.dtype == torch.float32 for t in (st64.row_max, st64.sum_exp, st64.target, st64.target_draw))
    assert st64.tcol.dtype == torch.int32
    update = chunks.RowUpdate(w, None, 0.1, 0.0, 0.0, False)  # a fused step over no rows: nothing to zero
    grad_a, grad_w, _ = shard.shard_backward(a, w, labels, norms, st, torch.zeros(B), torch.ones(B), torch.full((B,), 0.5),
                                             cfg, update=update)
    assert torch.equal(grad_a, torch.zeros(B, D)) and grad_w is None


def test_a_partial_fc_step_sampling_none_of_the_shard_s_classes_leaves_its_gradient():
    """Partial FC sampled no class of this shard (an empty row index): its existing ``.grad`` (of
    every shard row) is added nothing, not zeroed; ``grad_a`` is zero."""
    from shardfc.head.fused import shard

    B = 3
    a, w, labels = torch.randn(B, D), torch.randn(10, D), torch.full((B,), -1)
    cfg = _cfg()
    rows = torch.empty(0, dtype=torch.int64)
    st = shard.shard_forward(a, w, labels, None, cfg, rows=rows)
    grad = torch.randn(10, D)
    want = grad.clone()
    grad_a, grad_w, _ = shard.shard_backward(a, w, labels, None, st, st.row_max, torch.ones(B), torch.full((B,), 0.5), cfg,
                                             grad_w_out=grad, rows=rows)
    assert grad_w is None and torch.equal(grad, want) and torch.equal(grad_a, torch.zeros(B, D))


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



def test_tiny_per_sample_weights_keep_the_fp16_weight_gradients_bits():
    """The weight GEMM reads the embeddings times the per-sample weights, in the compute dtype. In
    fp16, weights near 1e-6 would make those products subnormal (a few bits left), so the backward
    scales the weights to at most 1 and puts their scale back in fp32: weights of 1e-6 give exactly
    1e-6 times the gradient of weights of 1, up to fp32 rounding (without the scaling: ≈ 1e-2)."""
    from shardfc.head.fused import shard

    g = torch.Generator().manual_seed(6)
    a, w = torch.randn(6, D, generator=g), torch.randn(C, D, generator=g)
    labels = torch.tensor([3, 10, -1, 3, 40, 52])
    cfg = _cfg(torch.float16, margin="normsoftmax")  # s = 16: nearly every class's gradient is above fp16's range's end
    st = shard.shard_forward(a, w, labels, None, cfg)
    one, tiny = (shard.shard_backward(a, w, labels, None, st, st.row_max, st.sum_exp, torch.full((6,), c), cfg)[1]
                 for c in (1.0, 1e-6))
    assert int((one != 0).any(dim=1).sum()) >= C - 3
    assert rel(tiny / 1e-6, one) < 1e-5


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


SHARD_CASES = {
    "arcface": dict(),
    "cosface_smoothing": dict(margin="cosface", smoothing=0.1),
    "sphereface_norms": dict(margin="sphereface"),
    "adaface_feature_norms": dict(margin="adaface", feature_norms=True),
    "raw_softmax": dict(margin="softmax"),
    "partial_fc_subcenters": dict(K=2, rows=True),
    "filter_smoothing": dict(filter=0.05, smoothing=0.2),
    "filter_partial_fc": dict(filter=0.05, rows=True, K=2),
    "added_into_grad": dict(accumulate=True),
    "added_into_grad_partial_fc": dict(accumulate=True, rows=True, smoothing=0.1),
    "sphereface_smoothing": dict(margin="sphereface", smoothing=0.2),
    "magface_feature_norms_smoothing": dict(margin="magface", feature_norms=True, smoothing=0.1),
    "bf16_centres": dict(centres=torch.bfloat16, tol=2e-2),
    "bf16_embeddings": dict(embeddings=torch.bfloat16, tol=2e-2),
    "one_class": dict(n_cls=1),
    "above_the_operand_budget": dict(budget=0),
}


def _shard_inputs(case, B=7):
    """A shard of ``n_cls`` classes (``K`` rows each); with ``rows``, Partial FC's 6 sampled classes
    (class-major, ``K`` rows each) and labels indexing them; with ``filter``, the unit target rows."""
    g = torch.Generator().manual_seed(21)
    K, n_cls = case.get("K", 1), case.get("n_cls", C)  # C: two class splits under the interpreter
    a, w = torch.randn(B, D, generator=g), torch.randn(n_cls * K, D, generator=g)
    a = a / a.norm(dim=1, keepdim=True)  # unit embeddings, as the head hands them to its shards
    rows = None
    labels = torch.randint(0, n_cls, (B,), generator=g)
    if case.get("rows"):
        cls = torch.randperm(n_cls, generator=g)[:6]
        rows = (cls.unsqueeze(1) * K + torch.arange(K)).flatten()
        labels = torch.randint(0, 6, (B,), generator=g)
    labels[1] = -1  # a label elsewhere
    labels[2] = 0  # the first column
    own = labels.clamp(min=0) * K if rows is None else rows[labels.clamp(min=0) * K]
    tr = w[own] / w[own].norm(dim=1, keepdim=True) if case.get("filter") else None
    a, w = a.to(case.get("embeddings", torch.float32)), w.to(case.get("centres", torch.float32))
    return a, w, labels, torch.rand(B, generator=g) + 1, tr, rows


@pytest.mark.parametrize("case", list(SHARD_CASES.values()), ids=list(SHARD_CASES))
def test_shard_forward_and_backward_equal_the_torch_kernels(impl, case, monkeypatch):
    """One shard called directly: every statistic, ``grad_a``, the weight gradient (returned, or
    added into ``.grad``, at the sampled rows under Partial FC) and the norm's gradient equal
    :mod:`shardfc.head.kernels`' (the reference implementation) to fp32 accuracy (bf16 inputs: to
    the file's bf16 tolerance), in the dtypes torch returns them in; the label columns and
    sub-centres int32."""
    import dataclasses

    from shardfc.head import kernels
    from shardfc.head.fused import chunks, shard

    if "budget" in case:
        monkeypatch.setattr(chunks, "OPERAND_BYTES", case["budget"])
    tol = case.get("tol", FP32)

    a, w, labels, norms, tr, rows = _shard_inputs(case)
    cfg = _cfg(margin=case.get("margin", "arcface"), smoothing=case.get("smoothing", 0.0), K=case.get("K", 1),
               impl=impl)
    cfg = dataclasses.replace(cfg, filter_threshold=case.get("filter"))
    ref_cfg = dataclasses.replace(cfg, impl="torch")
    ref = kernels.shard_forward(a, w, labels, norms, ref_cfg, tr, rows)
    got = shard.shard_forward(a, w, labels, norms, cfg, tr, rows)
    for name in ("row_max", "sum_exp", "target", "logit_sum", "target_draw", "target_dnorm"):
        r, x = getattr(ref, name), getattr(got, name)
        assert (x is None) == (r is None), name
        if r is not None:  # infinities (the filter's −inf logits in the smoothing's sum) where torch has them
            fin = torch.isfinite(r)
            assert torch.equal(x[~fin], r[~fin]) and x.dtype == torch.float32, name
            assert rel(x[fin], r[fin]) < tol, (name, rel(x[fin], r[fin]))
    assert got.tcol.dtype == got.tsub.dtype == torch.int32 and (got.operand is None) == ("budget" in case)
    coef = torch.rand(a.shape[0], generator=torch.Generator().manual_seed(2)) + 0.5
    feature_norms = case.get("feature_norms", False)
    out = {}
    for name, fn, st, c in (("torch", kernels.shard_backward, ref, ref_cfg), (impl, shard.shard_backward, got, cfg)):
        grad = torch.full_like(w, 0.25) if case.get("accumulate") else None
        res = fn(a, w, labels, norms, st, ref.row_max, ref.sum_exp, coef, c, grad_w_out=grad, target_rows=tr,
                 feature_norms=feature_norms, rows=rows)
        out[name] = (res[0], res[1] if grad is None else grad, res[2], res[1] is None)
    (ga, gw, gn, none), (ga_r, gw_r, gn_r, none_r) = out[impl], out["torch"]
    assert none == none_r == bool(case.get("accumulate"))
    assert (ga.dtype, gw.dtype) == (ga_r.dtype, gw_r.dtype) == (a.dtype, w.dtype)
    assert rel(ga.float(), ga_r.float()) < tol and rel(gw.float(), gw_r.float()) < tol
    assert (gn is None) == (gn_r is None) and (gn is None or rel(gn, gn_r) < tol)


@pytest.mark.parametrize("gpu", [False, True], ids=["", "as_on_a_gpu"])
@pytest.mark.parametrize("case", ["rows_filter_smooth", "operand"])
def test_the_fused_forward_on_the_meta_device_tells_the_plan_what_it_reads_and_writes(case, gpu, monkeypatch):
    """``shardfc plan`` runs the forward on meta tensors: one ``lse_forward`` launch reading the
    embeddings, the scored rows (through Partial FC's index), the index, the norms, the target
    columns and values and the filter's target rows; writing its three ``[B, splits]`` statistics
    (two without smoothing: ``plsum`` is ``pmax``), fp32 on meta; ``2·B·n·K·D`` flops. With the step's
    operand: the compact rows alone."""
    from shardfc.head.fused import autotune, shard, traffic

    meta = torch.device("meta")
    B, n_cls, K, Dm = 5, 7, 3, 8
    if gpu:  # the splits sized for the meta device's SMs and the batch, as on a GPU
        monkeypatch.setattr(autotune, "interpreting", lambda: False)
    a_k, w = torch.empty(B, Dm, device=meta), torch.empty(40, Dm, device=meta)
    tcol, tval = torch.empty(B, dtype=torch.int32, device=meta), torch.empty(B, device=meta)
    full = case == "rows_filter_smooth"
    rows = torch.empty(n_cls * K + 4, dtype=torch.int64, device=meta)[2:2 + n_cls * K] if full else None
    inv = torch.empty(40, device=meta) if full else None
    tr = torch.empty(B, Dm, device=meta) if full else None
    if not full:
        w = w[:n_cls * K]
    seen = []

    def part(r):
        return ("rows", r.part[2], r.part[3], r.nbytes) if r.part[0] == "rows" else (r.part, r.nbytes)

    before = torch.get_default_dtype()
    try:  # fp32 statistics whatever torch's default dtype
        torch.set_default_dtype(torch.float64)
        with traffic.recording(lambda kernel, reads, writes, flops: seen.append(
                (kernel, [part(r) for r in reads], [part(r) for r in writes], flops))):
            pmax, psum, plsum = shard._fused_forward(a_k, w, rows, inv, tr, tcol, tval, n_cls, K,
                                                     _cfg(K=K, impl="triton"), full, normalize=full)
    finally:
        torch.set_default_dtype(before)
    n, splits = n_cls * K, -(-n_cls // autotune.class_splits(n_cls, B, meta))
    assert [(t.device, t.dtype, tuple(t.shape)) for t in (pmax, psum, plsum)] == [(meta, torch.float32, (B, splits))] * 3
    assert (plsum is pmax) == (not full) and psum is not pmax
    reads = [(("span", 0, B * Dm * 4), B * Dm * 4)]
    if full:
        reads += [("rows", 2, n, n * Dm * 4), (("span", 2 * 8, n * 8), n * 8), (("span", 0, n * 4), n * 4)]
    else:
        reads += [(("span", 0, n * Dm * 4), n * Dm * 4)]
    reads += [(("span", 0, B * 4), B * 4)] * 2 + ([(("span", 0, B * Dm * 4), B * Dm * 4)] if full else [])
    outs = [(("span", 0, B * splits * 4), B * splits * 4)] * (3 if full else 2)
    assert seen == [("lse_forward", reads, outs, 2.0 * B * n * Dm)]


@pytest.mark.parametrize("margin", ["arcface", "softmax"])
def test_the_fused_update_keeps_the_next_operand_and_the_next_forward_takes_it(impl, margin):
    """bf16 compute, every row scored: the backward's fused update writes the next step's operand
    over the step's and keeps it (with the norms exactly when the margin normalises); the next
    forward scores that very tensor, and its statistics are those of a fresh forward (within bf16
    rounding of the operand). A Partial FC step neither takes nor keeps it, and forgets it."""
    from shardfc.head.fused import chunks, shard

    g = torch.Generator().manual_seed(4)
    a, w = torch.randn(6, D, generator=g), torch.randn(16, D, generator=g)
    a = a / a.norm(dim=1, keepdim=True)
    labels = torch.tensor([3, -1, 0, 15, 7, 3])
    cfg = _cfg(torch.bfloat16, margin=margin, impl=impl)
    normalize = cfg.margin.normalize_weights
    nxt = chunks.NextOperand()
    st = shard.shard_forward(a, w, labels, None, cfg, next_operand=nxt)
    assert st.operand is not None and (st.inv is not None) == normalize
    coef = torch.full((6,), 1 / 6)
    update = chunks.RowUpdate(w, None, 0.5, 0.0, 0.0, False)
    version = w._version
    assert shard.shard_backward(a, w, labels, None, st, st.row_max, st.sum_exp, coef, cfg, update=update,
                                next_operand=nxt)[1] is None
    assert w._version > version  # the update bumps it, and the operand is keyed after
    assert nxt.operand is st.operand and nxt.inv is st.inv
    again = shard.shard_forward(a, w, labels, None, cfg, next_operand=nxt)
    fresh = shard.shard_forward(a, w, labels, None, cfg)
    assert again.operand is nxt.operand and fresh.operand is not nxt.operand and (again.inv is st.inv)
    for name in ("row_max", "sum_exp", "target"):
        assert rel(getattr(again, name), getattr(fresh, name)) < 2e-2, name
    rows = torch.arange(0, 16, 2)
    sampled = shard.shard_forward(a, w, labels.clamp(max=rows.numel() - 1), None, cfg, rows=rows, next_operand=nxt)
    assert sampled.operand is not nxt.operand and nxt.operand is again.operand  # not taken (nor forgotten) here
    shard.shard_backward(a, w, labels.clamp(max=rows.numel() - 1), None, sampled, sampled.row_max, sampled.sum_exp, coef,
                         cfg, rows=rows, update=update, next_operand=nxt)
    assert nxt.operand is None and nxt.inv is None


def test_target_logits_score_a_row_of_norm_exactly_norm_eps_as_a_unit_row():
    """A target row whose norm is exactly ``NORM_EPS`` is normalised (the torch path's rule: rows
    *below* it count as zero vectors): its cosine is the embedding's first coordinate. Embeddings
    given in bf16 are read in the stats dtype."""
    from shardfc.head.fused import shard
    from shardfc.head.normalize import NORM_EPS

    w = torch.zeros(3, D)
    w[1, 0] = NORM_EPS
    assert float(torch.linalg.vector_norm(w[1])) == float(torch.tensor(NORM_EPS))
    w[2] = 1.0
    a = torch.randn(2, D, generator=torch.Generator().manual_seed(3)).bfloat16()
    cfg = _cfg(margin="normsoftmax")
    on, sub, value, _, _ = shard.target_logits(a, w, torch.tensor([1, 2]), None, cfg, None)
    want = torch.stack([a[0, 0].float(), a[1].float().sum() / D**0.5]) * cfg.margin.s
    assert value.dtype == torch.float32 and torch.allclose(value, want, rtol=4 * D * 2.0**-24, atol=0.0)


@pytest.mark.parametrize("impl_", ["gemm", "triton"])
def test_the_config_s_impl_picks_the_gemm_chunks_or_the_fused_kernel_and_the_step_s_operand(impl_, monkeypatch):
    """``impl="gemm"``: the chunks' statistics over the step's operand (no chunk makes its own);
    ``impl="triton"``: the fused online-LSE kernel, over the step's operand unless the filter reads W."""
    from shardfc.head.fused import chunks, shard

    calls = []
    for mod, name in ((chunks, "forward_stats"), (shard, "_fused_forward"), (chunks, "operand_rows")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    a, w, labels, _, tr, _ = _shard_inputs({"filter": 0.05})
    st = shard.shard_forward(a, w, labels, None, _cfg(impl=impl_))
    assert st.operand is not None
    want = "forward_stats" if impl_ == "gemm" else "_fused_forward"
    assert calls == [want]
    calls.clear()
    if impl_ == "triton":
        seen = []
        real = shard._fused_forward
        monkeypatch.setattr(shard, "_fused_forward", lambda a_k, w_, *r, **k: seen.append(w_) or real(a_k, w_, *r, **k))
        st = shard.shard_forward(a, w, labels, None, _cfg(impl=impl_))
        import dataclasses

        shard.shard_forward(a, w, labels, None, dataclasses.replace(_cfg(impl=impl_), filter_threshold=0.05), tr)
        assert seen[0] is not w and seen[0].shape == w.shape and seen[1] is w  # the operand, then W itself


def test_the_config_s_chunk_scale_reaches_the_gemm_chunks_forward_and_backward(monkeypatch):
    """``cfg.chunk_scale`` sizes the GEMM path's class chunks in both passes (the plan's and
    ``shardfc tune``'s knob): :func:`.chunks.forward_stats` and :func:`.chunks.backward` get it."""
    import dataclasses

    from shardfc.head.fused import chunks, shard

    scales = []
    for name in ("forward_stats", "backward"):
        real = getattr(chunks, name)
        monkeypatch.setattr(chunks, name, lambda *a, _real=real, **k: scales.append(k["chunk_scale"]) or _real(*a, **k))
    a, w, labels, _, _, _ = _shard_inputs({})
    cfg = dataclasses.replace(_cfg(), chunk_scale=2)
    st = shard.shard_forward(a, w, labels, None, cfg)
    shard.shard_backward(a, w, labels, None, st, st.row_max, st.sum_exp, torch.ones(a.shape[0]), cfg)
    assert scales == [2, 2]


@pytest.mark.parametrize("K,filter_,margin,budget,tf32", [
    (1, False, "arcface", None, False), (1, False, "arcface", 0, True), (2, True, "arcface", None, False),
    (2, False, "softmax", None, False)])
def test_the_fused_forward_is_tuned_per_sub_centres_filter_precision_and_normalisation(K, filter_, margin, budget, tf32,
                                                                                         monkeypatch):
    """The fused kernel launches through the tuner of its configs (:func:`.autotune.lse_forward`:
    sub-centres, filter, fp32 precision, rows normalised in registers — above the operand budget;
    some of them share one), keyed by the class and batch counts rounded up to powers of two
    (53 → 64, 7 → 8)."""
    import dataclasses

    from shardfc.head.fused import autotune, chunks, shard

    launched = []
    real = autotune.launch
    monkeypatch.setattr(autotune, "launch", lambda tuned, grid, *a, **k: launched.append((tuned, a[-2:])) or real(
        tuned, grid, *a, **k))
    if budget is not None:
        monkeypatch.setattr(chunks, "OPERAND_BYTES", budget)
    a, w, labels, _, tr, _ = _shard_inputs({"filter": 0.05 if filter_ else None, "K": K})
    cfg = dataclasses.replace(_cfg(margin=margin, K=K, impl="triton"), filter_threshold=0.05 if filter_ else None)
    matmul, before = torch.backends.cuda.matmul, torch.backends.cuda.matmul.allow_tf32  # not a plain attribute
    try:
        matmul.allow_tf32 = tf32
        shard.shard_forward(a, w, labels, None, cfg, tr)
    finally:
        matmul.allow_tf32 = before
    # the kernel normalises the rows where it reads W: with the filter or above the budget
    normalize = (filter_ or budget is not None) and cfg.margin.normalize_weights
    want = autotune.lse_forward(K, filter_, "tf32" if tf32 else "ieee", normalize)
    assert launched == [(want, (64, 8))]
