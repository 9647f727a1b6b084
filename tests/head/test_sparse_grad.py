"""Row-sparse weight gradients under Partial FC (``sparse_grad=True``): the compact gradient equals
the dense gradient on the sampled rows, the optimizers consume it to the same update, and no
``[n_local, D]`` gradient exists at any point of the step."""

from __future__ import annotations

import pytest
import torch
from sparse_steps import step_both

from sgd_only import SGD_MOMENTUM
from shardfc import ShardedMarginHead
from shardfc import margins as M
from shardfc.head import kernels
from shardfc.head.partial_fc import RowGrad, head_optimizer
from shardfc.tools.bench.memory import LiveTensorBytes

C, D = 37, 5


def make_head(sparse: bool, devices=None, chunk=None, margin=None, C=C, D=D, dtype=torch.float64, rate=0.3):
    return ShardedMarginHead(D, C, margin=margin or M.ArcFace(16.0, 0.3), devices=devices, chunk_size=chunk,
                             sample_rate=rate, sample_seed=3, sparse_grad=sparse, dtype=dtype)


def batch(seed: int, B: int = 11, labels_on_first_shard: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, generator=g, dtype=torch.float64)
    y = torch.randint(0, 8 if labels_on_first_shard else C, (B,), generator=g)
    return x, y


@pytest.mark.parametrize("devices", [None, ["cpu", "cpu", "cpu"]])
@pytest.mark.parametrize("chunk", [None, 4])
@pytest.mark.parametrize("margin", [M.ArcFace(16.0, 0.3), M.Softmax(), M.SphereFace(4.0)])
@pytest.mark.parametrize("first_shard", [False, True])
def test_sparse_gradient_equals_dense_gradient_on_the_sampled_rows(monkeypatch, devices, chunk, margin, first_shard):
    """Unequal shards (37 over 3), labels all on one shard, several gathered blocks without a chunk
    size (SAMPLED_BLOCK shrunk to 3), two micro-batches summed; float64, so the tolerance is tight."""
    monkeypatch.setattr(kernels, "SAMPLED_BLOCK", 3)
    dense, sparse = make_head(False, devices, chunk, margin), make_head(True, devices, chunk, margin)
    for micro in range(2):
        x, y = batch(micro, labels_on_first_shard=first_shard)
        x_d, x_s = x.clone().requires_grad_(), x.clone().requires_grad_()
        dense(x_d, y).backward()
        loss = sparse(x_s, y)
        loss.backward()
        torch.testing.assert_close(x_s.grad, x_d.grad, rtol=1e-12, atol=1e-14)
    got = sparse.take_sampled_rows()
    rows_dense = dense.sampled_rows
    for i, (w_d, w_s) in enumerate(zip(dense.shard_weights, sparse.shard_weights)):
        assert w_s.grad is None  # autograd never saw a weight gradient
        entry = got[w_s]
        assert isinstance(entry, RowGrad)
        assert torch.equal(entry.rows, rows_dense[i])
        torch.testing.assert_close(entry.values, w_d.grad[entry.rows], rtol=1e-12, atol=1e-14)
        outside = torch.ones(w_d.shape[0], dtype=torch.bool)
        outside[entry.rows] = False
        assert torch.count_nonzero(w_d.grad[outside]) == 0
    assert sparse.take_sampled_rows() == {}  # taken once


@pytest.mark.parametrize("name", ["sgd", "adamw"])
@pytest.mark.parametrize("devices", [None, ["cpu", "cpu"]])
def test_optimizer_consumes_the_sparse_gradient_like_the_dense_one(name, devices):
    """Three steps of two micro-batches: weights and state equal to the dense-gradient run's bit for
    bit; rows never sampled and their state are bit-identical to the start."""
    heads = [make_head(s, devices) for s in (False, True)]
    opts = [head_optimizer(h, name, lr=0.1, **SGD_MOMENTUM[name], weight_decay=5e-4) for h in heads]
    start = torch.cat([w.detach().clone() for w in heads[1].shard_weights])
    # Batches of 4: ⌈0.3·n_local⌉ = 6 rows a shard a draw (of 18–19), so some rows sit out all six draws
    touched = step_both(heads, opts, lambda step, micro: batch(10 * step + micro, B=4), rows=C)
    dense_w = torch.cat([w.detach() for w in heads[0].shard_weights])
    sparse_w = torch.cat([w.detach() for w in heads[1].shard_weights])
    assert torch.equal(dense_w, sparse_w)
    for key in opts[0].state[heads[0].shard_weights[0]]:
        a = torch.cat([opts[0].state[w][key] for w in heads[0].shard_weights])
        b = torch.cat([opts[1].state[w][key] for w in heads[1].shard_weights])
        assert torch.equal(a, b), key
        assert torch.count_nonzero(b[~touched]) == 0, key
    assert not touched.all()
    assert torch.equal(sparse_w[~touched], start[~touched])


def test_no_dense_gradient_is_ever_allocated():
    """n_local = 40000 rows, 1000 sampled: no storage of the step reaches [n_local, D]; the step's
    peak (sampling scores and label maps are O(n_local), no more) is a small fraction of one dense gradient."""
    n, dim = 40_000, 64
    head = make_head(True, C=n, D=dim, dtype=torch.float32, rate=0.025)
    opt = head_optimizer(head, "sgd", lr=0.1, momentum=0.9, weight_decay=5e-4)
    dense_bytes = n * dim * 4

    def step(seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(32, dim, generator=g, requires_grad=True)
        head(x, torch.randint(0, n, (32,), generator=g)).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    step(0)  # the momentum buffer
    with LiveTensorBytes() as mode:
        step(1)
    assert head.weight.grad is None
    assert mode.peak < dense_bytes / 4, (mode.peak, dense_bytes)


def test_sparse_grad_needs_partial_fc():
    with pytest.raises(ValueError, match="sparse_grad needs Partial FC"):
        ShardedMarginHead(D, C, sparse_grad=True)
    with pytest.raises(TypeError, match="sparse_grad must be True or False"):
        ShardedMarginHead(D, C, sample_rate=0.5, sparse_grad="yes")


def test_eval_forward_of_a_sparse_head_is_dense():
    head = make_head(True)
    head.eval()
    x, y = batch(0)
    head(x, y).backward()
    assert head.weight.grad is not None and head.weight.grad.shape == head.weight.shape
    assert head.take_sampled_rows() == {}


def _loss_peak(head, opt, seed: int) -> int:
    """Peak of a forward + backward (the optimizer's own transients are another matter)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, head.embedding_dim, generator=g, requires_grad=True)
    y = torch.randint(0, head.num_classes, (32,), generator=g)
    with LiveTensorBytes() as mode:
        head(x, y).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    return mode.peak


@pytest.mark.parametrize("sparse", [False, True])
def test_sampled_rows_are_gathered_one_block_at_a_time(monkeypatch, sparse):
    """Without a chunk size the step never copies all sampled rows at once: with SAMPLED_BLOCK = 64
    the forward + backward peak is lower by about the copy of the other k - 64 rows than with one block of all of them.
    (D = 256: the copy of the k rows, 1 MB, is then above the draw's own transients, its keys' 8 bytes a class.)"""
    n, dim, rate = 40_000, 256, 0.025
    k = int(n * rate)
    peaks = []
    for block in (10**9, 64):
        monkeypatch.setattr(kernels, "SAMPLED_BLOCK", block)
        head = make_head(sparse, C=n, D=dim, dtype=torch.float32, rate=rate)
        opt = head_optimizer(head, "sgd", lr=0.1, momentum=0.0)
        _loss_peak(head, opt, 0)
        peaks.append(_loss_peak(head, opt, 1))
    assert peaks[0] - peaks[1] >= (k - 64) * dim * 4 * 0.9, peaks


def test_a_full_forward_in_the_same_step_makes_the_update_dense():
    """A sampled micro-batch and a full (eval-mode) one in one step: the sparse head's gradient and
    update equal the dense head's."""
    heads = [make_head(s) for s in (False, True)]
    opts = [head_optimizer(h, "sgd", lr=0.1, momentum=0.9, weight_decay=5e-4) for h in heads]
    for head, opt in zip(heads, opts):
        for micro, training in enumerate((True, False)):
            head.train(training)
            x, y = batch(micro)
            head(x, y).backward()
        opt.step()
    assert torch.equal(heads[0].weight, heads[1].weight)


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("devices", [None, ["cpu", "cpu", "cpu"]])
def test_row_grad_values_are_the_micro_batches_summed_per_shard_in_place(devices, micro_batches):
    """What clipping and overflow checks read: one compact gradient per shard, the two micro-batches
    merged, and the same tensors the optimizer then takes (so scaling them in place scales the update)."""
    dense, sparse = make_head(False, devices), make_head(True, devices)
    assert sparse.row_grad_values() == []  # nothing before a backward
    for micro in range(micro_batches):
        x, y = batch(micro)
        dense(x, y).backward()
        sparse(x, y).backward()
    values = sparse.row_grad_values()
    assert len(values) == len(sparse.shard_weights)
    rows = dense.sampled_rows
    for i, (v, w_d) in enumerate(zip(values, dense.shard_weights)):
        torch.testing.assert_close(v, w_d.grad[rows[i]], rtol=1e-12, atol=1e-14)
    assert all(a is b for a, b in zip(values, sparse.row_grad_values()))  # merged once, kept merged
    for v in values:
        v.mul_(0.5)
    taken = sparse.take_sampled_rows()
    for i, w in enumerate(sparse.shard_weights):
        torch.testing.assert_close(taken[w].values, 0.5 * dense.shard_weights[i].grad[rows[i]], rtol=1e-12, atol=1e-14)
    assert sparse.row_grad_values() == []  # taken with the rows
