"""``sharded_cross_entropy`` itself (``head/function.py``): the statistics combined over the shards of
one process and over ranks, held to a float64 dense reference written here with full ``[B, C]``
logits. The head always gives one shard per rank in a process group and many shards without one;
the function takes both at once, with shards of any size (none, one class) in any order, and is
tested so here. Ranks are threads of this process (``tests/thread_world.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dense_losses import dense_loss

from shardfc import margins as M
from shardfc.head import function as fn
from shardfc.head.function import (
    ShardedLossPlan,
    compute_dtype_for,
    local_labels_for_range,
    sharded_cross_entropy,
)
from shardfc.head.kernels import ShardConfig
from shardfc.head.reference import reference_logits
from thread_world import ThreadWorld

D, SEED = 5, 11


def _config(margin, num_classes, *, eps=0.0, K=1, filter_threshold=None, dtype=torch.float64):
    return ShardConfig(margin=margin, num_classes=num_classes, label_smoothing=eps, chunk_size=None,
                       compute_dtype=dtype, stats_dtype=dtype, subcenters=K, filter_threshold=filter_threshold)


def _plan(cfg, num_shards=1):
    """The plan of one process, no process group."""
    return ShardedLossPlan(config=cfg, num_shards=num_shards, distributed=False, comm=None, world_size=1)


def _split(sizes_per_rank):
    """Class ranges of every shard of every rank, in order: ``[[range, ...] per rank]``."""
    out, start = [], 0
    for sizes in sizes_per_rank:
        ranks = []
        for n in sizes:
            ranks.append(range(start, start + n))
            start += n
        out.append(ranks)
    return out, start


def _data(C, K, B=7, ignore=True):
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(B, D, generator=g, dtype=torch.float64) * 2
    W = torch.randn(C * K, D, generator=g, dtype=torch.float64)
    W[::3] *= 3  # centres of unequal norms: a raw logit and a cosine pick different centres
    y = torch.randint(0, C, (B,), generator=g)
    if ignore:
        y[2] = -1
    up = torch.rand(B, generator=g, dtype=torch.float64) + 0.5
    return x, W, y, up


def _rank_step(ranges, x, W, y, up, cfg, comm=None, world=1):
    """One rank's call with its shards ``ranges``: per-sample losses, the grad of its copy of the
    embeddings and of each shard's weight (``up`` back-propagated)."""
    K = cfg.subcenters
    margin = cfg.margin
    xs = F.normalize(x, dim=1) if margin.normalize_embeddings else x
    embeds = [xs.clone().requires_grad_() for _ in ranges]
    weights = [W[r.start * K : r.stop * K].clone().requires_grad_() for r in ranges]
    plan = ShardedLossPlan(config=cfg, num_shards=len(ranges), distributed=comm is not None, comm=comm,
                           world_size=world)
    valid = y != -1
    losses = sharded_cross_entropy(plan, valid, [local_labels_for_range(y, r) for r in ranges], embeds, weights)
    losses.backward(up)
    # The embeddings' gradient as the caller's normalisation would pass it on.
    grad_x = sum(e.grad for e in embeds)
    if margin.normalize_embeddings:
        x_leaf = x.clone().requires_grad_()
        F.normalize(x_leaf, dim=1).backward(grad_x)
        grad_x = x_leaf.grad
    return losses.detach(), grad_x, [w.grad for w in weights]


def _run(sizes_per_rank, x, W, y, ups, cfg):
    """Every rank's step (threads when more than one); the losses of each rank, the summed
    embedding gradient and the whole weight gradient."""
    shards, C = _split(sizes_per_rank)
    world = len(shards)
    if world == 1:
        out = [_rank_step(shards[0], x, W, y, ups[0], cfg)]
    else:
        tw = ThreadWorld(world)
        out = tw.results(lambda rank: _rank_step(shards[rank], x, W, y, ups[rank], cfg,
                                                 comm=tw.context().communicator, world=world))
    losses = [o[0] for o in out]
    grad_x = sum(o[1] for o in out)
    grad_w = torch.cat([g for o in out for g in o[2]])
    return losses, grad_x, grad_w


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


LAYOUTS = {
    "one shard": [[9]],
    "an empty and a one-class shard first": [[0, 1, 8]],
    "two ranks, shards of every size": [[0, 3], [1, 0, 5]],
    "three ranks, an empty rank": [[4, 1], [0], [2, 0, 2]],
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("case", ["arcface+smoothing", "cosface+subcenters+filter", "arcface+filter"])
def test_losses_and_gradients_equal_the_dense_float64_ones(layout, case):
    sizes = LAYOUTS[layout]
    C = sum(sum(s) for s in sizes)
    K = 2 if "subcenters" in case else 1
    margin = M.CosFace(16.0, 0.3) if "cosface" in case else M.ArcFace(32.0, 0.5)
    eps = 0.1 if "smoothing" in case else 0.0
    threshold = 0.2 if "filter" in case else None
    x, W, y, up = _data(C, K)
    world = len(sizes)
    ups = [up * (r + 1) for r in range(world)]  # each rank back-propagates its own weights
    given = [u.clone() for u in ups]
    losses, grad_x, grad_w = _run(sizes, x, W, y, ups, _config(margin, C, eps=eps, K=K, filter_threshold=threshold))
    # The upstream gradients are the callers' tensors: summed over ranks in a copy, never in them.
    assert all(torch.equal(u, v) for u, v in zip(ups, given))

    x_ref, W_ref = x.clone().requires_grad_(), W.clone().requires_grad_()
    if eps:
        ref = _smoothed_loss(x_ref, W_ref, y, margin, eps)
    else:
        ref = dense_loss(x_ref, W_ref, y, margin, subcenters=K, filter_threshold=threshold, reduction="none")
    # The objective is the average over ranks of what each rank back-propagates.
    ref.backward(sum(ups) / world)
    for rank_losses in losses:  # every rank holds the whole batch's losses
        assert _rel(rank_losses, ref.detach()) < 1e-12
    assert _rel(grad_w, W_ref.grad) < 1e-12
    # Each rank's embedding gradient is its shards' part of the objective's: they sum to it.
    assert _rel(grad_x, x_ref.grad) < 1e-12


def _smoothed_loss(x, W, y, margin, eps):
    """The margin's logits with label smoothing over every class, dense: the target ``(1-ε)·onehot + ε/C``."""
    logits = reference_logits(x, W, y, margin)
    losses = F.cross_entropy(logits, y, ignore_index=-1, label_smoothing=eps, reduction="none")
    return losses


def _raw_subcentre_filter_loss(x, W, y, K, threshold):
    """Plain softmax over sub-centres with the inter-class filter, dense: a class's logit is its best
    centre's ``x·w`` (raw: this margin normalises nothing), the target centre is the one with the
    best raw logit, and a negative class is left out when one of its centres has a cosine above
    ``threshold`` to that target centre."""
    C = W.shape[0] // K
    raw = (x @ W.t()).view(-1, C, K)
    logits, best = raw.max(dim=2)
    unit = F.normalize(W, dim=1).view(C, K, -1)
    losses = []
    for i in range(x.shape[0]):
        if y[i] < 0:
            losses.append(x.new_zeros(()))
            continue
        target = unit[y[i], best[i, y[i]]]
        near = (unit @ target).amax(dim=1) > threshold
        near[y[i]] = False
        row = logits[i].masked_fill(near.detach(), float("-inf"))
        losses.append(torch.logsumexp(row, 0) - row[y[i]])
    return torch.stack(losses)


@pytest.mark.parametrize("layout", ["one shard", "two ranks, shards of every size"])
def test_the_filter_picks_the_target_centre_by_the_margins_own_logit(layout):
    """Softmax keeps centres raw: the target centre the filter measures from is the best by ``x·w``,
    not by the cosine (the data has centres of unequal norms, where the two differ)."""
    sizes, K, threshold = LAYOUTS[layout], 3, 0.1
    C = sum(sum(s) for s in sizes)
    x, W, y, up = _data(C, K)
    unit = F.normalize(W, dim=1).view(C, K, D)
    by_raw = (W.view(C, K, D)[y.clamp(min=0)] @ x.unsqueeze(2)).squeeze(2).argmax(1)
    by_cos = (unit[y.clamp(min=0)] @ x.unsqueeze(2)).squeeze(2).argmax(1)
    assert not torch.equal(by_raw[y >= 0], by_cos[y >= 0])  # the case the test is about happens
    ups = [up] * len(sizes)
    losses, grad_x, grad_w = _run(sizes, x, W, y, ups, _config(M.Softmax(), C, K=K, filter_threshold=threshold))
    x_ref, W_ref = x.clone().requires_grad_(), W.clone().requires_grad_()
    ref = _raw_subcentre_filter_loss(x_ref, W_ref, y, K, threshold)
    ref.backward(up)
    assert _rel(losses[0], ref.detach()) < 1e-12
    assert _rel(grad_w, W_ref.grad) < 1e-12
    assert _rel(grad_x, x_ref.grad) < 1e-12


def test_local_labels_are_rows_of_the_shard_or_minus_one():
    labels = torch.tensor([-1, 0, 4, 5, 9, 10, 7])
    assert local_labels_for_range(labels, range(5, 10)).tolist() == [-1, -1, -1, 0, 4, -1, 2]
    assert local_labels_for_range(labels, range(3, 3)).tolist() == [-1] * 7


def test_compute_dtype_is_autocasts_or_the_inputs_promoted():
    f32, f64, bf16 = (torch.zeros(2, dtype=d) for d in (torch.float32, torch.float64, torch.bfloat16))
    cpu = torch.device("cpu")
    assert compute_dtype_for(cpu, f32, f64) is torch.float64  # every input counts, not the first alone
    assert compute_dtype_for(cpu, bf16, f32, f64) is torch.float64
    assert compute_dtype_for(cpu, bf16) is torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compute_dtype_for(cpu, f32, f64) is torch.bfloat16


def test_compute_dtype_on_meta_is_the_plans_setting_there_only(monkeypatch):
    meta, cpu = torch.device("meta"), torch.device("cpu")
    m32 = torch.zeros(2, device="meta")
    # No setting: the inputs' dtype, without asking autocast (it has no "meta" and raises).
    assert compute_dtype_for(meta, m32) is torch.float32
    monkeypatch.setattr(fn, "META_COMPUTE_DTYPE", torch.bfloat16)
    assert compute_dtype_for(meta, m32) is torch.bfloat16
    assert compute_dtype_for(cpu, torch.zeros(2)) is torch.float32  # the setting is for meta alone


def test_a_step_on_the_meta_device_runs_without_autocast():
    """``shardfc plan`` replays the step on meta, which has no autocast to turn off."""
    C = 6
    cfg = _config(M.ArcFace(32.0, 0.5), C, dtype=torch.float32)
    plan = _plan(cfg, num_shards=2)
    a = [torch.zeros(4, D, device="meta", requires_grad=True) for _ in range(2)]
    w = [torch.zeros(3, D, device="meta", requires_grad=True) for _ in range(2)]
    labels = torch.zeros(4, dtype=torch.int64, device="meta")
    loss = sharded_cross_entropy(plan, labels >= 0, [labels, labels], a, w)
    assert loss.shape == (4,) and loss.device.type == "meta"
    loss.sum().backward()
    assert w[0].grad.shape == (3, D)


def test_autocast_outside_does_not_change_the_computation():
    """The statistics are computed in the plan's dtypes whatever autocast says outside: an fp32 plan
    under bf16 autocast gives the fp32 result, not a bf16 one."""
    C = 9
    x, W, y, up = _data(C, 1)
    x, W = x.float(), W.float()
    cfg = _config(M.ArcFace(32.0, 0.5), C, dtype=torch.float32)
    plain = _rank_step([range(0, 4), range(4, C)], x, W, y, up.float(), cfg)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = _rank_step([range(0, 4), range(4, C)], x, W, y, up.float(), cfg)
    assert torch.equal(plain[0], under[0])
    assert torch.equal(plain[1], under[1])


def test_one_embedding_label_map_and_weight_per_shard():
    cfg = _config(M.ArcFace(32.0, 0.5), 4)
    plan = _plan(cfg, num_shards=2)
    t = torch.zeros(3, D, dtype=torch.float64)
    labels = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError) as e:
        sharded_cross_entropy(plan, labels >= 0, [labels, labels], [t], [t, t])
    assert str(e.value) == (
        "need one embedding copy, one label map and one weight per shard: 2 shards, 1 embeddings, "
        "2 label maps, 2 weights"
    )


def test_a_second_backward_of_one_forward_is_refused():
    C = 4
    x, W, y, _ = _data(C, 1)
    plan = _plan(_config(M.ArcFace(32.0, 0.5), C))
    w = W.clone().requires_grad_()
    loss = sharded_cross_entropy(plan, y >= 0, [y.clamp(min=0)], [F.normalize(x, dim=1)], [w]).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError) as e:
        loss.backward()
    assert str(e.value) == (
        "the sharded head's backward ran twice for one forward; its softmax buffer is consumed in place "
        "(run the forward again instead of retain_graph=True)"
    )


def test_a_weight_that_is_not_a_leaf_passes_its_gradient_on():
    """The gradient is added into ``.grad`` in place only for a leaf: a weight computed from a
    parameter (its ``.grad`` retained) must hand its gradient back to the parameter at every step."""
    C = 5
    x, W, y, up = _data(C, 1)
    cfg = _config(M.ArcFace(32.0, 0.5), C)
    xs = F.normalize(x, dim=1)
    p = W.clone().requires_grad_()
    plan = _plan(cfg)
    for _ in range(2):
        w = p * 2.0
        w.retain_grad()
        w.grad = torch.zeros_like(w)  # a gradient there already (say, from an earlier use)
        sharded_cross_entropy(plan, y >= 0, [local_labels_for_range(y, range(C))], [xs], [w]).backward(up)
    ref_p = W.clone().requires_grad_()
    ref = dense_loss(x, ref_p * 2.0, y, cfg.margin, reduction="none")
    ref.backward(up * 2)  # two steps
    assert _rel(p.grad, ref_p.grad) < 1e-12


def test_a_sparse_grad_already_there_is_added_to_not_into():
    """A weight whose ``.grad`` is sparse (a row-sparse optimizer's) gets the dense gradient through
    autograd, which adds the two; it is never written into the sparse tensor in place."""
    C = 5
    x, W, y, up = _data(C, 1)
    cfg = _config(M.ArcFace(32.0, 0.5), C)
    w = W.clone().requires_grad_()
    before = torch.zeros_like(W)
    before[1] = 1.0
    w.grad = before.to_sparse()
    plan = _plan(cfg)
    sharded_cross_entropy(plan, y >= 0, [local_labels_for_range(y, range(C))], [F.normalize(x, dim=1)], [w]).backward(up)
    ref_w = W.clone().requires_grad_()
    dense_loss(x, ref_w, y, cfg.margin, reduction="none").backward(up)
    assert _rel(w.grad.to_dense(), ref_w.grad + before) < 1e-12


def test_feature_norms_of_a_lower_precision_enter_in_the_statistics_dtype():
    """MagFace reads the norms before normalisation. Handed over in fp32 to an fp64 loss, they are
    used in fp64 (their values exactly), in the margin and in the regulariser."""
    C, margin = 6, M.MagFace()
    x, W, y, up = _data(C, 1)
    norms = torch.linspace(12.0, 105.0, x.shape[0], dtype=torch.float64).float()  # inside [l_a, u_a]
    x = F.normalize(x, dim=1) * norms.double().unsqueeze(1)
    w = W.clone().requires_grad_()
    plan = _plan(_config(margin, C))
    feature_norms = norms.clone().requires_grad_()
    losses = sharded_cross_entropy(plan, y >= 0, [local_labels_for_range(y, range(C))], [F.normalize(x, dim=1)], [w],
                                   feature_norms)
    losses.backward(up)
    ref_w = W.clone().requires_grad_()
    ref = dense_loss(x, ref_w, y, margin, reduction="none")
    ref.backward(up)
    assert losses.dtype is torch.float64 and feature_norms.grad.dtype is torch.float32
    assert _rel(losses.detach(), ref.detach()) < 1e-12
    assert _rel(w.grad, ref_w.grad) < 1e-12


def test_sphereface_norms_of_bf16_embeddings_are_taken_in_the_statistics_dtype():
    """Embeddings from a bf16 backbone with fp32 centres: the norm SphereFace scales by is the fp32
    norm of the bf16 values, not a bf16 one (whose rounding, 2⁻⁸, would show in every logit)."""
    C, margin = 6, M.SphereFace(3)
    x, W, y, up = _data(C, 1)
    a = (x * 3).to(torch.bfloat16)
    cfg = _config(margin, C, dtype=torch.float32)
    plan = _plan(cfg)
    losses = sharded_cross_entropy(plan, y >= 0, [local_labels_for_range(y, range(C))], [a], [W.float()])
    valid = y >= 0
    ref = F.cross_entropy(reference_logits(a.double(), W.float().double(), y, margin)[valid], y[valid], reduction="none")
    assert _rel(losses[valid].double(), ref) < 1e-5
