"""Growing a class-sharded head by new classes without moving a trained row.

New classes are appended after the old ones: class ``c < C`` keeps id ``c`` and its centre, and
its optimizer state (momentum, Adam moments, the row-sparse AdamW's per-row step), bit for bit;
new classes get ids ``C .. C + n - 1``, the rows given (imprinted: :mod:`shardfc.head.imprint`)
or the head's own seeded ``N(0, 0.01²)`` rows, and zero momentum and moments. AdamW's step count
is what torch's ``AdamW`` over the grown weight has: its one scalar ``step``, shared by all rows,
stays what it was, so a new row's first update is bias-corrected as step ``T + 1``; the row-sparse
AdamW's per-row ``row_step`` of the new rows is the count every old row shares (``T``: every row of
a dense or ``idle_rows="exact"`` run), the same update, so a head grows alike under either
optimizer (Partial FC, bf16 centres, the fused update or none). Where the old rows' counts differ
(``idle_rows="lazy"``, which counts a row's own updates) the new rows' count is 0, their own.

The shards are then balanced over the ranks for the new class count as
:func:`~shardfc.head.layout.class_ranges` says, so a row may change rank. Two ways to do it:

* :func:`grown_state`: a pure function on :meth:`~shardfc.head.ShardedMarginHead.sharded_state`
  dicts. Give it the old rows of this process's *new* class range (e.g. read with
  :func:`shardfc.checkpoint.load_checkpoint` for ``class_range ∩ [0, C)``: the resharding path)
  and it returns the state to load into a head of ``C + n`` classes.
* :func:`grow_head`: in memory, in every layout (process group, devices, single). The head's
  parameters are replaced by larger ones, in the optimizer too. In process-group mode each rank's
  old block is sent to all ranks in turn (one shard in flight at a time, never ``[C, D]``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Dict, Mapping, Optional, Union

import torch
from torch import Tensor, nn

from shardfc.head.layout import class_ranges, overlap, seeded_rows
from shardfc.parallel.context import DistContext

if TYPE_CHECKING:
    from shardfc.head.module import ShardedMarginHead

__all__ = ["grown_state", "grow_head", "shared_row_step", "NewRows", "ROW_STEP"]

#: The rows of the new classes: a tensor holding all ``n`` of them (``[n, D]``, or ``[n, K, D]``
#: with sub-centres), a function ``rows(range of new class ids) -> tensor`` for those classes
#: (what a sharded caller gives: it is asked only for its own), or None for the head's seeded
#: random rows.
NewRows = Union[Tensor, Callable[[range], Tensor], None]


#: The key of the row-sparse AdamW's per-row step count in a sharded state's tensors.
ROW_STEP = "optimizer.row_step"


def shared_row_step(tensors: Mapping[str, Tensor], ctx: Optional[DistContext] = None) -> float:
    """The per-row step count (:data:`ROW_STEP`) that every old row of the head shares, over all
    ranks when ``ctx`` is a distributed context (one all-reduce: call it on every rank); 0 when the
    rows' counts differ, there is none, or no rank holds a row. :func:`grown_state`'s
    ``new_row_step``."""
    steps = tensors.get(ROW_STEP)
    held = steps is not None and steps.numel() > 0
    # [max, -min] in one all-reduce of max; -inf where this rank holds no count
    span = torch.tensor([float(steps.max()), -float(steps.min())] if held else [-math.inf, -math.inf],
                        dtype=torch.float64)
    if ctx is not None and ctx.distributed:
        span = ctx.all_reduce_(span.to(ctx.comm_device), "max").cpu()
    high, low = float(span[0]), -float(span[1])
    return high if math.isfinite(high) and high == low else 0.0


def grown_state(
    old: Mapping[str, Any], num_classes: int, class_range: range, new_rows: Callable[[range], Tensor],
    new_row_step: float = 0.0,
) -> Dict[str, Any]:
    """The sharded state of ``class_range`` in a head of ``num_classes`` classes grown from ``old``.

    Args:
        old: a :func:`~shardfc.head.sharded_state.sharded_state` dict of the old head (its
            ``num_classes`` is the old ``C``) holding exactly the rows ``class_range ∩ [0, C)``.
        num_classes: the grown class count ``C + n`` (``>= C``).
        class_range: the classes of the grown head this process holds.
        new_rows: ``new_rows(r)`` gives the centres of the new classes ``r = class_range ∩ [C, C + n)``
            (global ids), shaped like ``old``'s weight rows.
        new_row_step: the new rows' per-row AdamW step count (:data:`ROW_STEP`), where ``old`` has
            one: :func:`shared_row_step` of the old head's rows makes the grown head's next steps
            those of torch's ``AdamW`` (see the module).

    Returns:
        ``{"num_classes", "class_range", "tensors", "extras"}`` for
        :meth:`~shardfc.head.ShardedMarginHead.load_sharded_state`: the old rows as they were, the
        new ones after them, every per-row optimizer tensor zero on the new rows but the step count.

    Raises:
        ValueError: ``num_classes`` is smaller than the old count, ``old`` holds other rows, or the
            new rows have the wrong shape.
    """
    C = int(old["num_classes"])
    if num_classes < C:
        raise ValueError(f"num_classes={num_classes} is smaller than the head's {C} classes: a head only grows")
    kept, added = overlap(class_range, range(C)), overlap(class_range, range(C, num_classes))
    tensors = old["tensors"]
    weight = tensors["weight"]
    if weight.shape[0] != len(kept):
        raise ValueError(f"the old state holds {weight.shape[0]} rows, class range {kept} of the old head has {len(kept)}")
    rows = new_rows(added) if len(added) else weight.new_empty(0, *weight.shape[1:])
    rows = torch.as_tensor(rows)
    if tuple(rows.shape) != (len(added), *weight.shape[1:]):
        raise ValueError(
            f"new rows for classes {added.start}..{added.stop - 1} have shape {tuple(rows.shape)}, "
            f"expected {(len(added), *weight.shape[1:])}"
        )
    _check_finite(rows, added)  # a function's rows: this rank's classes
    out = {}
    for key, t in tensors.items():
        if key == "weight":
            fill = rows.to(t.dtype)
        else:
            fill = t.new_full((len(added), *t.shape[1:]), new_row_step if key == ROW_STEP else 0)
        out[key] = torch.cat([t, fill.to(t.device)]) if len(added) else t
    return {"num_classes": num_classes, "class_range": class_range, "tensors": out, "extras": dict(old.get("extras", {}))}


def _rows_function(head: "ShardedMarginHead", rows: NewRows, first: int, n: int) -> Callable[[range], Tensor]:
    if rows is None:
        return seeded_rows(head.init_seed, head.subcenters, head.embedding_dim)
    if callable(rows):
        return rows
    K, D = head.subcenters, head.embedding_dim
    expected = (n, D) if K == 1 else (n, K, D)
    if tuple(rows.shape) != expected:
        raise ValueError(f"rows has shape {tuple(rows.shape)}, growing by {n} classes needs {expected}")
    _check_finite(rows, range(first, first + n))  # all of them, on every rank, before any collective
    return lambda r: rows[r.start - first : r.stop - first]


def _check_finite(rows: Tensor, classes: range) -> None:
    """A ValueError naming the first class of ``classes`` whose new centre holds NaN or inf (one
    read per grow, not per step)."""
    if rows.is_floating_point() and not bool(torch.isfinite(rows).all()):
        first_bad = int((~torch.isfinite(rows)).reshape(len(rows), -1).any(dim=1).nonzero()[0, 0])
        raise ValueError(
            f"new rows for classes {classes.start}..{classes.stop - 1} hold NaN or inf (class {classes.start + first_bad}): "
            "every logit against such a centre is NaN, and so is the loss"
        )


def _old_rows_of(head: "ShardedMarginHead", mine: Mapping[str, Any], wanted: range) -> Dict[str, Tensor]:
    """The old head's tensors for classes ``wanted`` (within the old ``[0, C)``), wherever they live now.

    Process-group mode: every rank's old block goes to all ranks in turn, each keeping its overlap;
    a rank holds at most one other block at a time."""
    tensors = mine["tensors"]
    if not head.distributed:
        base = head.class_range.start
        return {k: v[wanted.start - base : wanted.stop - base] for k, v in tensors.items()}
    old_ranges = class_ranges(head.num_classes, head.world_size)
    pieces: Dict[str, list] = {k: [] for k in tensors}
    for j, r in enumerate(old_ranges):
        sizes = [len(r) if i == j else 0 for i in range(head.world_size)]
        part = overlap(wanted, r)
        for key, t in tensors.items():
            send = t if j == head.rank else t[:0]
            block = head.ctx.all_gather_rows(send.to(head.ctx.comm_device), sizes)
            if len(part):
                pieces[key].append(block[part.start - r.start : part.stop - r.start].cpu())
    return {k: torch.cat(v) if v else tensors[k][:0] for k, v in pieces.items()}


def grow_head(
    head: "ShardedMarginHead", n: int, rows: NewRows = None, optimizer: Optional[torch.optim.Optimizer] = None
) -> "ShardedMarginHead":
    """Grow ``head`` in place by ``n`` classes (ids ``C .. C + n - 1``), keeping every old row.

    Old centres and, with ``optimizer``, their optimizer state stay bit-identical; the new
    classes' state is zero (see the module docstring). The shards are rebalanced for ``C + n``
    classes. Collective in process-group mode: call it on every rank with the same ``n``.

    Args:
        head: the head to grow (any layout; its parameters are replaced by larger ones).
        n: number of classes to add (``>= 0``).
        rows: the new centres (see :data:`NewRows`); None: the head's seeded random rows, as if
            it had been built with ``C + n`` classes.
        optimizer: the head's optimizer (:func:`~shardfc.head.partial_fc.head_optimizer` or a
            torch optimizer over exactly the head's parameters): its parameters are swapped for the
            new ones and its per-row state grown with them.

    Returns:
        ``head`` itself.

    Raises:
        ValueError: ``n`` is negative, ``ignore_index`` would become a class id, or ``rows`` has
            the wrong shape.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0 (classes to add), got {n!r}")
    if n == 0:
        return head
    C, total = head.num_classes, head.num_classes + n
    if 0 <= head.ignore_index < total:
        raise ValueError(f"ignore_index={head.ignore_index} would be a class id of the grown head (0..{total - 1})")
    new_rows = _rows_function(head, rows, C, n)
    mine = head.sharded_state(optimizer)
    shards = len(head.devices)
    new_range = class_ranges(total, head.world_size)[head.rank] if head.distributed else range(total)
    old_part = _old_rows_of(head, mine, overlap(new_range, range(C)))
    old = {"num_classes": C, "tensors": old_part, "extras": mine["extras"]}
    row_step = shared_row_step(mine["tensors"], head.ctx if head.distributed else None) if optimizer else 0.0
    state = grown_state(old, total, new_range, new_rows, row_step)

    old_params = head.shard_weights
    head.num_classes = total
    head.class_range = new_range
    head.shard_ranges = class_ranges(total, shards) if head.mode == "devices" else [new_range]
    K, D = head.subcenters, head.embedding_dim
    new_params = [
        nn.Parameter(torch.empty(len(r) * K, D, dtype=p.dtype, device=p.device))
        for r, p in zip(head.shard_ranges, old_params)
    ]
    if head.mode == "devices":
        head.shards = nn.ParameterList(new_params)
    else:
        head.weight = new_params[0]
    if optimizer is not None:
        swap = {id(p): q for p, q in zip(old_params, new_params)}
        for group in optimizer.param_groups:
            group["params"] = [swap.get(id(p), p) for p in group["params"]]
        for p in old_params:
            optimizer.state.pop(p, None)
    head.load_sharded_state(state, optimizer)
    return head
