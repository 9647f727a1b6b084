"""How class ids are split across the ranks of a class-sharded classifier head.

With ``num_shards`` (W) ranks, class ids ``[0, num_classes)`` are cut into W
contiguous ranges in rank order. The first ``num_classes % num_shards`` ranks
hold one extra class, so shard sizes differ by at most one. When
``num_classes < num_shards`` the later ranks get empty ranges.

Example: ``class_ranges(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]``.

The initial rows of those classes live here too: :func:`init_rows` draws any range of the logical
weight matrix the same for any sharding (the head, growing it, fine-tuning's new classes and the
baselines all draw from it), :func:`seeded_rows` shapes them per class, and :func:`overlap` is the
part of a class range a shard holds.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
from torch import Tensor

from shardfc.checks import check_positive_int
from shardfc.head.sampling import sampling_generator
from shardfc.parallel.partition import split_evenly
from shardfc.seeding import mix_seed

__all__ = ["class_ranges", "class_range", "overlap", "init_rows", "seeded_rows", "INIT_BLOCK", "INIT_STD"]


def overlap(a: range, b: range) -> range:
    """The ids ranges ``a`` and ``b`` (step 1) share, as a range (empty, at ``a``'s or ``b``'s start, when none)."""
    lo = max(a.start, b.start)
    return range(lo, max(lo, min(a.stop, b.stop)))


def class_range(num_classes: int, num_shards: int, index: int) -> range:
    """Return the contiguous class-id range held by shard ``index``.

    Args:
        num_classes: Total number of classes C (int >= 1).
        num_shards: Number of shards W (int >= 1).
        index: Shard (rank) index in ``[0, num_shards)``.

    Returns:
        ``range(start, stop)``; empty when ``index >= num_classes``.

    Raises:
        ValueError: If an argument is not an int in its valid domain.
    """
    check_positive_int("num_classes", num_classes)
    check_positive_int("num_shards", num_shards)
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < num_shards:
        raise ValueError(f"index must be an int in [0, num_shards={num_shards}), got {index!r}")
    sizes = split_evenly(num_classes, num_shards)
    start = sum(sizes[:index])
    return range(start, start + sizes[index])


def class_ranges(num_classes: int, num_shards: int) -> list[range]:
    """Return the class-id range of every shard, in rank order.

    The ranges are contiguous, disjoint and cover ``[0, num_classes)`` exactly.

    Raises:
        ValueError: If ``num_classes`` or ``num_shards`` is not an int >= 1.
    """
    check_positive_int("num_classes", num_classes)
    check_positive_int("num_shards", num_shards)
    return [class_range(num_classes, num_shards, i) for i in range(num_shards)]


#: Weights are initialised in blocks of this many classes, each from its own seeded generator,
#: so the logical weight matrix is the same whatever the number of shards.
INIT_BLOCK = 4096
INIT_STD = 0.01


def init_rows(start: int, stop: int, dim: int, seed: int, device: Optional[Union[str, torch.device, int]] = None) -> Tensor:
    """Rows ``[start, stop)`` of the logical ``N(0, 0.01²)`` weight matrix for ``seed`` (fp32).

    Each block of :data:`INIT_BLOCK` rows is drawn whole from its own generator, seeded by ``(seed,
    block)``, so any sharding gets the same rows. ``device``: a CUDA device draws them there, with a
    generator on that device (:func:`~shardfc.head.sampling.sampling_generator`): no pass of the
    host's generator over millions of rows and no copy of them to the GPU, but other values than
    the CPU's (CUDA's Philox stream, not the CPU's Mersenne Twister), the same for any sharding on
    GPUs of one model. Any other device (default: the CPU) gets the CPU's draw, the values of every
    earlier release, on the CPU.
    """
    device = torch.device("cpu") if device is None else torch.device(device)
    on = device if device.type == "cuda" else torch.device("cpu")
    out = torch.empty(stop - start, dim, device=on)
    first, last = start // INIT_BLOCK, (stop - 1) // INIT_BLOCK if stop > start else -1
    for block in range(first, last + 1):
        g = sampling_generator(on, mix_seed(seed, block))
        rows = torch.randn(INIT_BLOCK, dim, generator=g, device=on) * INIT_STD
        b0 = block * INIT_BLOCK
        lo, hi = max(start, b0), min(stop, b0 + INIT_BLOCK)
        out[lo - start : hi - start] = rows[lo - b0 : hi - b0]
    return out


def seeded_rows(seed: int, subcenters: int, dim: int) -> Callable[[range], Tensor]:
    """``rows(r)``: the seeded ``N(0, 0.01²)`` rows of classes ``r`` (:func:`init_rows`; the same for
    any sharding), ``[len(r), D]``, or ``[len(r), K, D]`` with ``K`` sub-centres per class."""
    K, D = subcenters, dim

    def rows(r: range) -> Tensor:
        out = init_rows(r.start * K, r.stop * K, D, seed)
        return out if K == 1 else out.view(len(r), K, D)

    return rows

