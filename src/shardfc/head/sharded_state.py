"""A class-sharded head's state as one block of classes, whatever its sharding: what a resharding
checkpoint saves per process and loads into a head of any number of shards, in any mode.

:meth:`ShardedMarginHead.sharded_state` and :meth:`~ShardedMarginHead.load_sharded_state` call
these; the checkpoint package and the trainer only see the dicts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional

import torch
from torch import Tensor

from shardfc.checks import integer_value
from shardfc.head.partial_fc import load_optimizer_rows, loadable_optimizer_rows, optimizer_rows

if TYPE_CHECKING:
    from shardfc.head.module import ShardedMarginHead

__all__ = ["sharded_state", "load_sharded_state"]


def sharded_state(head: "ShardedMarginHead", optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[str, Any]:
    """This process's part of the head's state, as one block of classes whatever its sharding.

    Returns ``{"num_classes": C, "class_range": range(start, stop), "tensors": {...}, "extras": {...}}``
    (the form :func:`shardfc.checkpoint.save_checkpoint` takes as ``head_state``):

    * ``tensors``: ``"weight"`` ``[n, D]`` (``n = stop - start``) and, with ``optimizer``,
      ``"optimizer.<key>"`` for each per-row state tensor (``momentum_buffer``; ``exp_avg``,
      ``exp_avg_sq``, the row-sparse AdamW's ``row_step``), each ``[n, ...]``. Detached CPU
      tensors, the local shards' rows concatenated in class order (a single CPU shard's are
      returned without a copy: they share memory with the live ones).
    * ``extras``: ``"sample_step"`` (the Partial FC step counter) and, with ``optimizer``,
      ``"optimizer.<key>"`` for state that is not per row (torch AdamW's scalar ``step``) and
      ``"optimizer.param_groups"`` (its hyper-parameters).

    Saved per process and loaded with :func:`load_sharded_state` into a head of any number of
    shards, in any mode, the logical weights and optimizer rows are the same.
    """
    weights = head.shard_weights
    parts = [w.detach().cpu() for w in weights]
    tensors = {"weight": parts[0] if len(parts) == 1 else torch.cat(parts)}
    extras: Dict[str, Any] = {"sample_step": int(head.sample_step)}
    if optimizer is not None:
        opt_tensors, opt_extras = optimizer_rows(optimizer, weights)
        tensors.update({f"optimizer.{k}": v for k, v in opt_tensors.items()})
        extras.update({f"optimizer.{k}": v for k, v in opt_extras.items()})
    if hasattr(head.margin, "state"):  # AdaFace's running norm statistics
        extras.update({f"margin.{k}": v for k, v in head.margin.state().items()})
    if head.subcenters > 1:  # class-indexed: [n, K, ...], so a checkpoint reshards by class
        tensors = {k: _by_class(v, head.subcenters) for k, v in tensors.items()}
    return {**head.state_layout(), "tensors": tensors, "extras": extras}


def load_sharded_state(
    head: "ShardedMarginHead", state: Mapping[str, Any], optimizer: Optional[torch.optim.Optimizer] = None
) -> None:
    """Load a :func:`sharded_state` dict holding this process's classes (e.g. read from a
    checkpoint saved with any sharding: ``LoadedCheckpoint.head_state``) into the local shards,
    and with ``optimizer`` (built over this head) its state and hyper-parameters too.

    Raises:
        ValueError: ``state`` is for other classes, or its tensors have the wrong shape.
    """
    tensors = state.get("tensors") if isinstance(state, Mapping) else None
    if not isinstance(tensors, Mapping) or not isinstance(tensors.get("weight"), torch.Tensor):  # was a KeyError
        shown = f"keys {sorted(map(str, state))}" if isinstance(state, Mapping) else f"a {type(state).__name__}"
        raise ValueError(f"state must be a sharded_state() dict, whose 'tensors' hold the 'weight'; got {shown}")
    layout = head.state_layout()
    for key, mine in layout.items():
        if key in state and state[key] != mine:
            raise ValueError(f"sharded state has {key}={state[key]!r}, this head has {key}={mine!r}")
    extras = state.get("extras", {})
    weight = tensors["weight"]
    n, K = len(head.class_range), head.subcenters
    expected = (n, head.embedding_dim) if K == 1 else (n, K, head.embedding_dim)
    if tuple(weight.shape) != expected:
        raise ValueError(
            f"sharded state weight has shape {tuple(weight.shape)}, this head's (subcenters={K}) "
            f"is {expected}"
        )
    if K > 1:  # back to centre rows; slices below count rows
        tensors = {k: v.reshape(v.shape[0] * K, *v.shape[2:]) for k, v in tensors.items()}
    weight = tensors["weight"]
    base = head.class_range.start
    slices = [((r.start - base) * K, (r.stop - base) * K) for r in head.shard_ranges]
    sample_step = integer_value(extras.get("sample_step", 0))
    if sample_step is None or sample_step < 0:  # int() took 1.5 as step 1 and "x" as a bare ValueError
        raise ValueError(f"sharded state's sample_step (the Partial FC draw's step) must be an int >= 0, got "
                         f"{extras.get('sample_step')!r}")
    if optimizer is not None:  # checked before any row is written
        opt_tensors = {_optimizer_key(k): v for k, v in tensors.items() if k.startswith("optimizer.")}
        opt_extras = {_optimizer_key(k): v for k, v in extras.items() if k.startswith("optimizer.")}
        loadable_optimizer_rows(optimizer, slices, opt_tensors, opt_extras)
    if hasattr(head.margin, "load_state"):  # first: it checks its values, before any row is written
        margin_state = {k[len("margin."):]: v for k, v in extras.items() if k.startswith("margin.")}
        if margin_state:
            head.margin.load_state(margin_state)
    with torch.no_grad():
        for w, (lo, hi) in zip(head.shard_weights, slices):
            w.copy_(weight[lo:hi])
    head.sample_step = sample_step
    head.forget_sampled_rows()
    if optimizer is not None:
        load_optimizer_rows(optimizer, head.shard_weights, slices, opt_tensors, opt_extras)


def _optimizer_key(name: str) -> str:
    """``optimizer.<key>`` -> ``key``; checkpoints of format 1 named it ``optimizer.0.<key>`` (one shard)."""
    key = name[len("optimizer."):]
    index, dot, rest = key.partition(".")
    if dot and index.isdigit():
        if index != "0":
            raise ValueError(f"head state {name!r} is for a parameter other than the head weight")
        return rest
    return key


def _by_class(t: Tensor, K: int) -> Tensor:
    """Per-centre-row state ``[n·K, ...]`` as ``[n, K, ...]``."""
    return t.reshape(t.shape[0] // K, K, *t.shape[1:])
