"""Partial FC's sampling: which classes each shard scores in a step, and which rows a step touched.

Every shard keeps a fixed number of classes each step, :func:`num_sampled` of its class count, the
rate and the *global batch size* ``B``: ``⌈r · n_local⌉``, or ``B`` when that is larger (a batch of
``B`` samples has at most ``B`` distinct classes, so every positive fits whatever the labels), never
more than ``n_local``. Its positive classes (some sample of the global batch is labelled with them)
come first, then uniformly drawn negatives: random scores with the positives forced to the top and
``topk``, as insightface's PartialFC_V2 draws them (which, unlike this, reads the positives back with
a ``torch.unique`` every step and, when they outnumber its ``int(r·n_local)``, keeps just them: a
count that depends on the labels). So the sample's shape depends on shapes only, never on the
labels' values: nothing is read back to the host, and a step's shapes are the same for every batch
of a size. The draw is on the shard's device
and seeded per shard and step, so a run reproduces. The rows a step's forwards used, and a
``sparse_grad`` head's compact gradient of them (:class:`RowGrad`), are what the row-sparse
optimizers of :mod:`shardfc.head.partial_fc` update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor


def num_sampled(num_local: int, sample_rate: float, num_positive: int) -> int:
    """How many classes a shard keeps: ``⌈r·n⌉``, but never fewer than ``num_positive`` (at most
    ``n``). The head passes the global batch size, the most positives a shard can have, so that the
    count is known from shapes alone; :func:`sample_rows` the positives it was given."""
    return min(num_local, max(math.ceil(sample_rate * num_local), num_positive))


def sample_rows(positives: Tensor, num_local: int, sample_rate: float, generator: torch.Generator) -> Tensor:
    """Sorted row ids to keep: every positive plus uniformly drawn negatives.

    ``positives``: the (unique) rows of this shard that some sample of the global batch is labelled
    with. Draws come from ``generator`` (on its device) so a seed reproduces the sequence.
    """
    present = torch.zeros(num_local, dtype=torch.bool, device=positives.device)
    present[positives] = True
    keep = num_sampled(num_local, sample_rate, positives.numel())
    return sample_present(present, keep, generator)


def sample_present(present: Tensor, keep: int, generator: torch.Generator) -> Tensor:
    """Sorted ids of ``keep`` rows: every row where ``present`` (bool ``[n]``) is set, the rest drawn
    uniformly from ``generator`` — on its device, so on a GPU nothing crosses to the host."""
    score = torch.rand(present.shape[0], generator=generator, device=generator.device)
    score = score.to(present.device).masked_fill_(present, 2.0)  # above any draw: positives stay
    return score.topk(keep, sorted=False).indices.sort().values


def sampling_generator(device: torch.device, seed: int) -> torch.Generator:
    """The generator of one shard's draw at one step: on the CUDA device the shard lives on (no
    host round trip), else on the CPU. A seed reproduces a run on the same kind of device."""
    gen = torch.Generator(device=device) if device.type == "cuda" else torch.Generator()
    return gen.manual_seed(seed)


def positive_mask(local_labels: Tensor, num_local: int) -> Tensor:
    """bool ``[num_local]``: the rows some label of the global batch falls on (``local_labels``: the
    row of each sample's label in this shard, or −1). Device ops only."""
    hit = torch.where(local_labels >= 0, local_labels, torch.full_like(local_labels, num_local))
    present = torch.zeros(num_local + 1, dtype=torch.bool, device=local_labels.device)
    return present.index_fill_(0, hit, True)[:num_local]


def positives_per_range(labels: Tensor, valid: Tensor, ranges: Sequence[range]) -> List[int]:
    """How many distinct valid labels fall in each class range: one sort of the global batch's
    labels and one read back to the host, for every shard of every rank at once. (The head's sample
    no longer needs it: its size comes from the batch size, with no read of the labels.)"""
    if not ranges:
        return []
    sentinel = ranges[-1].stop
    lab = torch.where(valid, labels, torch.full_like(labels, sentinel)).sort().values
    first = torch.ones_like(lab, dtype=torch.bool)
    first[1:] = lab[1:] != lab[:-1]
    distinct = torch.cat([lab.new_zeros(1), torch.cumsum((first & (lab < sentinel)).long(), 0)])
    edges = torch.tensor([r.start for r in ranges] + [ranges[-1].stop], dtype=lab.dtype, device=lab.device)
    below = distinct[torch.searchsorted(lab, edges)]  # distinct labels < each edge
    return (below[1:] - below[:-1]).tolist()


@dataclass
class RowGrad:
    """A row-sparse weight gradient: ``values[i]`` is the gradient of row ``rows[i]`` (sorted,
    unique); every other row's is zero. What a ``sparse_grad`` head hands its optimizer."""

    rows: Tensor
    values: Tensor


def merge_row_grads(parts: Sequence[Tuple[Tensor, Tensor]]) -> RowGrad:
    """The sum of several ``(rows, values)`` gradients (one per micro-batch) as one :class:`RowGrad`."""
    if len(parts) == 1:
        return RowGrad(*parts[0])
    rows = torch.unique(torch.cat([r for r, _ in parts]))
    first = parts[0][1]
    values = torch.zeros((rows.numel(),) + tuple(first.shape[1:]), dtype=first.dtype, device=first.device)
    for r, g in parts:
        values.index_add_(0, torch.searchsorted(rows, r), g)
    return RowGrad(rows, values)


def union_rows(previous: Optional[Tensor], rows: Optional[Tensor]) -> Optional[Tensor]:
    """Rows used by two forwards of one step, ``None`` standing for every row (a ``torch.unique``:
    a host read; the head unites its micro-batches' rows only when the optimizer asks for them)."""
    if previous is None or rows is None:
        return None
    return united([previous, rows])


def united(parts: Sequence[Tensor]) -> Tensor:
    """The sorted distinct rows of several forwards' samples (one ``torch.unique``; on a GPU a host
    read, so the head calls it at the optimizer's step, never in a forward)."""
    if len(parts) == 1:
        return parts[0]
    return torch.unique(torch.cat([p.to(parts[0].device) for p in parts]))
