"""Imprinted centres against a dense float64 computation, in one process and over 3 gloo ranks
with unequal (and empty) batch streams."""

from __future__ import annotations

import pytest
import torch

from shardfc.head.imprint import imprint_centres
from shardfc.head.layout import class_ranges
from shardfc.parallel.context import DistContext
from shardfc.parallel.launch import spawn

C, D = 23, 5


def stream(seed: int, batches: int, ignore: bool = True):
    """Embeddings of varied norms (float64) and labels, some outside [0, C) (to be skipped)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in range(batches):
        n = (b * 7 + seed) % 9  # sizes 0..8
        x = torch.randn(n, D, generator=g, dtype=torch.float64) * torch.rand(n, 1, generator=g, dtype=torch.float64) * 5
        y = torch.randint(-1 if ignore else 0, C + (3 if ignore else 0), (n,), generator=g)
        out.append((x, y))
    return out


def dense(batches) -> tuple:
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    keep = (y >= 0) & (y < C)
    x, y = x[keep], y[keep]
    sums = torch.zeros(C, D, dtype=torch.float64).index_add_(0, y, x / x.norm(dim=1, keepdim=True))
    norms = sums.norm(dim=1, keepdim=True)
    return torch.where(norms > 0, sums / norms.clamp(min=1e-300), sums), torch.bincount(y, minlength=C)


def test_imprint_equals_dense_float64_and_marks_missing_classes():
    batches = stream(1, 6)
    centres, counts = dense(batches)
    got = imprint_centres(iter(batches), range(C), D)
    assert got.centres.dtype == torch.float32
    assert torch.equal(got.counts, counts)
    assert (got.centres.double() - centres).abs().max() < 1e-6
    assert got.missing.tolist() == torch.nonzero(counts == 0).flatten().tolist()
    part = imprint_centres(iter(batches), range(10, 15), D)  # a slice of the classes, as a rank holds
    assert (part.centres.double() - centres[10:15]).abs().max() < 1e-6


def test_imprint_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match=r"must be \[b, 5\] and \[b\]"):
        imprint_centres([(torch.zeros(3, 4), torch.zeros(3))], range(C), D)


def _worker(rank, world):
    ctx = DistContext.resolve()
    # Rank r streams 2 + 2r batches: the ranks run out at different rounds.
    got = imprint_centres(stream(rank, 2 + 2 * rank), class_ranges(C, world)[rank], D, context=ctx)
    return got.class_range, got.centres, got.counts


def test_imprint_sharded_over_three_ranks_equals_dense():
    results = spawn(_worker, 3, backend="gloo")
    everything = [b for rank in range(3) for b in stream(rank, 2 + 2 * rank)]
    centres, counts = dense(everything)
    assert [r for r, _, _ in results] == class_ranges(C, 3)
    got = torch.cat([c for _, c, _ in results]).double()
    assert torch.equal(torch.cat([n for _, _, n in results]), counts)
    assert (got - centres).abs().max() < 1e-6
