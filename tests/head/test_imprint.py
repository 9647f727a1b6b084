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


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_imprint_refuses_embeddings_that_are_not_finite(bad):
    """A backbone that overflowed gives NaN centres (the loss NaN from the first step): refused,
    whether the row's class is imprinted or skipped, and counted over every batch."""
    batches = stream(1, 6)
    x, y = batches[2]
    x = x.clone()
    x[0, 1] = bad
    batches[2] = (x, y)
    with pytest.raises(ValueError) as e:
        imprint_centres(iter(batches), range(C), D)
    total = sum(len(b[1]) for b in batches)
    assert str(e.value) == (f"imprint_centres: 1 of the {total} embeddings hold NaN or inf (a broken or diverged "
                            "backbone, e.g. one that overflows under float16): centres imprinted from them would be NaN")
    half = torch.full((3, D), 1.0, dtype=torch.float16)
    half[1:] = 70000.0  # past float16's largest in the backbone: inf rows, two of them
    with pytest.raises(ValueError, match=r"^imprint_centres: 2 of the 3 embeddings hold NaN or inf"):
        imprint_centres([(half, torch.tensor([0, 1, C + 5]))], range(0), D)


def test_imprint_refuses_a_non_finite_embedding_on_every_rank():
    """Rank 1's backbone gives a NaN row for a class rank 0 holds: both ranks refuse, none waits."""
    def batches_of(rank):
        x = torch.eye(D, dtype=torch.float64)[:3].clone()
        if rank == 1:
            x[2, 0] = float("nan")
        return [(x, torch.tensor([0, 1, 2]))]

    from thread_world import ThreadWorld

    tw = ThreadWorld(2)
    out = tw.run(lambda rank: imprint_centres(iter(batches_of(rank)), class_ranges(C, 2)[rank], D, context=tw.context()))
    assert [str(e) for e in out] == ["imprint_centres: 1 of the 6 embeddings hold NaN or inf (a broken or diverged "
                                     "backbone, e.g. one that overflows under float16): centres imprinted from them "
                                     "would be NaN"] * 2


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


# ---------------------------------------------------------------- ranks as threads (mutmut sees them)
def _thread_world_imprint(world, batches_of):
    """Each rank ``r`` imprints its own ``class_ranges(C, world)[r]`` from ``batches_of(r)``, the ranks
    being threads of this process (``tests/thread_world.py``)."""
    from thread_world import ThreadWorld

    tw = ThreadWorld(world)

    def rank_fn(rank):
        got = imprint_centres(iter(batches_of(rank)), class_ranges(C, world)[rank], D, context=tw.context())
        return got.class_range, got.centres, got.counts

    return tw.results(rank_fn)


@pytest.mark.parametrize("world", [2, 3])
def test_imprint_over_thread_ranks_equals_dense_whatever_each_rank_streams(world):
    """Rank r streams 2 + 2r batches (sizes 0..8, empty ones among them): the ranks run out at
    different rounds, and a rank whose batch is empty still takes part in the round."""
    results = _thread_world_imprint(world, lambda rank: stream(rank, 2 + 2 * rank))
    everything = [b for rank in range(world) for b in stream(rank, 2 + 2 * rank)]
    centres, counts = dense(everything)
    assert [r for r, _, _ in results] == class_ranges(C, world)
    assert torch.equal(torch.cat([n for _, _, n in results]), counts)
    assert (torch.cat([c for _, c, _ in results]).double() - centres).abs().max() < 1e-6


def test_imprint_over_thread_ranks_where_one_rank_has_no_batch_at_all():
    labelled = [(torch.eye(D, dtype=torch.float64)[:4] * 3, torch.tensor([0, 12, 22, 5]))]
    results = _thread_world_imprint(2, lambda rank: labelled if rank == 1 else [])
    centres, counts = dense(labelled)
    assert torch.equal(torch.cat([n for _, _, n in results]), counts) and int(counts.sum()) == 4
    assert (torch.cat([c for _, c, _ in results]).double() - centres).abs().max() < 1e-6
    # no rank with any batch: one round, every count zero
    results = _thread_world_imprint(2, lambda rank: [])
    assert all(int(n.sum()) == 0 and not c.any() for _, c, n in results)


def test_imprint_sums_in_fp32_from_any_label_dtype():
    batches = [(x, y.to(torch.int32)) for x, y in stream(1, 4)]
    centres, counts = dense(stream(1, 4))
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:  # the sums are fp32 whatever the default dtype
        got = imprint_centres(iter(batches), range(C), D, device="cpu")
    finally:
        torch.set_default_dtype(before)
    assert got.centres.dtype == torch.float32 and got.counts.dtype == torch.int64
    assert torch.equal(got.counts, counts) and (got.centres.double() - centres).abs().max() < 1e-6


def test_a_round_where_every_rank_has_an_empty_batch_is_not_the_end():
    """An empty batch is a batch (size 0): only a rank that has no batch left says so (size -1)."""
    empty = (torch.zeros(0, D, dtype=torch.float64), torch.zeros(0, dtype=torch.int64))
    later = [(torch.eye(D, dtype=torch.float64)[:2], torch.tensor([3, 17]))]
    results = _thread_world_imprint(2, lambda rank: [empty] + (later if rank == 0 else []))
    assert int(sum(n.sum() for _, _, n in results)) == 2
    single = imprint_centres(iter([empty, *later]), range(C), D)  # one process: the same
    assert int(single.counts.sum()) == 2


def test_imprint_over_torch_distributed_thread_ranks_equals_dense():
    """The same rounds through ``torch.distributed``'s own collectives (its threaded backend): the
    gather pads to the largest batch, so the sizes must be the ints the all-reduce gives."""
    from thread_world import TorchThreadWorld

    def rank_fn(rank):
        got = imprint_centres(iter(stream(rank, 2 + 2 * rank)), class_ranges(C, 3)[rank], D,
                              context=DistContext.resolve())
        return got.centres, got.counts

    results = TorchThreadWorld(3).results(rank_fn)
    centres, counts = dense([b for rank in range(3) for b in stream(rank, 2 + 2 * rank)])
    assert torch.equal(torch.cat([n for _, n in results]), counts)
    assert (torch.cat([c for c, _ in results]).double() - centres).abs().max() < 1e-6
