"""Input checks that raise the same clear error on every rank.

A check that fails on one rank only must not leave the other ranks waiting in a collective. So
each rank runs its local checks *before* any collective, then the ranks exchange one small
header ``[local batch size, error kind, value flags]``; if any rank failed, every rank raises,
naming the rank and the problem. The header doubles as the exchange of local batch sizes the
gathers need. The value checks (finite embeddings, labels in range) run on the device and travel
in the header, so they add no host synchronisation to the one the exchange needs.

In one process (no exchange) reading the value checks would be a host sync of its own, the only
one of a step. With ``validate="deferred"`` (the default on CUDA: :func:`defers`) a forward only
starts them — flags computed on the device, copied without blocking to pinned host memory, a CUDA
event recorded — and :class:`PendingCheck` reads them at the start of the *next* forward (or at
:meth:`~shardfc.head.module.ShardedMarginHead.check_pending`), when the GPU has long finished them:
the error names the same row and value, and which forward's batch it was, one call late. Types,
shapes and devices are checked on the host, at once, in every mode.
"""

from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from shardfc.checks import check_positive_int, check_probability
from shardfc.parallel.context import DistContext


class NonFiniteEmbeddingsError(ValueError):
    """The embeddings hold a NaN or an infinity. In training, after the first step, most often the
    backbone diverged (the trainer says so: :mod:`shardfc.train.loop`)."""


_KINDS = {None: 0, ValueError: 1, TypeError: 2, NonFiniteEmbeddingsError: 3}
_TYPES = {1: ValueError, 2: TypeError, 3: NonFiniteEmbeddingsError}
#: Device-side checks read with the exchange (:func:`value_flags`): non-finite embeddings, bad labels.
_FLAGS = 2


def check_embeddings(embeddings, embedding_dim: int, values: bool = True) -> Optional[Exception]:
    """Type and shape of the embeddings, and with ``values`` that they are finite (a host sync)."""
    if not isinstance(embeddings, Tensor):
        return TypeError(f"embeddings must be a torch.Tensor, got {type(embeddings).__name__}")
    if not embeddings.is_floating_point():
        return TypeError(f"embeddings must be floating point, got dtype={embeddings.dtype}")
    if embeddings.dim() != 2:
        return ValueError(
            f"embeddings must be 2-D [batch, embedding_dim], got shape {tuple(embeddings.shape)}"
        )
    if embeddings.shape[1] != embedding_dim:
        return ValueError(
            f"embeddings has width {embeddings.shape[1]} but the head's embedding_dim is "
            f"{embedding_dim} (shape {tuple(embeddings.shape)})"
        )
    if values and embeddings.numel() and not bool(torch.isfinite(embeddings).all()):
        return embeddings_value_error(embeddings)
    return None


def embeddings_value_error(embeddings: Tensor) -> Exception:
    """The error for embeddings known to hold a non-finite value, naming the first bad row."""
    bad = int((~torch.isfinite(embeddings)).any(dim=1).nonzero()[0])
    return NonFiniteEmbeddingsError(
        f"embeddings contain non-finite values (row {bad}: {embeddings[bad][:4].tolist()}...); "
        "fix the backbone or skip the batch"
    )


def check_labels(labels, batch: int) -> Optional[Exception]:
    """Type and shape of the labels. Their range is checked on the device (:func:`value_flags`)."""
    if not isinstance(labels, Tensor):
        return TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dtype == torch.bool or labels.is_floating_point() or labels.is_complex():
        return TypeError(f"labels must be an integer tensor, got dtype={labels.dtype}")
    if labels.dim() != 1:
        return ValueError(f"labels must be 1-D [batch], got shape {tuple(labels.shape)}")
    if labels.shape[0] != batch:
        return ValueError(
            f"labels has {labels.shape[0]} entries but embeddings has {batch} rows"
        )
    return None


def _bad_labels(labels: Tensor, num_classes: int, ignore_index: int) -> Tensor:
    return ((labels < 0) | (labels >= num_classes)) & (labels != ignore_index)


def labels_value_error(labels: Tensor, num_classes: int, ignore_index: int) -> Exception:
    """The error for labels known to hold a value out of range, naming the first."""
    i = int(_bad_labels(labels, num_classes, ignore_index).nonzero()[0])
    return ValueError(
        f"labels[{i}] = {int(labels[i])} is outside [0, num_classes={num_classes}) "
        f"and is not ignore_index={ignore_index}"
    )


def value_flags(embeddings: Tensor, labels: Tensor, num_classes: int, ignore_index: int) -> Tensor:
    """``[2]`` int64 on the embeddings' device, no host sync: whether any embedding is non-finite,
    whether any label is out of range. Read with the batch-size exchange, which syncs anyway."""
    nonfinite = ~torch.isfinite(embeddings).all() if embeddings.numel() else torch.zeros((), dtype=torch.bool)
    bad = _bad_labels(labels.to(embeddings.device), num_classes, ignore_index).any()
    return torch.stack([nonfinite.to(embeddings.device), bad]).to(torch.int64)


def raise_or_exchange_sizes(
    error: Optional[Exception], local_batch: int, ctx: DistContext,
    flags: Optional[Tensor] = None, describe: Optional[Callable[[List[int]], Exception]] = None,
) -> List[int]:
    """Raise ``error`` (on every rank of ``ctx``'s group); else return every rank's batch size.

    ``flags``: device-side checks (:func:`value_flags`) read with the exchange, so they cost no
    host sync of their own: the header ``[batch, kind, flags...]`` goes to the host once, as the
    batch sizes must. ``describe(flags)`` builds the error of a rank whose flags are set (only then
    are its inputs read again to name the bad row); a call site that checks values passes it on
    every rank (with ``flags`` None where a host check already failed).
    """
    if not ctx.distributed:
        if error is None and flags is not None:
            raised = flags.tolist()  # the one sync of a single process's checks
            if any(raised):
                error = describe(raised)
        if error is not None:
            raise error
        return [local_batch]
    kind = _KINDS.get(type(error), 1) if error is not None else 0
    # A call site with value checks (``describe`` given) sends the flag columns on every rank, also
    # from a rank that failed a host check and has no flags (zeros): the widths must match.
    header = torch.zeros(1, 2 + (_FLAGS if describe is not None else 0), dtype=torch.int64, device=ctx.comm_device)
    header[0, 0], header[0, 1] = local_batch, kind
    if flags is not None:
        header[0, 2:] = flags.to(ctx.comm_device, torch.int64)
    world = ctx.world_size
    table = ctx.all_gather_rows(header, [1] * world).cpu()
    if describe is not None:
        mine = table[ctx.rank, 2:].tolist()
        if error is None and any(mine):
            error = describe(mine)
        # a rank whose only failure is a flag: the kind of the error its describe() makes (embeddings first)
        flagged = (table[:, 1] == 0) & table[:, 2:].any(dim=1)
        kind = torch.where(table[:, 2] != 0, _KINDS[NonFiniteEmbeddingsError], _KINDS[ValueError])
        table[:, 1] = torch.where(flagged, kind, table[:, 1])
    kinds = table[:, 1].tolist()
    if any(kinds):
        messages = ctx.all_gather_object(None if error is None else str(error))
        failed = [(r, messages[r]) for r in range(world) if kinds[r]]
        text = "; ".join(f"rank {r}: {m}" for r, m in failed)
        me = ctx.rank
        if error is not None:
            raise type(error)(text if len(failed) > 1 else f"rank {me}: {error}")
        raise _TYPES.get(kinds[failed[0][0]], ValueError)(text)
    return table[:, 0].tolist()


def check_batch_and_exchange_sizes(
    embeddings, labels, *, embedding_dim: int, num_classes: int, ignore_index: int,
    ctx: DistContext,
) -> List[int]:
    """Check a head's inputs, raise on every rank if any rank's are bad, else return all batch sizes.

    Types and shapes are checked on the host; the values (finite embeddings, labels in range) on
    the device, read with the batch-size exchange: no host sync beyond the one that exchange needs
    (one in a single process, where :func:`check_batch_deferred` avoids it), where reading each
    check would stall the GPU twice a step.
    """
    error = check_embeddings(embeddings, embedding_dim, values=False)
    if error is None:
        error = check_labels(labels, embeddings.shape[0])
    flags = value_flags(embeddings, labels, num_classes, ignore_index) if error is None else None

    def describe(raised: List[int]) -> Exception:
        if raised[0]:
            return embeddings_value_error(embeddings)
        return labels_value_error(labels, num_classes, ignore_index)

    local_batch = embeddings.shape[0] if error is None else 0
    return raise_or_exchange_sizes(error, local_batch, ctx, flags, describe)


class HeadOptions(NamedTuple):
    """The head's options :func:`check_head_options` checked, as the head keeps them."""

    sample_rate: float
    sparse_grad: bool
    subcenters: int
    label_smoothing: float
    interclass_filter_threshold: Optional[float]


def check_head_options(
    *,
    sample_rate: Any = 1.0,
    sparse_grad: Any = False,
    subcenters: Any = 1,
    label_smoothing: Any = 0.0,
    interclass_filter_threshold: Any = None,
) -> HeadOptions:
    """The head's options that constrain each other, checked in one place for every caller that takes
    them (:class:`~shardfc.head.module.ShardedMarginHead`, ``shardfc train``'s config, ``shardfc
    plan``): Partial FC's rate in ``(0, 1]``, ``sparse_grad`` only with sampling, ``1..255``
    sub-centres (the arg-max centre is kept as uint8), label smoothing in ``[0, 1)``, the inter-class
    filter's threshold in ``(0, 1]`` (None: off) and not with label smoothing. Raises TypeError or
    ValueError naming the argument and its value (as given)."""
    given_smoothing, given_rate = label_smoothing, sample_rate
    # ε = 1 puts no mass on the label: a loss that ignores the labels trains nothing (F.cross_entropy
    # takes it; the trainer's config never did).
    label_smoothing = check_probability("label_smoothing", label_smoothing, low_open=False, high_open=True)
    sample_rate = check_probability("sample_rate", sample_rate, low_open=True, high_open=False)
    if not isinstance(sparse_grad, bool):
        raise TypeError(f"sparse_grad must be True or False, got {sparse_grad!r}")
    if sparse_grad and sample_rate >= 1.0:
        raise ValueError(f"sparse_grad needs Partial FC (sample_rate < 1), got sample_rate={given_rate!r}")
    checked = check_positive_int("subcenters", subcenters)
    if checked > 255:  # the arg-max centre is kept as uint8
        raise ValueError(f"subcenters must be <= 255, got {subcenters!r}")
    if interclass_filter_threshold is not None:
        interclass_filter_threshold = check_probability(
            "interclass_filter_threshold", interclass_filter_threshold, low_open=True, high_open=False
        )
        if label_smoothing > 0:
            raise ValueError(
                f"interclass_filter_threshold={interclass_filter_threshold} removes classes from the softmax, "
                f"so label_smoothing={given_smoothing} (spread over all classes) is undefined with it; use one"
            )
    return HeadOptions(sample_rate, sparse_grad, checked, label_smoothing, interclass_filter_threshold)


#: How a head reads its value checks (``validate=``): ``"immediate"`` in the forward that runs them
#: (one host sync in one process), ``"deferred"`` at the next forward, ``"auto"`` deferred on CUDA.
VALIDATE_MODES = ("auto", "immediate", "deferred")


def check_device(name: str, value: Any) -> torch.device:
    """``value`` as a ``torch.device`` (a name, an index or a device), else a ValueError naming
    ``name`` (torch's own says only "Expected one of cpu, cuda, ... device type")."""
    try:
        return torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{name} must be a torch device such as 'cpu', 'cuda' or 'cuda:1', "
                         f"got {value!r}") from None


def check_validate(validate) -> str:
    """``validate`` if it is one of :data:`VALIDATE_MODES`, else a ValueError naming it."""
    if validate not in VALIDATE_MODES:
        raise ValueError(f"validate must be one of {VALIDATE_MODES}, got {validate!r}")
    return validate


def defers(validate: str, device: torch.device, distributed: bool) -> bool:
    """Whether a forward on ``device`` defers its value checks. Never in process-group mode: there
    they travel with the batch-size exchange, whose read waits for the embeddings anyway, so reading
    them there is free and every rank raises at once. ``"auto"``: on CUDA, where a read would stall
    the queue; on the CPU a read costs nothing and the error comes with the bad call itself."""
    if distributed:
        return False
    if validate == "auto":
        return device.type == "cuda"
    return validate == "deferred"


class PendingCheck:
    """The value checks of one forward's inputs, on their way to the host (``validate="deferred"``).

    Made by :func:`check_batch_deferred`: the flags of :func:`value_flags` are computed on the
    device and, on CUDA, copied without blocking into pinned host memory behind a recorded event;
    nothing waits. :meth:`error` reads them later: it waits for that event only (the check's own
    kernels, long done by the next forward; not the work queued after them, so the GPU never runs
    dry) and reads host memory. To name the bad row and value it keeps references to the batch's
    embeddings (detached) and labels: no copy, and their in-place changes are noticed.
    """

    def __init__(self, embeddings: Tensor, labels: Tensor, num_classes: int, ignore_index: int, call: int):
        flags = value_flags(embeddings, labels, num_classes, ignore_index)
        self._event = None
        if flags.device.type == "cuda":
            self._host: Optional[Tensor] = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            self._host.copy_(flags, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(flags.device))
        elif flags.device.type == "cpu":
            self._host = flags  # host memory already
        elif flags.device.type == "meta":
            self._host = None  # shapes only (shardfc plan): nothing to read
        else:  # another accelerator: a plain copy (it may block)
            self._host = flags.to("cpu")
        self._embeddings, self._labels = embeddings.detach(), labels.detach()
        self._versions = (self._embeddings._version, self._labels._version)
        self.num_classes, self.ignore_index, self.call = num_classes, ignore_index, call

    def error(self) -> Optional[Exception]:
        """The error of the checked batch (None when its values are good)."""
        if self._host is None:
            return None
        if self._event is not None:
            self._event.synchronize()
        raised = self._host.numpy().tolist()  # a host array: no device read (see shardfc.tools.host_syncs)
        if not any(raised):
            return None
        changed = (self._embeddings._version, self._labels._version) != self._versions
        if changed:  # the values that failed are gone: say which check failed, without a row
            what, kind = (("embeddings contain non-finite values", NonFiniteEmbeddingsError) if raised[0] else
                          (f"labels hold a value outside [0, num_classes={self.num_classes}) that is not "
                           f"ignore_index={self.ignore_index}", ValueError))
            error: Exception = kind(f"{what} (the tensor was changed in place since, so not which row)")
        elif raised[0]:
            error = embeddings_value_error(self._embeddings)
        else:
            error = labels_value_error(self._labels, self.num_classes, self.ignore_index)
        return type(error)(f"{error} [the batch of forward call {self.call}, read after that call: "
                           "validate='deferred' reports the value checks at the next forward or check_pending(); "
                           "see docs/head.md]")


def check_batch_deferred(
    embeddings, labels, *, embedding_dim: int, num_classes: int, ignore_index: int, ctx: DistContext, call: int,
    values: bool = True,
) -> Tuple[List[int], Optional[PendingCheck]]:
    """:func:`check_batch_and_exchange_sizes` for one process with the value checks started, not
    read: types and shapes raise at once; the values' verdict is the returned :class:`PendingCheck`
    (``values=False``: none, the caller checks them elsewhere)."""
    if ctx.distributed:
        raise ValueError("deferred value checks are for one process; process-group mode reads them with the exchange")
    error = check_embeddings(embeddings, embedding_dim, values=False)
    if error is None:
        error = check_labels(labels, embeddings.shape[0])
    sizes = raise_or_exchange_sizes(error, embeddings.shape[0] if error is None else 0, ctx)
    started = values and embeddings.shape[0]
    pending = PendingCheck(embeddings, labels, num_classes, ignore_index, call) if started else None
    return sizes, pending


__all__ = [
    "NonFiniteEmbeddingsError",
    "HeadOptions",
    "check_head_options",
    "check_embeddings",
    "check_labels",
    "raise_or_exchange_sizes",
    "check_batch_and_exchange_sizes",
    "check_batch_deferred",
    "PendingCheck",
    "VALIDATE_MODES",
    "check_validate",
    "defers",
]
