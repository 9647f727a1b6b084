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
of a size.

The draw is counter-based (:func:`draw_keys`): each row's score is a hash of the row, the shard's
seed and the step number, which the head keeps in a device tensor (:class:`StepCounter`) that the
step itself advances. Nothing of it lives on the host, so a captured CUDA graph of the step
(:mod:`shardfc.head.capture`) draws a new sample at every replay, the same one the eager step of
that number draws; and the sample is the same on every kind of device (no generator's stream), so
a seed reproduces a run anywhere. The rows a step's forwards used, and a
``sparse_grad`` head's compact gradient of them (:class:`RowGrad`), are what the row-sparse
optimizers of :mod:`shardfc.head.partial_fc` update.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from shardfc.seeding import mix_seed


def num_sampled(num_local: int, sample_rate: float, num_positive: int) -> int:
    """How many classes a shard keeps: ``⌈r·n⌉``, but never fewer than ``num_positive`` (at most
    ``n``). The head passes the global batch size, the most positives a shard can have, so that the
    count is known from shapes alone; :func:`sample_rows` the positives it was given."""
    return min(num_local, max(math.ceil(sample_rate * num_local), num_positive))


def sample_rows(positives: Tensor, num_local: int, sample_rate: float, step: Union[int, Tensor], seed: int = 0) -> Tensor:
    """Sorted row ids to keep: every positive plus uniformly drawn negatives.

    ``positives``: the (unique) rows of this shard that some sample of the global batch is labelled
    with. The draw is step ``step`` of the stream ``seed`` (:func:`draw_keys`).
    """
    present = torch.zeros(num_local, dtype=torch.bool, device=positives.device)
    present[positives] = True
    keep = num_sampled(num_local, sample_rate, positives.numel())
    return sample_present(present, keep, step, seed)


def sample_present(present: Tensor, keep: int, step: Union[int, Tensor], seed: int) -> Tensor:
    """Sorted ids of ``keep`` rows: every row where ``present`` (bool ``[n]``) is set, the rest drawn
    uniformly by :func:`draw_keys` at ``step`` (an int, or an int64 tensor on ``present``'s device:
    nothing crosses to the host)."""
    keys = draw_keys(present, step, seed)
    return keys.topk(keep, sorted=False).indices.sort().values


#: The key of a present row: above every drawn key (those are below 2**32), so positives stay.
PRESENT_KEY = 1 << 32
_M32 = 0xFFFFFFFF


#: Rows the torch form keys at a time: its temporaries stay at one int64 copy of a block (the
#: keys themselves are ``8·n`` bytes), however many classes a shard has.
DRAW_ROWS = 1 << 14


def _mul32_(x: Tensor, c: int) -> Tensor:
    """``x ← (x · c) mod 2**32`` in place for ``x`` in ``[0, 2**32)`` (int64) without an int64
    overflow: the constant's two 16-bit halves multiplied apart (each product below 2**48)."""
    high = (x * (c >> 16)).bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    return x.mul_(c & 0xFFFF).add_(high).bitwise_and_(_M32)


def mix32_(x: Tensor) -> Tensor:
    """A 32-bit integer hash (Wellons' "lowbias32": xor-shifts and odd multipliers, each a bijection
    of 32-bit words) of ``x`` (int64 in ``[0, 2**32)``), in place, staying in ``[0, 2**32)``.
    Non-negative throughout, so ``>>`` is the logical shift."""
    x.bitwise_xor_(x >> 16)
    _mul32_(x, 0x7FEB352D)
    x.bitwise_xor_(x >> 15)
    _mul32_(x, 0x846CA68B)
    return x.bitwise_xor_(x >> 16)


def mix32(x: Tensor) -> Tensor:
    """:func:`mix32_` of a copy of ``x``."""
    return mix32_(x.clone())


def seed_words(seed: int) -> Tuple[int, int]:
    """The two 32-bit words a draw stream mixes in, from its seed (a host number fixed for a
    shard's run, so a launch argument no step changes)."""
    s = mix_seed(seed)
    return s & _M32, (s >> 32) & _M32


def draw_keys(present: Tensor, step: Union[int, Tensor], seed: int) -> Tensor:
    """int64 ``[n]``: a pseudo-random key in ``[0, 2**32)`` per row of step ``step`` of the stream
    ``seed``, all distinct (for a fixed step the map from row to key is a bijection of 32-bit words,
    so the top ``k`` are a uniform sample with no ties to break), and :data:`PRESENT_KEY` where
    ``present`` is set. ``step``: an int, or an int64 tensor of one element on ``present``'s device
    (:class:`StepCounter`), read there: a CUDA graph that captured the draw draws anew at each
    replay as the counter advances. Elementwise integer ops only: the same keys on every device. On
    CUDA (and on the meta device, for ``shardfc plan``) with Triton installed, one kernel computes
    them (:mod:`shardfc.head.fused.draw`; the torch form here is its reference)."""
    s1, s2 = seed_words(seed)
    if present.device.type in ("cuda", "meta") and importlib.util.find_spec("triton") is not None:
        from shardfc.head.fused.draw import draw_keys_

        return draw_keys_(present, step, s1, s2)
    if not isinstance(step, Tensor):
        step = torch.tensor([int(step)], dtype=torch.int64, device=present.device)
    a = mix32_((step.reshape(1) & _M32) ^ s1)
    b = mix32_(a ^ s2)
    n = present.shape[0]
    keys = torch.empty(n, dtype=torch.int64, device=present.device)
    for r0 in range(0, n, DRAW_ROWS):
        block = torch.arange(r0, min(n, r0 + DRAW_ROWS), dtype=torch.int64, device=present.device)
        keys[r0 : r0 + block.numel()] = mix32_(mix32_(block.bitwise_xor_(a)).bitwise_xor_(b))
    return keys.masked_fill_(present, PRESENT_KEY)


class StepCounter:
    """A step number kept on each device a draw runs on (int64, one element), beside the host's
    count of it: a forward reads the device's (:meth:`on`) and advances it there (:meth:`advance`),
    so the step needs no number from the host. The host's mirror says what each device holds, so
    :meth:`on` writes the number (a ``fill_``, no copy, no sync) only when it was set elsewhere (a
    loaded checkpoint's step) — never inside a CUDA graph capture, where that write would be frozen
    into every replay: ask :meth:`on` for it before capturing or replaying (the head's
    ``stage_draw_step`` does)."""

    def __init__(self) -> None:
        self._held: dict = {}  # str(device) -> [tensor, the step it holds]

    def __getstate__(self) -> dict:  # a copy or a pickle of a head makes its tensors again
        return {}

    def __setstate__(self, state: dict) -> None:
        self._held = {}

    def on(self, device: torch.device, step: int) -> Tensor:
        """The counter on ``device``, holding ``step``."""
        from shardfc.head import capture

        slot = self._held.get(str(device))
        if slot is None or slot[1] != step:
            if capture.capturing():  # a counter made or written here would be made or written again by every replay
                raise RuntimeError(
                    f"the Partial FC step counter was set to {step} inside a CUDA graph capture (the device holds "
                    f"{'none' if slot is None else slot[1]}): stage it before capturing or replaying (CapturedHeadStep "
                    "does)")
        if slot is None:
            slot = self._held[str(device)] = [torch.zeros(1, dtype=torch.int64, device=device), 0]
        if slot[1] != step:
            slot[0].fill_(int(step))
            slot[1] = int(step)
        return slot[0]

    def advance(self, device: torch.device) -> None:
        """The step drawn on ``device`` is done: its counter moves on by one (a device op)."""
        slot = self._held[str(device)]
        slot[0].add_(1)
        slot[1] += 1

    def replayed(self, step: int) -> None:
        """A replayed step advanced every device's counter: the mirrors now say ``step``."""
        for slot in self._held.values():
            slot[1] = int(step)

    def tensors(self) -> list:
        """The device tensors (what a captured graph reads and writes)."""
        return [slot[0] for slot in self._held.values()]


def sampling_generator(device: torch.device, seed: int) -> torch.Generator:
    """A generator seeded with ``seed``: on the CUDA device given (no host round trip), else on the
    CPU. (The head's weights are drawn from it, :func:`shardfc.head.layout.init_rows`; Partial FC's
    sample is counter-based, :func:`draw_keys`.)"""
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
