"""Weight imprinting: a class's centre is the normalised mean of its images' normalised embeddings.

(Qi, Brown & Lowe, "Low-Shot Learning with Imprinted Weights", CVPR 2018.) A head imprinted from
a trained backbone classifies well at step 0, where random centres start at chance.

:func:`imprint_centres` computes it sharded and streaming, in one pass: each rank feeds the
embeddings of its own images, the global batch is gathered (the exchange the head's forward
makes), and each rank adds into fp32 sums only the rows of its own classes, ``[n_local, D]``.
No rank ever holds ``[C, D]``. Ranks may have different numbers of batches (and batches of
any size, including 0): each round the ranks agree on the batch sizes and whether anyone has
data left.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Tuple

import torch
from torch import Tensor

from shardfc.head.normalize import normalized_rows
from shardfc.parallel.context import DistContext

__all__ = ["Imprinted", "imprint_centres"]


@dataclass
class Imprinted:
    """What :func:`imprint_centres` returns for one rank.

    Attributes:
        class_range: the global class ids the rows are for.
        centres: ``[n, D]`` fp32, unit rows: the normalised sum of each class's normalised
            embeddings; zero for a class without images.
        counts: ``[n]`` int64, the images seen per class.
    """

    class_range: range
    centres: Tensor
    counts: Tensor

    @property
    def missing(self) -> Tensor:
        """Global ids of this range's classes that had no image (their centre is zero)."""
        return torch.nonzero(self.counts == 0).flatten() + self.class_range.start


def imprint_centres(
    batches: Iterable[Tuple[Tensor, Tensor]],
    class_range: range,
    embedding_dim: int,
    context: Optional[DistContext] = None,
    device: Optional[torch.device] = None,
) -> Imprinted:
    """Imprint the centres of ``class_range`` from a stream of ``(embeddings [b, D], labels [b])``.

    Each embedding is normalised in fp32 and added to its class's fp32 sum; the sums are
    normalised at the end. Labels outside every rank's class range (e.g. old classes, or an
    ignore index) are skipped. Collective over ``context`` when it is distributed: call it on
    every rank, each with its own batches and its own ``class_range`` (the ranges of the ranks
    must not overlap, e.g. :meth:`~shardfc.head.ShardedMarginHead.state_layout`'s).

    Args:
        batches: this rank's ``(embeddings, labels)``, e.g. a backbone's outputs in eval mode under
            ``torch.no_grad()``; any float dtype and device.
        class_range: the classes whose centres this rank accumulates.
        embedding_dim: ``D``.
        context: the ranks to combine over (None or not distributed: this process only).
        device: where the fp32 sums live (default: the context's device; the CPU without one).

    Returns:
        An :class:`Imprinted` for ``class_range``.

    Raises:
        ValueError: a batch whose shapes disagree with ``embedding_dim`` or with each other; any
            embedding holding NaN or inf (a broken or diverged backbone: its class's centre would be
            NaN, and the head's loss NaN from the first step), on every rank, after the pass.
    """
    ctx = context if context is not None else DistContext()
    n, start = len(class_range), class_range.start
    device = torch.device(device) if device is not None else ctx.device
    sums = torch.zeros(n, embedding_dim, dtype=torch.float32, device=device)
    counts = torch.zeros(n, dtype=torch.int64, device=device)
    # Rows seen and rows not finite, counted on the device (no sync per batch) over the gathered
    # global batches, so every rank holds the same counts and refuses together at the end.
    seen = torch.zeros((), dtype=torch.int64, device=device)
    non_finite = torch.zeros((), dtype=torch.int64, device=device)
    stream = iter(batches)
    while True:
        batch = next(stream, None)
        if batch is not None:
            x, labels = batch
            if x.dim() != 2 or x.shape[1] != embedding_dim or labels.shape != (x.shape[0],):
                raise ValueError(
                    f"imprint_centres: embeddings {tuple(x.shape)} and labels {tuple(labels.shape)} must be "
                    f"[b, {embedding_dim}] and [b]"
                )
            x, _ = normalized_rows(x.detach().to(torch.float32))
            labels = labels.detach().to(torch.int64)
        else:
            x, labels = sums.new_empty(0, embedding_dim), counts.new_empty(0)
        if ctx.distributed:
            # One small all-reduce per round: each rank's batch size (-1: it has no data left).
            sizes_t = torch.zeros(ctx.world_size, dtype=torch.int64, device=ctx.comm_device)
            sizes_t[ctx.rank] = x.shape[0] if batch is not None else -1
            ctx.all_reduce_(sizes_t, "sum")
            sizes = sizes_t.tolist()
            if all(s < 0 for s in sizes):
                break
            sizes = [max(s, 0) for s in sizes]
            x = ctx.all_gather_rows(x.to(ctx.comm_device), sizes)
            labels = ctx.all_gather_rows(labels.to(ctx.comm_device), sizes)
        elif batch is None:
            break
        x, labels = x.to(device), labels.to(device)
        seen += x.shape[0]
        non_finite += (~torch.isfinite(x)).any(dim=1).sum()
        local = labels - start
        keep = (local >= 0) & (local < n)
        local, x = local[keep], x[keep]
        sums.index_add_(0, local, x)
        counts.index_add_(0, local, torch.ones_like(local))
    bad, total = int(non_finite), int(seen)
    if bad:
        raise ValueError(
            f"imprint_centres: {bad} of the {total} embeddings hold NaN or inf (a broken or diverged "
            "backbone, e.g. one that overflows under float16): centres imprinted from them would be NaN"
        )
    centres, _ = normalized_rows(sums)
    return Imprinted(class_range, centres, counts)
