"""The head in one process (single shard and devices mode): the loss and gradients against the
dense float64 reference, AMP, bad input, predict, torch's state dict with the sampling step, the
plan's chunks, batches of one and of none, the constructor's refusals.

(Long because it is the one process-level test of the head's public face; the cross-rank cases
live in test_module_distributed.py, the implementation choice in test_module_impl_agreement.py,
the hand-over to the fused kernels in test_module_fused_handover.py.)"""

import itertools
import math

import pytest
import torch

import shardfc
from shardfc import margins as M
from shardfc.head.module import INIT_BLOCK, init_rows
from shardfc.parallel.context import DistContext

C, D, B = 13, 5, 9
ALL_MARGINS = [
    M.Softmax(), M.NormSoftmax(16.0), M.CosFace(64.0, 0.35), M.ArcFace(64.0, 0.5),
    M.ArcFace(32.0, 0.5, easy_margin=True), M.Combined(32.0, 0.9, 0.4, 0.15), M.SphereFace(4), M.SphereFace(3, 2.0),
]


def _data(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, generator=g, dtype=dtype) * 2
    y = torch.randint(0, C, (B,), generator=g)
    return x, y


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def _compare(head, x, y, margin, eps=0.0, reduction="mean", ignore_index=-1, tol=1e-10):
    xa = x.clone().requires_grad_()
    loss = head(xa, y)
    g = torch.linspace(-1, 2, loss.numel(), dtype=loss.dtype).reshape(loss.shape) if reduction == "none" else torch.tensor(0.7, dtype=loss.dtype)
    loss.backward(g)
    W = torch.cat([w.detach().cpu() for w in head.shard_weights]).requires_grad_()
    xr = x.clone().requires_grad_()
    ref = shardfc.reference_loss(xr, W, y, margin, label_smoothing=eps, ignore_index=ignore_index, reduction=reduction)
    ref.backward(g)
    gw = torch.cat([w.grad.cpu() for w in head.shard_weights])
    assert _rel(loss.detach(), ref.detach()) < tol
    assert _rel(xa.grad, xr.grad) < tol
    assert _rel(gw, W.grad) < tol


@pytest.mark.parametrize("margin", ALL_MARGINS, ids=repr)
@pytest.mark.parametrize("layout", ["single", "devices3", "single_chunk4", "devices2_chunk3"])
def test_every_margin_every_layout(margin, layout):
    devices = {"devices3": ["cpu"] * 3, "devices2_chunk3": ["cpu"] * 2}.get(layout)
    chunk = {"single_chunk4": 4, "devices2_chunk3": 3}.get(layout)
    head = shardfc.ShardedMarginHead(D, C, margin=margin, devices=devices, chunk_size=chunk, dtype=torch.float64)
    x, y = _data()
    _compare(head, x, y, margin)


@pytest.mark.parametrize(
    "eps,reduction,ignore,chunk,devices",
    list(itertools.product([0.0, 0.15], ["mean", "sum", "none"], [False, True], [None, 2], [None, 4])),
)
def test_smoothing_reductions_ignore_index(eps, reduction, ignore, chunk, devices):
    margin = M.CosFace(30.0, 0.3)
    head = shardfc.ShardedMarginHead(
        D, C, margin=margin, label_smoothing=eps, reduction=reduction, chunk_size=chunk,
        devices=["cpu"] * devices if devices else None, dtype=torch.float64,
    )
    x, y = _data(1)
    if ignore:
        y[::2] = -1
    _compare(head, x, y, margin, eps=eps, reduction=reduction)


def test_more_devices_than_classes_and_all_ignored():
    head = shardfc.ShardedMarginHead(D, 3, margin=M.ArcFace(), devices=["cpu"] * 5, dtype=torch.float64)
    assert [len(r) for r in head.shard_ranges] == [1, 1, 1, 0, 0]
    x, _ = _data()
    y = torch.randint(0, 3, (B,))
    _compare(head, x, y, M.ArcFace())
    xa = x.clone().requires_grad_()
    loss = head(xa, torch.full((B,), -1))
    loss.backward()
    assert loss.item() == 0.0 and xa.grad.abs().sum() == 0


def test_empty_batch_gives_zero_loss_connected_to_parameters():
    head = shardfc.ShardedMarginHead(D, C)
    loss = head(torch.zeros(0, D, requires_grad=True), torch.zeros(0, dtype=torch.long))
    loss.backward()
    assert loss.item() == 0.0 and head.weight.grad.abs().sum() == 0
    none = shardfc.ShardedMarginHead(D, C, reduction="none")(torch.zeros(0, D), torch.zeros(0, dtype=torch.long))
    assert none.shape == (0,)


def test_devices_mode_parameters_in_class_order():
    head = shardfc.ShardedMarginHead(D, C, devices=["cpu", "cpu", "cpu"])
    assert [p.shape[0] for p in head.parameters()] == [5, 4, 4]
    full = torch.cat(list(head.parameters())).detach()
    assert torch.equal(full, init_rows(0, C, D, 0))  # the same logical weights as any sharding
    assert head.class_range == range(0, C)


def test_int32_labels_and_large_logits_stay_finite():
    head = shardfc.ShardedMarginHead(D, C, margin=M.Softmax())
    x = torch.randn(B, D) * 1e4  # logits ~1e2 · 1e4: log-sum-exp form, no overflow
    loss = head(x, torch.randint(0, C, (B,), dtype=torch.int32))
    assert torch.isfinite(loss)


def test_zero_embedding_under_normalised_margin_has_no_nan():
    for margin in (M.ArcFace(), M.CosFace(), M.SphereFace(4)):
        head = shardfc.ShardedMarginHead(D, C, margin=margin)
        x = torch.randn(4, D)
        x[1] = 0
        x.requires_grad_()
        loss = head(x, torch.tensor([0, 1, 2, 3]))
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(x.grad).all() and torch.isfinite(head.weight.grad).all()
        if margin.normalize_embeddings:
            assert x.grad[1].abs().sum() == 0


def test_predict_single_and_devices():
    x, _ = _data(3)
    for devices, chunk in ((None, None), (["cpu"] * 3, 2)):
        head = shardfc.ShardedMarginHead(D, C, margin=M.ArcFace(), devices=devices, chunk_size=chunk, dtype=torch.float64)
        scores, ids = head.predict(x, k=4)
        W = torch.cat([w.detach() for w in head.shard_weights])
        dense = shardfc.head.reference.reference_logits(x, W, torch.full((B,), -1), M.ArcFace())
        ref_s, ref_i = dense.topk(4, dim=1)
        assert torch.equal(ids, ref_i) and _rel(scores, ref_s) < 1e-12


# ---------------------------------------------------------------- mixed precision
def test_bf16_autocast_close_to_fp32():
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    y = torch.randint(0, 200, (64,))
    results = {}
    for amp in (False, True):
        head = shardfc.ShardedMarginHead(32, 200, margin=M.ArcFace(64.0, 0.5), devices=["cpu", "cpu"])
        xa = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = head(xa, y)
        assert loss.dtype == torch.float32  # statistics and loss in fp32
        loss.backward()
        results[amp] = (loss.detach(), xa.grad, torch.cat([w.grad for w in head.parameters()]))
    (l32, gx32, gw32), (l16, gx16, gw16) = results[False], results[True]
    # Stated tolerance: bf16 has an 8-bit mantissa; at s=64 the loss stays within 2%.
    assert abs(l16 - l32) / l32 < 2e-2
    for a, b in ((gx16, gx32), (gw16, gw32)):
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99


def test_fp16_embeddings_at_scale_64_do_not_overflow():
    head = shardfc.ShardedMarginHead(32, 100, margin=M.CosFace(64.0, 0.35))
    x = (torch.randn(16, 32) * 300).half().requires_grad_()  # fp16 backbone output
    loss = head(x, torch.randint(0, 100, (16,)))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad.float()).all()
    assert x.grad.dtype == torch.float16


def test_grad_scaler_scale_reaches_every_gradient():
    torch.manual_seed(0)
    x, y = torch.randn(8, D), torch.randint(0, C, (8,))
    grads = {}
    for use_scaler in (False, True):
        head = shardfc.ShardedMarginHead(D, C, devices=["cpu", "cpu"])
        xa = x.clone().requires_grad_()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, enabled=use_scaler)
        scaler.scale(head(xa, y)).backward()
        grads[use_scaler] = (xa.grad.clone(), [w.grad.clone() for w in head.parameters()])
        opt = torch.optim.SGD(head.parameters(), lr=0.1)
        scaler.step(opt)  # unscales: a finite step
        scaler.update()
        assert all(torch.isfinite(w).all() for w in head.parameters())
    (gx, gw), (sx, sw) = grads[False], grads[True]
    torch.testing.assert_close(sx, gx * 2.0**12)
    for a, b in zip(sw, gw):
        torch.testing.assert_close(a, b * 2.0**12)


# ---------------------------------------------------------------- bad input
GOOD_X, GOOD_Y = torch.randn(3, D), torch.tensor([0, 4, C - 1])


@pytest.mark.parametrize(
    "x,y,kind,text",
    [
        (GOOD_X, torch.tensor([0, C, 1]), ValueError, f"labels[1] = {C} is outside [0, num_classes={C})"),
        (GOOD_X, torch.tensor([0, -2, 1]), ValueError, "labels[1] = -2"),
        (GOOD_X, GOOD_Y.float(), TypeError, "labels must be an integer tensor, got dtype=torch.float32"),
        (GOOD_X, GOOD_Y.bool(), TypeError, "integer"),
        (GOOD_X, GOOD_Y[:2], ValueError, "labels has 2 entries but embeddings has 3 rows"),
        (GOOD_X, GOOD_Y.unsqueeze(1), ValueError, "labels must be 1-D"),
        (torch.randn(3, D + 2), GOOD_Y, ValueError, f"width {D + 2} but the head's embedding_dim is {D}"),
        (torch.randn(3, D, 1), GOOD_Y, ValueError, "must be 2-D"),
        (torch.randn(D), GOOD_Y, ValueError, "must be 2-D"),
        (torch.full((3, D), float("inf")), GOOD_Y, ValueError, "non-finite"),
        (torch.ones(3, D, dtype=torch.long), GOOD_Y, TypeError, "floating point"),
        ([[0.0] * D] * 3, GOOD_Y, TypeError, "torch.Tensor"),
    ],
)
@pytest.mark.parametrize("devices", [None, ["cpu", "cpu"]])
def test_bad_forward_input(x, y, kind, text, devices):
    head = shardfc.ShardedMarginHead(D, C, devices=devices)
    with pytest.raises(kind, match=__import__("re").escape(text)):
        head(x, y)


@pytest.mark.parametrize(
    "kwargs,kind,text",
    [
        (dict(devices=[]), ValueError, "devices must name at least one device"),
        (dict(chunk_size=0), ValueError, "chunk_size must be a positive integer, got 0"),
        (dict(chunk_size=-3), ValueError, "chunk_size"),
        (dict(sample_rate=0.0), ValueError, "sample_rate must be in (0, 1], got 0.0"),
        (dict(sample_rate=1.5), ValueError, "sample_rate must be in (0, 1], got 1.5"),
        (dict(label_smoothing=1.2), ValueError, "label_smoothing"),
        (dict(reduction="avg"), ValueError, "reduction must be 'mean', 'sum' or 'none', got 'avg'"),
        (dict(ignore_index=3), ValueError, "ignore_index=3 is a valid class id"),
        (dict(margin="arcface"), TypeError, "margin must be a shardfc.head.margins.Margin"),
        (dict(group=None, devices=["cpu"], num_classes=0), ValueError, "num_classes must be a positive integer, got 0"),
        # hashed as 64-bit words: each drew another seed's stream (-5 as 2**64 - 5) or was truncated (1.5 as 1)
        (dict(init_seed=-5), ValueError, "init_seed must be an int in [0, 2**63 - 1], got -5"),
        (dict(init_seed=2**64 + 1), ValueError, f"init_seed must be an int in [0, 2**63 - 1], got {2**64 + 1}"),
        (dict(init_seed=1.5), ValueError, "init_seed must be an int in [0, 2**63 - 1], got 1.5"),
        (dict(sample_rate=0.5, sample_seed=-1), ValueError, "sample_seed must be an int in [0, 2**63 - 1], got -1"),
        (dict(sample_seed="3"), ValueError, "sample_seed must be an int in [0, 2**63 - 1], got '3'"),
        # each shard's rows failed to allocate, as a TypeError ("Overflow when unpacking long long")
        (dict(num_classes=2**60, embedding_dim=2), ValueError, f"num_classes={2**60} x subcenters=1 x embedding_dim=2 = "
                                                               "2.306e+18 weights of 4 bytes: more than a torch tensor can "
                                                               "hold (2**63 - 1 bytes)"),
        (dict(num_classes=2**57, embedding_dim=4, subcenters=4), ValueError, "x subcenters=4 x embedding_dim=4 = 2.306e+18"),
        (dict(num_classes=2**59, embedding_dim=2, dtype=torch.float64), ValueError, "1.153e+18 weights of 8 bytes"),
        # torch's own named neither the argument nor the value ("Expected one of cpu, cuda, ... device type")
        (dict(device="xyz"), ValueError, "device must be a torch device such as 'cpu', 'cuda' or 'cuda:1', got 'xyz'"),
        (dict(device=[0]), ValueError, "device must be a torch device such as 'cpu', 'cuda' or 'cuda:1', got [0]"),
        (dict(devices=["cpu", "gpu0"]), ValueError, "devices[1] must be a torch device such as 'cpu', 'cuda' or "
                                                    "'cuda:1', got 'gpu0'"),
    ],
)
def test_bad_constructor_arguments(kwargs, kind, text):
    args = dict(embedding_dim=D, num_classes=C)
    args.update(kwargs)
    with pytest.raises(kind, match=__import__("re").escape(text)):
        shardfc.ShardedMarginHead(**args)


def test_group_without_process_group_is_an_error():
    with pytest.raises(ValueError, match="not initialised"):
        shardfc.ShardedMarginHead(D, C, group=object())


def test_predict_bad_k():
    head = shardfc.ShardedMarginHead(D, C)
    with pytest.raises(ValueError, match=f"k must be an int in \\[1, num_classes={C}\\], got 0"):
        head.predict(GOOD_X, k=0)


def test_backward_twice_is_a_clear_error():
    head = shardfc.ShardedMarginHead(D, C)
    loss = head(GOOD_X, GOOD_Y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_auto_chunk_size_is_exact_and_bounded():
    x, y = _data(5)
    head = shardfc.ShardedMarginHead(D, C, margin=M.ArcFace(), chunk_size="auto", chunk_budget_bytes=8 * B * 3, dtype=torch.float64)
    assert head._chunk_for(B) == 3
    _compare(head, x, y, M.ArcFace())
    # a budget below one class's logits for the batch: one class a chunk, never an empty chunk
    tiny = shardfc.ShardedMarginHead(D, C, margin=M.ArcFace(), chunk_size="auto", chunk_budget_bytes=8, dtype=torch.float64)
    assert tiny._chunk_for(B) == 1 and tiny._chunk_for(10**9) == 1
    _compare(tiny, x, y, M.ArcFace())
    with pytest.raises(ValueError, match="chunk_size must be a positive integer, got 'big'"):
        shardfc.ShardedMarginHead(D, C, chunk_size="big")


@pytest.mark.parametrize("chunk", [None, 3])
@pytest.mark.parametrize("devices", [None, ["cpu", "cpu"]])
def test_weight_gradient_accumulates_in_place_into_existing_grad(monkeypatch, chunk, devices):
    monkeypatch.setattr(shardfc.head.kernels, "WGRAD_BLOCK", 2)  # several row blocks per chunk
    x1, y1 = _data(1)
    x2, y2 = _data(2)
    margin = M.ArcFace(32.0, 0.4)
    grads = {}
    for in_place in (True, False):
        head = shardfc.ShardedMarginHead(D, C, margin=margin, chunk_size=chunk, devices=devices, dtype=torch.float64, weight_grad_in_place=in_place)
        head(x1, y1).backward()
        first = [w.grad for w in head.parameters()]
        head(x2, y2).backward()
        if in_place:  # the same tensors, added into
            assert all(a is w.grad for a, w in zip(first, head.parameters()))
        grads[in_place] = torch.cat([w.grad for w in head.parameters()])
    W = torch.cat([w.detach() for w in head.parameters()]).requires_grad_()
    shardfc.reference_loss(x1, W, y1, margin).backward()
    shardfc.reference_loss(x2, W, y2, margin).backward()
    assert _rel(grads[True], W.grad) < 1e-10 and _rel(grads[False], W.grad) < 1e-10


def test_autograd_grad_wrt_weights_with_in_place_disabled():
    head = shardfc.ShardedMarginHead(D, C, dtype=torch.float64, weight_grad_in_place=False)
    x, y = _data()
    head(x, y).backward()  # leaves a .grad behind
    (g,) = torch.autograd.grad(head(x, y), head.weight)
    torch.testing.assert_close(g, head.weight.grad)


@pytest.mark.parametrize("margin", ALL_MARGINS, ids=repr)
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16-autocast"])
def test_chunked_equals_unchunked_in_float32_and_autocast(margin, amp):
    """Chunked == unchunked to 1e-5 relative in float32. Under bf16 autocast the loss and weight
    gradient still agree to 1e-5 (each entry is one dot product, rounded alike), but the embedding
    gradient is a bf16 matmul output summed over classes, so chunking moves its rounding: bf16 precision."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(33, 24, generator=g)
    y = torch.randint(0, 101, (33,), generator=g)
    y[::5] = -1
    for devices, eps, reduction in ((None, 0.0, "mean"), (["cpu", "cpu"], 0.1, "none"), (None, 0.1, "sum")):
        out = {}
        for chunk in (None, 7):
            head = shardfc.ShardedMarginHead(24, 101, margin=margin, chunk_size=chunk, devices=devices, label_smoothing=eps, reduction=reduction)
            xa = x.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                loss = head(xa, y)
            loss.backward(torch.ones_like(loss))
            out[chunk] = (loss.detach(), xa.grad, torch.cat([w.grad for w in head.parameters()]))
        (l0, gx0, gw0), (l1, gx1, gw1) = out[None], out[7]
        assert _rel(l1, l0) < 1e-5 and _rel(gw1, gw0) < 1e-5, (devices, eps, reduction)
        assert _rel(gx1, gx0) < (2e-2 if amp else 1e-5), (devices, eps, reduction)


def test_input_checks_read_the_device_once(monkeypatch):
    """Finite embeddings and labels in range are checked on the device and read back together:
    one host read per forward's checks (it was one per check; on a GPU each read stalls the step)."""
    from shardfc.head import validation

    reads = []
    for name in ("tolist", "item", "__bool__", "__int__", "__float__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _real=real, _n=name: reads.append(_n) or _real(self, *a))
    x, y = torch.randn(6, 8), torch.tensor([0, 3, 9, -1, 2, 2])
    validation.check_batch_and_exchange_sizes(x, y, embedding_dim=8, num_classes=10, ignore_index=-1, ctx=DistContext())
    assert reads == ["tolist"]
    reads.clear()
    with pytest.raises(ValueError, match=r"labels\[2\] = 12 is outside \[0, num_classes=10\)"):
        validation.check_batch_and_exchange_sizes(x, torch.tensor([0, 3, 12, -1, 2, 2]), embedding_dim=8,
                                                  num_classes=10, ignore_index=-1, ctx=DistContext())
    x[4, 1] = float("nan")
    with pytest.raises(ValueError, match=r"embeddings contain non-finite values \(row 4"):
        validation.check_batch_and_exchange_sizes(x, y, embedding_dim=8, num_classes=10, ignore_index=-1, ctx=DistContext())


def test_init_rows_are_the_same_for_any_sharding_where_they_are_drawn():
    """Blocks of INIT_BLOCK rows, each from its own seeded generator: the CPU's draw (every earlier
    release's values), or a CUDA device's own (other values, drawn there)."""
    n = 2 * INIT_BLOCK + 5
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        whole = init_rows(0, n, 3, 7, device=device)
        cuts = [(0, 10), (10, INIT_BLOCK + 1), (INIT_BLOCK + 1, n)]
        assert whole.device.type == device
        assert torch.equal(torch.cat([init_rows(a, b, 3, 7, device=device) for a, b in cuts]), whole)
    assert torch.equal(init_rows(5, 9, 3, 7, device="cpu"), init_rows(5, 9, 3, 7))
    assert init_rows(5, 9, 3, 7, device="meta").device.type == "cpu"  # not a GPU: the CPU's draw


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_head_on_a_gpu_draws_its_rows_there():
    head = shardfc.ShardedMarginHead(D, C, device="cuda")
    assert torch.equal(head.weight.detach(), init_rows(0, C, D, 0, device="cuda"))


def test_the_repr_says_where_the_shards_are_and_every_option_off_its_default():
    plain = shardfc.ShardedMarginHead(4, 11)
    assert repr(plain) == ("ShardedMarginHead(embedding_dim=4, num_classes=11, margin=ArcFace(s=64.0, m=0.5, "
                           "easy_margin=False), single shard, classes=0..10, reduction='mean', label_smoothing=0.0)")
    every = shardfc.ShardedMarginHead(4, 11, devices=["cpu", "meta"], chunk_size=3, sample_rate=0.5, sparse_grad=True,
                                      subcenters=2, interclass_filter_threshold=0.4, margin=M.CosFace(),
                                      reduction="sum")
    assert every.extra_repr() == (
        "embedding_dim=4, num_classes=11, margin=CosFace(s=64.0, m=0.35), devices=['cpu', 'meta'], classes=0..10, "
        "reduction='sum', label_smoothing=0.0, chunk_size=3, sample_rate=0.5, sparse_grad=True, subcenters=2, "
        "interclass_filter_threshold=0.4")
    dense_sampled = shardfc.ShardedMarginHead(4, 11, sample_rate=0.5, chunk_size="auto", label_smoothing=0.1)
    assert dense_sampled.extra_repr().endswith(
        "single shard, classes=0..10, reduction='mean', label_smoothing=0.1, chunk_size=auto, sample_rate=0.5")


def test_the_repr_of_a_rank_names_it_and_its_classes(monkeypatch):
    from thread_world import ThreadWorld

    reprs = ThreadWorld(2).results(lambda rank: shardfc.ShardedMarginHead(4, 11, margin=M.Softmax()).extra_repr(),
                                   monkeypatch)
    assert reprs == [f"embedding_dim=4, num_classes=11, margin=Softmax(), rank {r}/2, classes={c}, reduction='mean', "
                     "label_smoothing=0.0" for r, c in ((0, "0..5"), (1, "6..10"))]


# ---- torch's state dict: the rows, and the Partial FC step in its metadata


def _stepped_head(steps=3, **kw):
    head = shardfc.ShardedMarginHead(4, 9, sample_rate=0.5, **kw)
    for s in range(steps):
        head(torch.randn(3, 4), torch.tensor([0, 5, 8])).backward()
    return head


def test_the_state_dict_refuses_what_torch_refuses():
    head = shardfc.ShardedMarginHead(4, 9)
    w = head.weight.detach().clone()
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "bogus"'):
        head.load_state_dict({"weight": w, "bogus": w})
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "weight"'):
        head.load_state_dict({})
    with pytest.raises(RuntimeError, match=r"size mismatch for weight: copying a param with shape "
                                           r"torch.Size\(\[8, 4\]\)"):
        head.load_state_dict({"weight": torch.zeros(8, 4)})
    result = head.load_state_dict({"weight": w * 2, "bogus": w}, strict=False)
    assert result.unexpected_keys == ["bogus"] and result.missing_keys == []
    assert torch.equal(head.weight, w * 2)


def test_the_state_dict_holds_the_parameter_itself_with_keep_vars_and_fills_a_plain_dict():
    head = shardfc.ShardedMarginHead(4, 9)
    assert head.state_dict(keep_vars=True)["weight"] is head.weight
    assert not head.state_dict()["weight"].requires_grad
    plain = head.state_dict(destination={})  # no _metadata to put the step in: nothing breaks
    assert list(plain) == ["weight"]


def test_the_sampling_step_is_saved_under_the_heads_own_prefix():
    head = _stepped_head(3)
    assert head.state_dict()._metadata[""]["sample_step"] == 3
    model = torch.nn.ModuleDict({"head": head})
    assert model.state_dict()._metadata["head"]["sample_step"] == 3


@pytest.mark.parametrize("saved, loaded", [(0, 0), (12, 12), (True, 3), (-1, 3), ("5", 3), (None, 3), (2.0, 3)])
def test_only_a_step_that_is_an_int_of_at_least_0_is_loaded(saved, loaded):
    head = _stepped_head(3)
    state = head.state_dict()
    if saved is None:
        del state._metadata[""]["sample_step"]
    else:
        state._metadata[""]["sample_step"] = saved
    head.load_state_dict(state)
    assert head.sample_step == loaded and type(head.sample_step) is int


def test_a_state_dict_without_metadata_keeps_the_step():
    """arcface_torch's checkpoints are plain dicts: no metadata, so the step stays where it is."""
    head = _stepped_head(3)
    head.load_state_dict({"weight": head.weight.detach().clone()})
    assert head.sample_step == 3


def test_loading_forgets_the_rows_and_gradients_of_the_replaced_weights_and_tells_the_catch_up():
    class RowsKeeper:
        def __init__(self):
            self.current = 0

        def catch_up_(self, w, rows):
            return False

        def rows_are_current(self):
            self.current += 1

    head = shardfc.ShardedMarginHead(4, 9, sample_rate=0.5, sparse_grad=True)
    keeper = RowsKeeper()
    head.keep_rows_current_by(keeper)
    head(torch.randn(3, 4), torch.tensor([0, 5, 8])).backward()
    assert head.sampled_rows is not None and head.row_grad_values() != []
    head.load_state_dict({"weight": head.weight.detach().clone()})
    assert head.sampled_rows is None and head.row_grad_values() == [] and head.take_sampled_rows() == {}
    assert keeper.current == 1


def test_a_copy_or_pickle_of_a_head_leaves_its_optimizers_behind():
    import copy
    import pickle

    class Attached:
        fused_update = True

        def catch_up_(self, w, rows):
            return False

    head, opt = shardfc.ShardedMarginHead(4, 9), Attached()
    head.fuse_optimizer_update(opt)
    head.keep_rows_current_by(opt)
    for clone in (copy.deepcopy(head), pickle.loads(pickle.dumps(head))):
        assert clone._update_optimizer() is None and clone._catch_up_optimizer() is None
        assert torch.equal(clone.weight, head.weight)
    assert head._update_optimizer() is opt and head.rows_kept_current_by(opt)  # the original keeps them


def test_rows_kept_current_by_names_only_the_attached_optimizer():
    head, opt = shardfc.ShardedMarginHead(4, 9), object()
    assert not head.rows_kept_current_by(None) and not head.rows_kept_current_by(opt)
    head.keep_rows_current_by(type("Opt", (), {})())  # gone at once: the head holds it weakly
    assert not head.rows_kept_current_by(opt) and not head.rows_kept_current_by(None)


def test_sharded_state_catches_up_an_optimizer_that_can():
    from shardfc.head.partial_fc import head_optimizer

    head = _stepped_head(2)
    opt = head_optimizer(head, "sgd", lr=0.1)
    calls = []
    real = opt.catch_up_all_
    opt.catch_up_all_ = lambda: calls.append(1) or real()
    head.sharded_state(opt)
    assert calls == [1]
    head.sharded_state(torch.optim.SGD(head.parameters(), lr=0.1))  # one without catch_up_all_: nothing to do
    head.sharded_state()


@pytest.mark.parametrize("devices", [None, ["cpu", "cpu"]])
def test_a_full_forward_without_a_backward_still_makes_the_sparse_gradient_dense(devices):
    """A sampled micro-batch with its backward, then a forward over every class without one (a loss
    only looked at): the step's rows are every row, so each shard's compact gradient becomes a dense
    ``.grad`` that holds it, on every shard."""
    sparse = shardfc.ShardedMarginHead(4, 9, sample_rate=0.5, sparse_grad=True, devices=devices, dtype=torch.float64)
    dense = shardfc.ShardedMarginHead(4, 9, sample_rate=0.5, devices=devices, dtype=torch.float64)
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.tensor([0, 5, 8])
    for head in (sparse, dense):
        head(x, y).backward()
        head.eval()
        head(x, y)
    assert sparse.take_sampled_rows() == {}
    for w_s, w_d in zip(sparse.shard_weights, dense.shard_weights):
        torch.testing.assert_close(w_s.grad, w_d.grad, rtol=1e-12, atol=0)


# ---- predict: the scores' precision, sub-centres, a shard with fewer classes than k


@pytest.mark.parametrize("x_dtype, w_dtype, scores_dtype", [
    (torch.float32, torch.float32, torch.float32),
    (torch.bfloat16, torch.float32, torch.float32),   # a bf16 backbone's embeddings, fp32 centres
    (torch.bfloat16, torch.bfloat16, torch.float32),  # scored in fp32, not in bf16
    (torch.float32, torch.float64, torch.float64),
])
def test_predict_scores_in_fp32_or_fp64_whatever_the_inputs(x_dtype, w_dtype, scores_dtype):
    torch.manual_seed(1)
    x = torch.randn(5, D).to(x_dtype)
    head = shardfc.ShardedMarginHead(D, C, margin=M.CosFace(), dtype=w_dtype)
    scores, ids = head.predict(x, k=3)
    assert scores.dtype == scores_dtype and ids.dtype == torch.int64
    from shardfc.head.normalize import l2_normalize

    # each side normalised in its own dtype (as the forward does), the product in fp32 or fp64
    xn, wn = l2_normalize(x).double(), l2_normalize(head.weight.detach()).double()
    want = xn @ wn.t() * head.margin.scale
    ref_s, ref_i = want.topk(3, dim=1)
    assert torch.equal(ids, ref_i)
    torch.testing.assert_close(scores.double(), ref_s, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("devices", [None, ["cpu", "cpu"]])
def test_predict_with_two_centres_a_class_scores_its_best(devices):
    x = torch.randn(4, D, dtype=torch.float64)
    head = shardfc.ShardedMarginHead(D, C, subcenters=2, devices=devices, chunk_size=3, dtype=torch.float64)
    scores, ids = head.predict(x, k=C)  # every class, once each
    W = torch.cat([w.detach() for w in head.shard_weights])
    cos = torch.nn.functional.normalize(x, dim=1) @ torch.nn.functional.normalize(W, dim=1).t()
    best = cos.view(4, C, 2).amax(2) * head.margin.scale
    ref_s, ref_i = best.topk(C, dim=1)
    assert torch.equal(ids, ref_i)
    torch.testing.assert_close(scores, ref_s, rtol=0, atol=1e-12)


def test_a_shards_top_k_is_padded_to_k_with_minus_inf_and_minus_one():
    from shardfc.head.module import _shard_topk

    a, w = torch.randn(2, D, dtype=torch.float64), torch.randn(3, D, dtype=torch.float64)
    for chunk in (None, 2):
        s, i = _shard_topk(a, w, range(10, 13), 5, M.Softmax(), chunk, 1)
        assert i[:, 3:].tolist() == [[-1, -1]] * 2 and s[:, 3:].tolist() == [[-math.inf] * 2] * 2
        assert sorted(i[0, :3].tolist()) == [10, 11, 12]
        torch.testing.assert_close(s[:, :3], (a @ w.t()).sort(dim=1, descending=True).values, rtol=0, atol=1e-12)
    s, i = _shard_topk(a, w[:0], range(5, 5), 2, M.Softmax(), None, 1)  # a shard without classes
    assert i.tolist() == [[-1, -1]] * 2 and s.dtype == torch.float64


# ---- batches of one and of none


@pytest.mark.parametrize("devices", [None, ["cpu", "cpu"]])
def test_a_batch_of_one_sample_is_scored_like_any_other(devices):
    x, y = torch.randn(1, D, dtype=torch.float64), torch.tensor([C - 1])
    head = shardfc.ShardedMarginHead(D, C, devices=devices, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    loss = head(xr, y)
    loss.backward()
    W = torch.cat([w.detach() for w in head.shard_weights]).requires_grad_()
    x_ref = x.clone().requires_grad_()
    ref = shardfc.reference_loss(x_ref, W, y, head.margin)
    ref.backward()
    assert loss.item() > 0 and _rel(loss.detach(), ref.detach()) < 1e-12 and _rel(xr.grad, x_ref.grad) < 1e-12


def test_an_empty_batch_under_partial_fc_samples_no_row():
    head = shardfc.ShardedMarginHead(D, C, sample_rate=0.5, devices=["cpu", "cpu"])
    head(torch.randn(0, D), torch.zeros(0, dtype=torch.long)).backward()
    assert [(r.tolist(), r.dtype) for r in head.sampled_rows] == [([], torch.int64)] * 2  # row ids
    dense = shardfc.ShardedMarginHead(D, C, devices=["cpu", "cpu"])
    dense(torch.randn(0, D), torch.zeros(0, dtype=torch.long)).backward()
    assert dense.sampled_rows == [None, None]  # every row (its zero gradient is dense)


@pytest.mark.parametrize("B", [0, 3])
def test_every_training_forward_counts_for_the_clipping_norm(B):
    """A forward whose norm is measured counts as one, an empty one too: after two, the norm of
    their summed gradient is not known (:meth:`take_weight_grad_sq_norm` says None)."""
    head = shardfc.ShardedMarginHead(D, C)
    head.measure_weight_grad_norm()
    head(torch.randn(B, D), torch.zeros(B, dtype=torch.long))
    assert head._grad_sq_forwards == 1
    with torch.no_grad():
        head(torch.randn(B, D), torch.zeros(B, dtype=torch.long))
    assert head._grad_sq_forwards == 1


@pytest.mark.parametrize("label_dtype", [torch.int32, torch.int16, torch.uint8])
@pytest.mark.parametrize("kw", [{}, {"sample_rate": 0.5}], ids=["full", "partial fc"])
def test_labels_of_any_integer_dtype_give_the_int64_labels_loss(label_dtype, kw):
    x, y = torch.randn(3, D, dtype=torch.float64), torch.tensor([0, 5, C - 1])
    losses = []
    for dtype in (torch.int64, label_dtype):
        head = shardfc.ShardedMarginHead(D, C, dtype=torch.float64, **kw)
        losses.append(head(x, y.to(dtype)))
    assert torch.equal(losses[0], losses[1])



def test_inside_value_checks_outside_only_types_and_shapes_are_checked():
    """What a captured step's caller gets: the loss of the batch, no read of its values (a NaN is not
    this forward's error), a type or shape still refused at once."""
    head = shardfc.ShardedMarginHead(D, C, dtype=torch.float64)
    x, y = torch.randn(3, D, dtype=torch.float64), torch.tensor([0, 5, C - 1])
    want = head(x, y)
    with head.value_checks_outside():
        assert torch.equal(head(x, y), want)
        head(torch.full((3, D), math.nan, dtype=torch.float64), y)  # not read here
        with pytest.raises(ValueError, match=r"^embeddings has width 2 but the head's embedding_dim is 5"):
            head(x[:, :2], y)
        with pytest.raises(ValueError, match=r"^labels has 2 entries but embeddings has 3 rows$"):
            head(x, y[:2])
    with pytest.raises(ValueError, match="^embeddings contain non-finite values"):
        head(torch.full((3, D), math.nan, dtype=torch.float64), y)  # outside: read again


# ---- the constructor


def test_a_new_head_has_run_nothing_yet():
    head = shardfc.ShardedMarginHead(D, C)
    assert (head.last_impl, head.last_chunk_scale, head.last_update, head.sample_step) == (None, None, None, 0)


def test_a_bad_gpu_chunk_scale_is_refused_by_its_name():
    with pytest.raises(ValueError, match=r"^gpu_chunk_scale must be None or one of \(1, 2, 4, 8\), got 3$"):
        shardfc.ShardedMarginHead(D, C, gpu_chunk_scale=3)


def test_the_weights_are_float32_by_default_whatever_torchs_default_dtype():
    torch.set_default_dtype(torch.float64)
    try:
        head = shardfc.ShardedMarginHead(D, C, devices=["cpu", "cpu"])
        single = shardfc.ShardedMarginHead(D, C)
    finally:
        torch.set_default_dtype(torch.float32)
    assert {w.dtype for w in head.shard_weights} == {torch.float32} and single.weight.dtype == torch.float32


@pytest.mark.parametrize("where", [dict(group="g"), dict(devices=["cpu"]), dict(group="g", devices=["cpu"])],
                         ids=["group", "devices", "both"])
def test_a_context_with_a_group_or_devices_is_refused(where):
    with pytest.raises(ValueError, match=r"^pass one of context, group \(process-group mode\) or devices \(one "
                                         r"process\), not several$"):
        shardfc.ShardedMarginHead(D, C, context=DistContext(), **where)


@pytest.mark.parametrize("kw, error, message", [
    (dict(embedding_dim=0), ValueError, "embedding_dim must be a positive integer, got 0"),
    (dict(chunk_budget_bytes=0), ValueError, "chunk_budget_bytes must be a positive integer, got 0"),
    (dict(ignore_index=True), TypeError, "ignore_index must be an int, got True"),
    (dict(ignore_index=-1.0), TypeError, "ignore_index must be an int, got -1.0"),
    (dict(ignore_index=0), ValueError, f"ignore_index=0 is a valid class id in [0, {C})"),
    (dict(ignore_index=C - 1), ValueError, f"ignore_index={C - 1} is a valid class id in [0, {C})"),
    (dict(devices=["cpu"], group="g"), ValueError, "pass either devices (one process, many devices) or group, not both"),
    (dict(devices=[]), ValueError, "devices must name at least one device, got an empty list"),
    (dict(dtype=torch.int32), ValueError, "dtype must be a floating-point torch.dtype (torch.float32, torch.bfloat16, "
                                          "torch.float16 or torch.float64), got torch.int32"),  # was torch's requires_grad error
    (dict(dtype="float32"), ValueError, "dtype must be a floating-point torch.dtype (torch.float32, torch.bfloat16, "
                                        "torch.float16 or torch.float64), got 'float32'"),
    (dict(dtype=torch.float8_e4m3fn), ValueError, "dtype must be a floating-point torch.dtype (torch.float32, "
                                                  "torch.bfloat16, torch.float16 or torch.float64), got torch.float8_e4m3fn"),
])
def test_the_constructor_refuses_naming_the_argument(kw, error, message):
    args = dict(embedding_dim=D, num_classes=C)
    args.update(kw)
    with pytest.raises(error) as e:
        shardfc.ShardedMarginHead(**args)
    assert str(e.value) == message


@pytest.mark.parametrize("dtype", [None, torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_each_storage_dtype_is_taken(dtype):
    assert shardfc.ShardedMarginHead(D, C, dtype=dtype).weight.dtype == (dtype or torch.float32)


@pytest.mark.parametrize("ignore_index", [-1, -100, C, C + 5])
def test_an_ignore_index_outside_the_classes_is_taken(ignore_index):
    assert shardfc.ShardedMarginHead(D, C, ignore_index=ignore_index).ignore_index == ignore_index


def test_the_head_lives_where_it_is_told():
    assert shardfc.ShardedMarginHead(D, C, device="meta").weight.device.type == "meta"
    in_context = shardfc.ShardedMarginHead(D, C, context=DistContext(), device="meta")
    assert in_context.weight.device.type == "meta" and in_context.ctx.device.type == "meta"
    on_devices = shardfc.ShardedMarginHead(D, C, devices=["meta", "cpu"])
    assert on_devices.ctx.device.type == "meta" and [w.device.type for w in on_devices.shard_weights] == ["meta", "cpu"]


def test_the_default_sampling_seed_is_0():
    x, y = torch.randn(4, D), torch.tensor([0, 1, 2, 3])
    rows = []
    for kw in ({}, {"sample_seed": 0}):
        head = shardfc.ShardedMarginHead(D, 40, sample_rate=0.2, **kw)
        head(x, y)
        rows.append(head.sampled_rows[0])
    assert torch.equal(rows[0], rows[1])


def test_a_fresh_head_has_noted_no_rows():
    head = shardfc.ShardedMarginHead(D, C, sample_rate=0.5)
    assert head.sampled_rows is None and head.take_sampled_rows() == {} and head.row_grad_values() == []
