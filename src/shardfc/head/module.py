"""``ShardedMarginHead``: a margin-softmax classifier whose classes are sharded over ranks or devices.

Three layouts, one loss:

* **process-group mode** (torch.distributed or Horovod initialised, or ``group`` / ``context``
  given): one shard per rank, contiguous class ranges in rank order. Each rank passes its own local
  batch (sizes may differ, including 0); the embeddings and labels are gathered, each rank scores the *global* batch against
  its classes, and only per-sample statistics cross ranks.
* **devices mode** (``devices=[...]``, one process): shard ``i`` lives on ``devices[i]``; only the
  ``[B, D]`` embeddings and ``[B]`` statistics move between devices.
* **single shard** (neither): the same exact, memory-frugal loss in one process.

Gradient convention in process-group mode (the one DDP, FSDP and Horovod use): the objective is the
average over ranks of the scalars the ranks back-propagate. Every rank's weight gradient is the
exact gradient of that objective; every rank's embedding gradient is ``W`` times the exact one, so
that DDP's averaging over the backbone replicas gives the backbone its exact gradient. Do not wrap
the head in DDP: its parameters are different on every rank.

(Longer than ~400 lines on purpose: the module is the public face of every head option — layouts,
margins, chunking, Partial FC, sub-centres, filtering, precision — and its constructor's argument
checks and docstring are most of it. The math lives in ``kernels``/``function``, the sharded state
in ``sharded_state``.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from shardfc.checks import MAX_INT64, check_positive_int, check_seed
from shardfc.head import impl_select
from shardfc.head import margins as _margins
from shardfc.head import sharded_state as _state
from shardfc.head.function import (
    ShardedLossPlan,
    compute_dtype_for,
    local_labels_for_range,
    shard_kernels,
    sharded_cross_entropy,
    stats_dtype_for,
)
from shardfc.head.fused import (
    check_chunk_scale,
    check_impl,
    resolve_impl,
    split_timed,
    timed_candidates,
    triton_unavailable,
)
from shardfc.head.grow import grow_head
from shardfc.head.kernels import ShardConfig
from shardfc.head.layout import INIT_BLOCK as INIT_BLOCK  # re-exported: the rows' home is .layout
from shardfc.head.layout import INIT_STD as INIT_STD
from shardfc.head.layout import class_ranges, init_rows
from shardfc.head.normalize import l2_normalize
from shardfc.head.sampling import (
    RowGrad,
    StepCounter,
    merge_row_grads,
    num_sampled,
    positive_mask,
    sample_present,
    united,
)
from shardfc.head.validation import (
    PendingCheck,
    check_batch_and_exchange_sizes,
    check_batch_deferred,
    check_device,
    check_embeddings,
    check_head_options,
    check_validate,
    defers,
    raise_or_exchange_sizes,
)
from shardfc.parallel.collectives import gather_rows_forward_reduce_scatter_backward
from shardfc.parallel.context import DistContext
from shardfc.seeding import mix_seed

_log = logging.getLogger("shardfc.head")

#: ``impl="auto"`` times each candidate's backward on at most this many of a shard's classes at a
#: time, repeated until it has done the whole shard's work: the transient weight gradient of the
#: timing stays at most this many classes' rows (256 MiB at D = 512 in fp32) whatever the shard's
#: size, while the fused forward runs on the whole shard (:meth:`ShardedMarginHead._timed_step`).
AUTO_TIMED_CLASSES = 1 << 17

DeviceLike = Union[str, torch.device, int]

class ShardedMarginHead(nn.Module):
    """Exact margin softmax cross-entropy over ``num_classes`` classes sharded by class.

    Args:
        embedding_dim: width ``D`` of the embeddings.
        num_classes: total number of classes ``C`` over all shards.
        margin: a :mod:`shardfc.head.margins` margin (default ``ArcFace(64, 0.5)``).
        group: process group whose ranks hold the shards (default: the default group when
            torch.distributed is initialised, else Horovod's world when ``hvd.init()`` has run).
            A given group is always used as is.
        context: a :class:`~shardfc.parallel.context.DistContext` to shard over instead of
            ``group``, e.g. ``DistContext.horovod()``: its ranks hold the shards, its communicator
            carries every collective, its device holds the weight (unless ``device`` is given).
        devices: single-process multi-device mode: shard ``i`` on ``devices[i]``.
        label_smoothing: ε in ``[0, 1)`` of ``F.cross_entropy(label_smoothing=ε)``, over all ``C`` classes.
        ignore_index: label value that contributes no loss and no gradient.
        reduction: ``"mean"`` over the global batch's non-ignored samples (the same value on every
            rank; 0 when there are none), ``"sum"`` over the global batch, or ``"none"``: this
            rank's per-sample losses ``[B_r]`` (0 for ignored samples).
        chunk_size: walk each shard's classes this many at a time (online softmax, logits
            recomputed in the backward): activation memory ``O(B·chunk_size)``. ``"auto"``: the
            largest chunk whose logits fit ``chunk_budget_bytes`` for the step's global batch.
            ``None``: one ``[B, n_local]`` buffer, no recomputation.
        chunk_budget_bytes: the activation budget of ``chunk_size="auto"`` (default 64 MiB).
        sample_rate: Partial FC. In training mode each step each shard keeps the classes of the
            global batch's labels it owns plus uniform negatives, a fixed count: ``⌈r·n_local⌉``, or
            the global batch size ``B`` when that is larger (every positive then fits, whatever the
            labels), at most ``n_local``; known from shapes alone, so sampling reads nothing back to
            the host (:mod:`shardfc.head.sampling`). Build the optimizer with
            :func:`shardfc.head.partial_fc.head_optimizer` so only those rows move. ``1.0``: the full
            head. Evaluation mode and :meth:`predict` always use every class.
        sample_seed: seed of the sampling; step ``t`` of shard ``i`` draws from
            ``(sample_seed, i, t)`` (:func:`~shardfc.head.sampling.draw_keys`: counter-based, the same
            sample on any device), so a run is reproducible (``sample_step`` counts steps). Each
            seed is an int in ``[0, 2**63 - 1]`` (:func:`shardfc.checks.check_seed`).
        sparse_grad: Partial FC only (``sample_rate < 1``): the weight gradient of a training step
            holds the sampled rows only, a compact ``[K·k, D]`` buffer (``k`` the count above) kept by
            the head (never a ``.grad``: autograd sees none for the weights) and handed with its row
            ids to the row-sparse optimizer of :func:`~shardfc.head.partial_fc.head_optimizer`
            (:meth:`take_sampled_rows`). No ``[n_local, D]`` gradient is ever allocated, so a class
            costs its weight and optimizer state at rest. Needs that optimizer (or a caller that
            reads :meth:`take_sampled_rows`): ``torch.optim`` optimizers see no gradient.
        weight_grad_in_place: when a shard weight already has a ``.grad``, add the step's weight
            gradient straight into it, block by block, instead of returning a fresh ``[n, D]``
            tensor for autograd to add (keep it with ``optimizer.zero_grad(set_to_none=False)``).
            Autograd then sees no gradient for that weight: ``torch.autograd.grad`` with respect
            to head weights needs ``False``.
        init_seed: seed of the ``N(0, 0.01²)`` initialisation, identical for any sharding (drawn
            on the weights' GPU when they are on one, with other values than the CPU's: :func:`init_rows`).
        device: of the weights in process-group / single mode (default: the current CUDA device
            under NCCL, else the CPU).
        dtype: of the weights in process-group / single mode (default float32): the storage dtype of the class
            centres (and of their optimizer state: :func:`~shardfc.head.partial_fc.head_optimizer`
            keeps it in the same dtype but computes each update in fp32 before rounding it back,
            to nearest or stochastically). bf16/fp16 halve a class's bytes at rest; the loss still
            runs its statistics in fp32.
        subcenters: Sub-center ArcFace (Deng et al., ECCV 2020): ``K`` centres per class, stored
            class-major as ``K`` consecutive weight rows (``weight`` is ``[n_local·K, D]``) on the
            class's shard; the class logit is the max over its centres, the margin applies to the
            target's best centre and the gradient goes to the arg-max centres. Partial FC samples
            classes and scores all ``K`` centres of each (``sparse_grad`` then covers those rows).
            See :mod:`shardfc.head.subcenters` for dropping the non-dominant centres after training.
        interclass_filter_threshold: ``t`` in ``(0, 1]``: a negative class whose cosine to the
            sample's target centre exceeds ``t`` is left out of that sample's softmax (as if masked
            in a dense head; the mask carries no gradient). ``None``: off.

        impl: which code computes each shard's loss: ``"torch"`` (the reference, and the CPU
            implementation), ``"triton"`` (:mod:`shardfc.head.fused`: fused kernels that never hold
            ``[B, n]`` logits — ``chunk_size`` is then moot — read the weight in place, fold the
            margin in at the target column and write the weight gradient once; CUDA (or the meta
            device: shapes only, nothing launched, as ``shardfc plan`` replays it), fp32/bf16/fp16
            compute, ``embedding_dim ≤ 1024``; a clear error says which condition fails) or
            ``"auto"`` (the default: Triton on CUDA when it can run there, else torch).
            ``last_impl`` says which ran.
        gpu_chunk_scale: the GPU paths' class chunks (``impl="triton"``'s backward, ``"gemm"``'s
            forward and backward) as a multiple of the L2-sized chunk, one of
            :data:`~shardfc.head.fused.CHUNK_SCALES`: 1 keeps a chunk's products in L2, larger
            ones issue fewer launches a step (see docs/gpu.md, "Chunk sizes"). ``None`` (the
            default): ``impl="auto"`` times every scale with each implementation and keeps the
            fastest; an explicit ``impl`` takes :data:`~shardfc.head.fused.chunks.DEFAULT_CHUNK_SCALE`.
            ``last_chunk_scale`` says which ran.
        validate: when the value checks of a forward's inputs (finite embeddings, labels in
            ``[0, C)`` or ``ignore_index``) are read, in one process: ``"immediate"`` (in that
            forward: one host sync a step), ``"deferred"`` (at the start of the next forward, or at
            :meth:`check_pending`, from pinned host memory once the GPU is done: no sync; the error
            still names the row and value, and which forward's batch) or ``"auto"`` (the default:
            deferred on CUDA, immediate elsewhere). In process-group mode the checks travel with the
            batch-size exchange and raise at once on every rank, whatever this says. Types and
            shapes are always checked at once. See docs/head.md ("When input errors surface").

    Example::

        head = ShardedMarginHead(512, 1_000_000, margin=margins.ArcFace(64.0, 0.5))
        loss = head(backbone(images), labels)        # labels: global class ids of this rank's batch
    """

    def __init__(
        self,
        embedding_dim: int,
        num_classes: int,
        margin: Optional[_margins.Margin] = None,
        group: Optional[dist.ProcessGroup] = None,
        devices: Optional[Sequence[DeviceLike]] = None,
        label_smoothing: float = 0.0,
        ignore_index: int = -1,
        reduction: str = "mean",
        chunk_size: Union[int, str, None] = None,
        chunk_budget_bytes: int = 64 * 2**20,
        sample_rate: float = 1.0,
        sample_seed: int = 0,
        sparse_grad: bool = False,
        weight_grad_in_place: bool = True,
        init_seed: int = 0,
        device: Optional[DeviceLike] = None,
        dtype: Optional[torch.dtype] = None,
        context: Optional[DistContext] = None,
        subcenters: int = 1,
        interclass_filter_threshold: Optional[float] = None,
        impl: str = "auto",
        validate: str = "auto",
        gpu_chunk_scale: Optional[int] = None,
    ):
        super().__init__()
        self.embedding_dim = check_positive_int("embedding_dim", embedding_dim)
        self.num_classes = check_positive_int("num_classes", num_classes)
        margin = _margins.ArcFace() if margin is None else margin
        if not isinstance(margin, _margins.Margin):
            raise TypeError(f"margin must be a shardfc.head.margins.Margin, got {margin!r}")
        self.margin = margin
        options = check_head_options(sample_rate=sample_rate, sparse_grad=sparse_grad, subcenters=subcenters,
                                     label_smoothing=label_smoothing,
                                     interclass_filter_threshold=interclass_filter_threshold)
        self.label_smoothing = options.label_smoothing
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
        if 0 <= ignore_index < num_classes:
            raise ValueError(f"ignore_index={ignore_index} is a valid class id in [0, {num_classes})")
        self.ignore_index = ignore_index
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        self.reduction = reduction
        if chunk_size == "auto":
            self.chunk_size = "auto"
        else:
            self.chunk_size = None if chunk_size is None else check_positive_int("chunk_size", chunk_size)
        self.chunk_budget_bytes = check_positive_int("chunk_budget_bytes", chunk_budget_bytes)
        self.sample_rate = options.sample_rate
        self.sample_seed = check_seed("sample_seed", sample_seed)
        self.sample_step = 0
        self._draw_steps = StepCounter()  # sample_step on each shard's device: what the draw reads
        # Per shard, the rows each forward since the optimizer's last step used (None: every row).
        self._pending_rows: Optional[List[Optional[List[Tensor]]]] = None
        self.sparse_grad = sparse_grad
        # Per shard, the compact (rows, gradient) pairs the backwards since the last step left (sparse_grad).
        self._row_grads: List[List[Tuple[Tensor, Tensor]]] = []
        self.weight_grad_in_place = bool(weight_grad_in_place)
        self.subcenters = options.subcenters
        self.interclass_filter_threshold = options.interclass_filter_threshold
        self.impl = check_impl(impl)
        self.gpu_chunk_scale = check_chunk_scale(gpu_chunk_scale, "gpu_chunk_scale", none_ok=True)
        self.last_chunk_scale: Optional[int] = None
        self.validate = check_validate(validate)
        # Value checks left to a caller (value_checks_outside).
        self._values_outside = False
        # A deferred value check still to read (validate="deferred"), and the forwards counted for its message.
        self._pending_check: Optional[PendingCheck] = None
        self._forward_calls = 0
        #: The implementation the last forward ran ("torch" or "triton"; None before the first).
        self.last_impl: Optional[str] = None
        #: Who applies the optimizer's step to the weights after the last training forward:
        #: "fused" (its backward, :meth:`fuse_optimizer_update`) or "optimizer: <why not fused>"
        #: (``step()``, from the stored gradient); None before the first or without a fused optimizer.
        self.last_update: Optional[str] = None
        self._fused_optimizer = None  # a weak reference to the optimizer whose step the backward applies
        self._idle_rows_optimizer = None  # a weak reference to the optimizer that catches idle rows up
        self._pending_versions: Tuple[int, ...] = ()  # the shards' autograd versions when _pending_rows began
        # Per shard, the operand a fused update wrote for the next forward (release_next_operands).
        self._next_operands: Optional[list] = None
        # measure_weight_grad_norm: whether the backward reports its gradient's sum of squares, the
        # reports since the last take, and the training forwards since then.
        self._grad_sq_on = False
        self._grad_sq: List[Tensor] = []
        self._grad_sq_forwards = 0
        self.init_seed = check_seed("init_seed", init_seed)
        dtype = torch.float32 if dtype is None else dtype
        if dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):  # (int32: a torch error; fp8: no matmul)
            raise ValueError(f"dtype must be a floating-point torch.dtype (torch.float32, torch.bfloat16, torch.float16 "
                             f"or torch.float64), got {dtype!r}")
        weights = self.num_classes * options.subcenters * self.embedding_dim
        if weights * dtype.itemsize > MAX_INT64:  # torch counts bytes in int64: allocating failed, as a TypeError
            raise ValueError(f"num_classes={num_classes} x subcenters={options.subcenters} x embedding_dim={embedding_dim} "
                             f"= {weights:.3e} weights of {dtype.itemsize} bytes: more than a torch tensor can hold "
                             "(2**63 - 1 bytes)")

        if context is not None and (group is not None or devices is not None):
            raise ValueError("pass one of context, group (process-group mode) or devices (one process), not several")
        if devices is not None:
            if group is not None:
                raise ValueError("pass either devices (one process, many devices) or group, not both")
            devices = [check_device(f"devices[{i}]", d) for i, d in enumerate(devices)]
            if not devices:
                raise ValueError("devices must name at least one device, got an empty list")
            self.mode = "devices"
            self.ctx = DistContext(device=devices[0])  # one process: no group, whatever torch.distributed says
            self.devices = devices
            self.shard_ranges = class_ranges(num_classes, len(devices))
            self.class_range = range(0, num_classes)
            self.shards = nn.ParameterList(
                nn.Parameter(self._init_centres(r, d).to(d, dtype))
                for r, d in zip(self.shard_ranges, devices)
            )
        else:
            device = None if device is None else check_device("device", device)
            if context is None:
                self.ctx = DistContext.resolve(group, device)
            else:
                self.ctx = context if device is None else context.with_device(device)
            self.mode = "group" if self.ctx.distributed else "single"
            self.class_range = class_ranges(num_classes, self.ctx.world_size)[self.ctx.rank]
            self.shard_ranges = [self.class_range]
            self.devices = [self.ctx.device]
            r = self.class_range
            self.weight = nn.Parameter(self._init_centres(r, self.ctx.device).to(self.ctx.device, dtype))
        # The group the shards are collective over, this process's rank and the group's size in it.
        self.group, self.rank, self.world_size = self.ctx.group, self.ctx.rank, self.ctx.world_size

    # ------------------------------------------------------------------ helpers
    def _init_centres(self, r: range, device: torch.device) -> Tensor:
        """The centre rows of classes ``r``: rows ``[K·start, K·stop)`` of the logical matrix, drawn
        on ``device`` when it is a GPU (:func:`init_rows`)."""
        K = self.subcenters
        return init_rows(r.start * K, r.stop * K, self.embedding_dim, self.init_seed, device=device)

    def fuse_optimizer_update(self, optimizer) -> None:
        """Let the backward apply ``optimizer``'s step to the shard weights while it forms their
        gradient (:func:`~shardfc.head.partial_fc.head_optimizer` with ``fused_update=True`` calls
        this), whenever the forward runs a GPU implementation; else ``optimizer.step()`` does as usual.
        Held weakly: the head does not keep the optimizer alive."""
        self._fused_optimizer = weakref.ref(optimizer)

    def keep_rows_current_by(self, optimizer) -> None:
        """Have every read of the shards' rows first bring them up to date through ``optimizer``'s
        ``catch_up_`` (a row-sparse optimizer with ``idle_rows="exact"``, which calls this itself
        when it is built with ``sampled_rows=head.take_sampled_rows``): the training forward its
        sampled rows before they are scored, and every row for an evaluation forward,
        :meth:`predict`, :meth:`state_dict`, :meth:`sharded_state` and so :meth:`grow`. Held weakly.
        Code that reads ``head.weight`` itself calls :meth:`catch_up` first."""
        self._idle_rows_optimizer = weakref.ref(optimizer)

    def _catch_up_optimizer(self):
        """The optimizer :meth:`keep_rows_current_by` attached, if still alive."""
        return self._idle_rows_optimizer() if self._idle_rows_optimizer is not None else None

    def rows_kept_current_by(self, optimizer) -> bool:
        """``optimizer`` is the one :meth:`keep_rows_current_by` attached (the forwards catch up through it)."""
        return optimizer is not None and self._catch_up_optimizer() is optimizer

    @torch.no_grad()
    def catch_up(self, rows: Optional[Sequence[Optional[Tensor]]] = None) -> None:
        """Bring the shards' rows (per shard, ``rows[i]``; None: every row) to the dense optimizer's
        state after the steps they sat out (see :meth:`keep_rows_current_by`); nothing without such
        an optimizer, or when nothing is behind. No host read."""
        opt = self._catch_up_optimizer()
        if opt is None:
            return
        changed = False
        for i, w in enumerate(self.shard_weights):
            changed |= opt.catch_up_(w, None if rows is None else rows[i])
        if changed and rows is None:  # every row rewritten: an operand kept for the next forward is stale
            self.release_next_operands()

    def __getstate__(self):
        # A pickled or copied head holds its rows as the dense optimizer would have them, and not
        # the optimizers attached to this one (weak references: neither picklable nor the copy's).
        self.catch_up()
        state = dict(self.__dict__)
        state["_fused_optimizer"] = state["_idle_rows_optimizer"] = None
        return state

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # The rows as the dense optimizer would have them; the keys arcface_torch's PartialFC_V2 has
        # ("weight"), so a checkpoint loads either way; the Partial FC step counter rides in the
        # state dict's metadata, which torch keeps and ignores.
        self.catch_up()
        super()._save_to_state_dict(destination, prefix, keep_vars)
        metadata = getattr(destination, "_metadata", None)
        if metadata is not None:
            metadata.setdefault(prefix[:-1], {})["sample_step"] = int(self.sample_step)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        step = local_metadata.get("sample_step") if isinstance(local_metadata, Mapping) else None
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
            self.sample_step = step
        self.forget_sampled_rows()  # they named rows of the weights just replaced
        opt = self._catch_up_optimizer()
        if opt is not None:
            opt.rows_are_current()  # the loaded rows are what they are now: nothing of theirs is behind

    def _update_optimizer(self):
        """The optimizer whose step the backward applies, if one is attached and still alive."""
        return self._fused_optimizer() if self._fused_optimizer is not None else None

    def _fuses_update(self) -> bool:
        """An optimizer whose step the backward applies is attached (and alive): part of
        ``impl="auto"``'s workload key, since the backward then does the update's work too."""
        opt = self._update_optimizer()
        return bool(opt is not None and opt.fused_update)

    def _row_update_hook(self, impl: str, compute_dtype: torch.dtype, weights: List[Tensor]):
        """The plan's ``row_update`` for this forward (None: the optimizer steps from the gradient)
        and, in :attr:`last_update`, who updates the weights; logged when it changes."""
        opt = self._update_optimizer()
        if opt is None or not torch.is_grad_enabled():
            return None
        if impl not in ("triton", "gemm"):
            why = f"impl={impl!r} stores the gradient (the fused update needs impl 'triton' or 'gemm')"
        elif compute_dtype == torch.float16:
            why = "fp16 compute (a loss scaler's gradient is unscaled and checked in step())"
        else:
            why = next((r for r in (opt.fused_update_unavailable(w) for w in weights) if r is not None), None)
        last = "fused" if why is None else f"optimizer: {why}"
        if last != self.last_update:
            _log.info("head update: %s", "fused into the backward (no .grad stored)" if why is None
                      else f"by the optimizer's step from .grad ({why})")
        self.last_update = last
        return None if why is not None else (lambda shard: opt.backward_update(weights[shard]))

    def _next_operands_for(self, impl: str, n_shards: int) -> Optional[list]:
        """The plan's ``next_operands``: with a fused update on the fused impls, per shard, the
        operand the last step's update wrote for this forward (:class:`~shardfc.head.fused.chunks.NextOperand`)."""
        if impl not in ("triton", "gemm") or not self._fuses_update():
            self.release_next_operands()
            return None
        if self._next_operands is None or len(self._next_operands) != n_shards:
            from shardfc.head.fused.chunks import NextOperand

            self._next_operands = [NextOperand() for _ in range(n_shards)]
        return self._next_operands

    def measure_weight_grad_norm(self, on: bool = True) -> None:
        """Have the backward of the GPU implementations (``impl`` ``"triton"`` / ``"gemm"``) sum
        the squares of the weight gradient as it stores it, for :meth:`take_weight_grad_sq_norm`:
        a head clipped by its norm then needs no pass over its ``[n, D]`` gradient to find it.
        ``shardfc train --head-grad-clip`` turns it on."""
        self._grad_sq_on = bool(on)
        self._grad_sq, self._grad_sq_forwards = [], 0

    def take_weight_grad_sq_norm(self) -> Optional[Tensor]:
        """The squared norm (fp32 scalar, on this process's first device) of the weight gradient this
        process's shards hold — the stored ``.grad`` rows and, with ``sparse_grad``, the compact rows —
        as the backward of the one training forward since the last call summed it while storing it;
        None when it cannot say: :meth:`measure_weight_grad_norm` off, not one training forward and
        backward since the last call (gradient accumulation), the torch implementation, a fused
        optimizer update (nothing stored). Exact when the gradient was zero or None before that
        backward, as after ``zero_grad()``. Resets the count either way; no host sync."""
        reports, forwards = self._grad_sq, self._grad_sq_forwards
        self._grad_sq, self._grad_sq_forwards = [], 0
        if not self._grad_sq_on or forwards != 1 or len(reports) != len(self.shard_weights):
            return None
        home = self.devices[0]
        return torch.stack([r.to(home).reshape(()) for r in reports]).sum()

    def _grad_sq_sink(self):
        """The plan's ``grad_sq_sink`` for this forward (None when nothing is measured)."""
        if not (self._grad_sq_on and torch.is_grad_enabled()):
            return None
        self._grad_sq_forwards += 1
        # Only the first forward's reports are kept: a second makes the take None anyway.
        return lambda shard, sq: self._grad_sq.append(sq) if self._grad_sq_forwards == 1 else None

    def release_next_operands(self) -> None:
        """Free the operand (the scored rows in the compute dtype, ``2·n·D`` bytes in bf16, and their
        norms) that a fused update keeps for the next forward, which then makes it again from the
        weights. Needed only after writing the weights through ``.data`` (which torch's version
        counter does not see) while a fused optimizer is attached, or to free the memory."""
        for kept in self._next_operands or ():
            kept.clear()
        self._next_operands = None

    @property
    def shard_weights(self) -> List[nn.Parameter]:
        """This process's shards, in class order (one in process-group and single mode)."""
        return list(self.shards) if self.mode == "devices" else [self.weight]

    @property
    def sampled_rows(self) -> Optional[List[Optional[Tensor]]]:
        """Per shard (in :attr:`shard_weights` order), the sorted local row ids that the forwards with
        autograd enabled since the optimizer last took them used: the Partial FC sample, united over
        the micro-batches of a step. An entry ``None`` means every row of that shard (a forward
        without sampling, e.g. in evaluation mode); the whole is ``None`` when no forward was recorded.
        The forwards only note their samples; the union (a ``torch.unique``, a host read on a GPU) is
        formed here, when asked, and only for a step of several forwards.
        """
        if self._pending_rows is None:
            return None
        return [None if parts is None else self._united(parts) for parts in self._pending_rows]

    @staticmethod
    def _united(parts: List[Tensor]) -> Tensor:
        """A shard's rows over the forwards of a step, kept united once formed."""
        if len(parts) > 1:
            parts[:] = [united(parts)]
        return parts[0]

    def take_sampled_rows(self) -> Dict[Tensor, Union[Tensor, RowGrad]]:
        """``{shard weight: rows}`` of :attr:`sampled_rows`, which are then forgotten.

        What a row-sparse optimizer (:func:`~shardfc.head.partial_fc.head_optimizer`) asks at each
        step. Shards whose forwards used every row are left out: their update is dense. With
        ``sparse_grad``, a shard whose backward ran maps to a :class:`~shardfc.head.partial_fc.RowGrad`
        instead: its sampled rows and their gradient (the micro-batches' summed), also forgotten.
        """
        pending, self._pending_rows = self._pending_rows, None
        row_grads, self._row_grads = self._row_grads, []
        if pending is None:
            return {}
        out: Dict[Tensor, Union[Tensor, RowGrad]] = {}
        for i, (w, rows) in enumerate(zip(self.shard_weights, pending)):
            parts = row_grads[i] if i < len(row_grads) else []
            if rows is None:
                if parts:  # a full forward in the same step: the update is dense, so is the gradient
                    merged = merge_row_grads(parts)
                    with torch.no_grad():
                        if w.grad is None:
                            w.grad = torch.zeros_like(w)
                        w.grad.index_add_(0, merged.rows, merged.values.to(w.grad.dtype))
                continue
            out[w] = merge_row_grads(parts) if parts else self._united(rows)
        return out

    def row_grad_values(self) -> List[Tensor]:
        """The compact gradients the backwards since the last step left (``sparse_grad``), one per
        shard, merged over micro-batches: what clipping and overflow checks read, in place."""
        out = []
        for parts in self._row_grads:
            if len(parts) > 1:
                merged = merge_row_grads(parts)
                parts[:] = [(merged.rows, merged.values)]
            out += [g for _, g in parts]
        return out

    def keep_row_grad(self, shard: int, rows: Tensor, grad: Tensor) -> None:
        """The sink of a sparse_grad backward (public so that ``shardfc plan`` can watch it): keep shard ``shard``'s compact gradient of ``rows``."""
        while len(self._row_grads) <= shard:
            self._row_grads.append([])
        self._row_grads[shard].append((rows, grad))

    def forget_sampled_rows(self) -> None:
        """Forget the rows the forwards since the last step used and the compact gradients their
        backwards left (:attr:`sampled_rows`, ``sparse_grad``): what loading a state or replacing the
        shards' rows does, since they name rows of the old weights."""
        self._pending_rows = None
        self._row_grads = []

    def _record_rows(self, rows: List[Optional[Tensor]]) -> None:
        """Note the rows of each shard a forward used, for the optimizer (only when autograd records).
        A micro-batch's rows are appended, not united: the union waits for :attr:`sampled_rows`."""
        if not torch.is_grad_enabled():
            return
        versions = tuple(w._version for w in self.shard_weights)
        if self._pending_rows is None or versions != self._pending_versions:
            # A new step. Weights changed in place since the rows were noted (a torch optimizer's step:
            # arcface_torch's route, where nothing takes them): the gradient they belonged to is
            # spent, so they go, instead of one more tensor a step kept forever.
            self._pending_versions = versions
            self._pending_rows = [None if r is None else [r] for r in rows]
        else:
            self._pending_rows = [None if a is None or b is None else a + [b] for a, b in zip(self._pending_rows, rows)]

    @property
    def distributed(self) -> bool:
        """The shards are spread over the ranks of a process group."""
        return self.ctx.distributed

    def _exchange(self, error: Optional[Exception], local_batch: int) -> List[int]:
        return raise_or_exchange_sizes(error, local_batch, self.ctx)

    @contextlib.contextmanager
    def value_checks_outside(self):
        """Inside the block, forwards check their inputs' types and shapes but not their values: a
        caller checks those outside the step (:class:`shardfc.head.capture.CapturedHeadStep`, whose
        captured step must not read the host) and reports them itself."""
        before, self._values_outside = self._values_outside, True
        try:
            yield
        finally:
            self._values_outside = before

    def _check_and_exchange(self, embeddings: Tensor, labels: Tensor) -> List[int]:
        self.check_pending()  # the previous forward's deferred checks first: their batch came first
        self._forward_calls += 1
        args = dict(embedding_dim=self.embedding_dim, num_classes=self.num_classes, ignore_index=self.ignore_index,
                    ctx=self.ctx)
        if self._values_outside:  # types and shapes only (a captured step: one process)
            return check_batch_deferred(embeddings, labels, call=self._forward_calls, values=False, **args)[0]
        device = embeddings.device if isinstance(embeddings, Tensor) else self.devices[0]
        if not defers(self.validate, device, self.distributed):
            return check_batch_and_exchange_sizes(embeddings, labels, **args)
        sizes, self._pending_check = check_batch_deferred(embeddings, labels, call=self._forward_calls, **args)
        return sizes

    def check_pending(self) -> None:
        """Raise the error of the last forward's value checks if they are still unread and failed
        (``validate="deferred"``: non-finite embeddings or labels out of range in that batch); else
        nothing. Every forward calls it first. Call it after a run's last step and before saving a
        checkpoint (``shardfc train`` does; :meth:`sharded_state` does too), so that a bad final batch
        is reported and no checkpoint holds a step trained on one. It waits for that forward's check
        kernels only (a CUDA event), never for the work queued after them."""
        pending, self._pending_check = self._pending_check, None
        error = pending.error() if pending is not None else None
        if error is not None:
            raise error

    def _prepare_embeddings(self, embeddings: Tensor) -> Tensor:
        return l2_normalize(embeddings) if self.margin.normalize_embeddings else embeddings

    def _global_embeddings(self, x: Tensor, sizes: List[int], *, autograd: bool) -> List[Tensor]:
        """The global batch's embeddings, one copy on each local shard's device."""
        if self.distributed:
            if autograd:
                # W× on the way back: DDP's average over ranks then gives the exact gradient.
                x = gather_rows_forward_reduce_scatter_backward(x, sizes, self.ctx, grad_scale=self.world_size)
            else:
                x = self.ctx.all_gather_rows(x, sizes)
        return [x.to(d) for d in self.devices]

    # ------------------------------------------------------------------ forward
    def forward(self, embeddings: Tensor, labels: Tensor) -> Tensor:
        """Loss of this rank's local batch ``embeddings [B_r, D]``, ``labels [B_r]`` (see ``reduction``)."""
        sizes = self._check_and_exchange(embeddings, labels)
        labels = labels.to(device=embeddings.device, dtype=torch.int64)

        weights = self.shard_weights
        sampling = self.training and self.sample_rate < 1.0
        grad_sq_sink = self._grad_sq_sink()  # counts this forward, whatever runs below
        if sum(sizes) == 0:  # nothing anywhere: a zero loss still connected to the parameters
            # Under sampling no row took part; otherwise the (zero) gradient is dense as usual.
            self._record_rows([w.new_empty(0, dtype=torch.int64) if sampling else None for w in weights])
            zero = embeddings.sum() * 0 + sum(w.sum().to(embeddings.device) for w in weights) * 0
            return zero.expand(0) if self.reduction == "none" else zero.float()

        x = self._prepare_embeddings(embeddings)
        embeds = self._global_embeddings(x, sizes, autograd=True)
        # Which code runs, decided before anything changes state (the Partial FC sample step): an
        # impl="triton" that cannot run raises here; under impl="auto" the ranks agree here.
        compute_dtype = compute_dtype_for(embeds[0].device, embeds[0], weights[0])
        stats_dtype = stats_dtype_for(embeddings, weights[0])
        impl, key = self._impl_for(embeds[0].device, compute_dtype, stats_dtype, weights[0].dtype, sum(sizes), sampling)
        all_labels = self.ctx.all_gather_rows(labels, sizes) if self.distributed else labels
        valid = all_labels != self.ignore_index
        feature_norms = self._feature_norms(embeddings, sizes, valid) if self.margin.uses_feature_norm else None
        local_labels = [local_labels_for_range(all_labels.to(d), r) for d, r in zip(self.devices, self.shard_ranges)]
        num_classes, rows, sink = self.num_classes, None, None
        if sampling:
            rows, local_labels, num_classes = self._sample_classes(all_labels, local_labels)
            if self.sparse_grad:
                sink = lambda shard, grad: self.keep_row_grad(shard, rows[shard], grad)  # noqa: E731
        else:
            self._record_rows([None] * len(weights))
        self.catch_up(rows)  # the rows about to be scored, as the dense optimizer's run would score them
        config = ShardConfig(
            margin=self.margin,
            num_classes=num_classes,
            label_smoothing=self.label_smoothing,
            chunk_size=self._chunk_for(sum(sizes)),
            compute_dtype=compute_dtype,
            stats_dtype=stats_dtype,
            subcenters=self.subcenters,
            filter_threshold=self.interclass_filter_threshold,
        )
        if impl == "auto":  # timed once per workload on this GPU (the first forward of a new key)
            impl = self._choose_impl(key, config, embeds[0], weights[0], local_labels[0], rows)
        impl, chunk_scale = split_timed(impl, self.gpu_chunk_scale)
        self.last_impl, self.last_chunk_scale = impl, (chunk_scale if impl != "torch" else None)
        plan = ShardedLossPlan(
            config=dataclasses.replace(config, impl=impl, chunk_scale=chunk_scale),
            num_shards=len(weights),
            distributed=self.distributed,
            comm=self.ctx.communicator,
            world_size=self.world_size,
            weight_grad_in_place=self.weight_grad_in_place,
            rows=rows,
            row_grad_sink=sink,
            row_update=self._row_update_hook(impl, compute_dtype, weights),
            next_operands=self._next_operands_for(impl, len(weights)),
            grad_sq_sink=grad_sq_sink,
        )
        losses = sharded_cross_entropy(plan, valid, local_labels, embeds, weights, feature_norms)
        return reduce_losses(losses, valid, sizes, self.rank, self.reduction)

    def _impl_for(self, device: torch.device, compute_dtype: torch.dtype, stats_dtype: torch.dtype,
                  weight_dtype: torch.dtype, batch: int, sampling: bool) -> Tuple[str, Optional[str]]:
        """``(impl, key)``: the implementation this forward runs, or ``("auto", workload key)`` when
        the candidates are to be timed (after the sample step: they run on its rows).

        ``impl="auto"`` in a process group: at the first forward of a workload every rank enters the
        agreement (:meth:`~shardfc.head.impl_select.ImplSelector.settle`: one collective), whatever its
        ``$SHARDFC_HEAD_IMPL``, its Triton or its device say, so a rank that would decide otherwise
        alone is an error on every rank or a choice every rank shares, never a rank waiting for
        another in a collective it skipped. Later forwards of the workload find the choice in memory
        and talk to nobody. One process has nothing to agree on: the variable is read every forward."""
        if self.impl != "auto":
            return resolve_impl(self.impl, device, compute_dtype, stats_dtype), None
        if not self.distributed:
            impl = resolve_impl(impl_select.env_override() or "auto", device, compute_dtype, stats_dtype)
            if impl != "auto":
                return impl, None
            return impl, workload_key(self, batch, compute_dtype, weight_dtype, device, sampling, self._fuses_update())
        key = workload_key(self, batch, compute_dtype, weight_dtype, device, sampling, self._fuses_update())
        selector = impl_select.default_selector()
        if key in selector.choices:  # every forward after the first of a workload: no collective
            return selector.choices[key], None
        override, runs, cause = _local_view(device, compute_dtype, stats_dtype)
        settled = selector.settle(key, override, runs, self._gather_codes, cause)
        return ("auto", key) if settled is None else (settled, None)

    def _gather_codes(self, code: int) -> List[int]:
        """Every rank's ``code`` (a small integer, exact in fp32) in rank order: one all-reduce (sum)
        of a ``[world]`` vector where each rank writes its own place — an all-gather of one number
        through the reduction every communicator has. Its read to the host is once per workload."""
        t = torch.zeros(self.world_size, device=self.devices[0])
        t[self.rank] = float(code)
        self.ctx.communicator.all_reduce_(t, "sum")
        return [int(round(v)) for v in t.tolist()]

    def _choose_impl(self, key: str, cfg: ShardConfig, a: Tensor, w: Tensor, labels: Tensor, rows) -> str:
        """``impl="auto"`` on a GPU: the fastest of :data:`~shardfc.head.fused.TIMED` (each
        implementation at each chunk scale, or at ``gpu_chunk_scale`` when set) for workload
        ``key``, timed by :func:`~shardfc.head.impl_select.default_selector` on the first local
        shard's real inputs (:meth:`_timed_step`) and remembered per key. Timing changes no state:
        no ``.grad``, no optimizer, no sampling step; in a process group its one collective (after
        :meth:`_impl_for`'s) is the agreement on rank 0's pick."""
        selector = impl_select.default_selector()
        if key in selector.choices:  # every forward after the first of a workload: no timing set-up
            return selector.choices[key]
        candidates = {}
        for name in timed_candidates(self.gpu_chunk_scale):
            impl, scale = split_timed(name)
            cfg_n = dataclasses.replace(cfg, impl=impl, chunk_scale=scale)
            candidates[name] = self._timed_step(cfg_n, a, w, labels, rows[0] if rows else None)

        def rank0s(i: int) -> int:  # rank 0's index on every rank: one all-reduce of one number
            t = torch.tensor([float(i + 1) if self.rank == 0 else 0.0], device=a.device)
            self.ctx.communicator.all_reduce_(t, "sum")
            return int(t.item()) - 1

        agree = rank0s if self.distributed else None
        with torch.cuda.device(a.device) if a.is_cuda else contextlib.nullcontext():
            # In a process group _impl_for has settled rank 0's cache entry already: time at once.
            return selector.choose(key, candidates, agree, write=self.rank == 0, cached=not self.distributed)

    @staticmethod
    def _timed_step(cfg: ShardConfig, a: Tensor, w: Tensor, labels: Tensor, rows: Optional[Tensor]):
        """One shard's forward + backward of ``cfg.impl`` on detached inputs, its results dropped:
        the work of the whole shard, with a bounded transient.

        The fused forward runs over all ``n`` scored classes of the shard, as the step's own forward
        does: Triton's autotuner keys the forward kernel on the class count's power-of-two bucket
        (:mod:`shardfc.head.fused.autotune`), so it tunes here once, under the key the run then uses
        (a smaller slice would be tuned under its own key, and the first step would tune again). It
        allocates what the step's forward does (the operand, at most ``OPERAND_BYTES``) and keeps
        nothing. The backward, whose weight gradient has a row per class, runs ``k = ⌈n /``
        :data:`AUTO_TIMED_CLASSES` ``⌉`` times over the first ``⌈n / k⌉`` classes: the whole
        shard's work with the transient gradient of at most :data:`AUTO_TIMED_CLASSES` classes. Its
        statistics come once, at the first call (the warm-up's), from the gemm forward of that
        slice, which has no autotuner. torch has none either: its forward (``[B, slice]`` logits)
        and backward both run ``k`` times over the slice.
        """
        a, w = a.detach(), w.detach()
        n = (w.shape[0] if rows is None else rows.numel()) // cfg.subcenters
        k = max(1, math.ceil(n / AUTO_TIMED_CLASSES))
        cfg_s, w_s, labels_s, rows_s = _first_classes(cfg, w, labels, rows, math.ceil(n / k))
        target_rows = torch.zeros_like(a, dtype=cfg.stats_dtype) if cfg.filter_threshold is not None else None
        norm = torch.linalg.vector_norm(a.to(cfg.stats_dtype), dim=1) if cfg.margin.needs_norm else None
        coef = torch.full((a.shape[0],), 1.0 / max(a.shape[0], 1), dtype=cfg.stats_dtype, device=a.device)
        forward, backward = shard_kernels(cfg)
        fused = cfg.impl != "torch"
        # the fused forward picks its code by cfg.impl when called: the slice's statistics come from
        # gemm's (no autotuner), so the only fused-kernel forward of the timing is the whole shard's
        cfg_stats = dataclasses.replace(cfg_s, impl="gemm") if fused else cfg_s
        extra = {} if target_rows is None else {"target_rows": target_rows}
        slice_stats: List[Any] = []  # the fused backward's statistics of the slice, made at the first call

        def backward_slice(stats) -> None:
            backward(a, w_s, labels_s, norm, stats, stats.row_max, stats.sum_exp.clamp(min=1.0), coef, cfg_s,
                     None, rows=rows_s, **extra)

        def run() -> None:
            with torch.no_grad(), torch.autocast(a.device.type, enabled=False):
                if not fused:
                    for _ in range(k):
                        backward_slice(forward(a, w_s, labels_s, norm, cfg_s, rows=rows_s, **extra))
                    return
                forward(a, w, labels, norm, cfg, rows=rows, **extra)  # the whole shard: the run's autotune key
                if not slice_stats:
                    slice_stats.append(forward(a, w_s, labels_s, norm, cfg_stats, rows=rows_s, **extra))
                for _ in range(k):
                    backward_slice(slice_stats[0])

        return run

    def _feature_norms(self, embeddings: Tensor, sizes: List[int], valid: Tensor) -> Tensor:
        """The global batch's norms before normalisation ``[B]`` (AdaFace, MagFace), gathered like
        the embeddings (gradient reduce-scattered, W× under the DDP convention). In training mode
        the margin's running statistics step on the valid ones (a mask, no boolean indexing: no host
        read): the same values on every rank."""
        x = embeddings.float() if embeddings.dtype in (torch.float16, torch.bfloat16) else embeddings
        norms = torch.linalg.vector_norm(x, dim=1)
        if self.distributed:
            norms = gather_rows_forward_reduce_scatter_backward(
                norms.unsqueeze(1), sizes, self.ctx, grad_scale=self.world_size
            ).squeeze(1)
        if self.training and hasattr(self.margin, "update_statistics"):
            self.margin.update_statistics(norms.detach(), valid.to(norms.device))
        return norms

    def _chunk_for(self, batch: int) -> Optional[int]:
        """The chunk size for a global batch of ``batch`` samples."""
        if self.chunk_size != "auto":
            return self.chunk_size
        # Per chunk: the fp32 logits plus a low-precision copy for the matmul (≤ 8 bytes/entry).
        return max(1, self.chunk_budget_bytes // (8 * max(batch, 1)))

    def stage_draw_step(self) -> None:
        """Partial FC: write the step number the next draw reads (:attr:`sample_step`) on each
        shard's device, if it is not there already — before a CUDA graph of a training step is
        captured or replayed (:class:`~shardfc.head.capture.CapturedHeadStep`), where it cannot be."""
        for w in self.shard_weights:
            self._draw_steps.on(w.device, self.sample_step)

    def replayed_draw(self, step: int) -> None:
        """A replayed CUDA graph of a training step drew step ``step``'s sample and advanced the
        device's counters; no Python ran, so the host's count follows here."""
        self.sample_step = step + 1
        self._draw_steps.replayed(self.sample_step)

    def draw_tensors(self) -> list:
        """The device counters the draw reads and advances (what a captured graph holds)."""
        return self._draw_steps.tensors()

    def _sample_classes(self, all_labels: Tensor, local_labels: List[Tensor]):
        """Partial FC: each shard's sampled rows, labels re-indexed into them, and the sampled total."""
        step, self.sample_step = self.sample_step, self.sample_step + 1
        first_shard = self.rank if self.distributed else 0
        counters = self._draw_steps
        # A fixed count per shard, from shapes alone (no read of the labels): ⌈r·n⌉, or the global
        # batch size when larger, the most distinct positives a shard can have (sampling.num_sampled).
        batch = all_labels.shape[0]
        ranges = class_ranges(self.num_classes, self.world_size * len(self.devices))
        sub_labels, sampled = [], []
        for i, (w, lab) in enumerate(zip(self.shard_weights, local_labels)):
            n_classes = w.shape[0] // self.subcenters
            keep = num_sampled(n_classes, self.sample_rate, batch)
            # Step `step` of this shard's stream, read from the device's counter (no host number)
            rows = sample_present(positive_mask(lab, n_classes), keep, counters.on(w.device, step),
                                  mix_seed(self.sample_seed, first_shard + i))
            sampled.append(rows)
            # one entry at least: a shard of no classes (fewer classes than shards) looks its labels,
            # all outside it, up at 0 before torch.where discards them
            lut = torch.full((max(n_classes, 1),), -1, dtype=torch.int64, device=w.device)
            lut[rows] = torch.arange(rows.numel(), device=w.device)
            sub_labels.append(torch.where(lab >= 0, lut[lab.clamp(min=0)], lab))
            if self.subcenters > 1:  # a sampled class brings all its centres, class-major
                K = self.subcenters
                sampled[-1] = (rows.unsqueeze(1) * K + torch.arange(K, device=rows.device)).view(-1)
        for device in {str(w.device): w.device for w in self.shard_weights}.values():
            counters.advance(device)
        self._record_rows(sampled)
        total = sum(num_sampled(len(r), self.sample_rate, batch) for r in ranges)
        return sampled, sub_labels, total

    # ------------------------------------------------------------------ sharded state
    def state_layout(self) -> Dict[str, Any]:
        """Which rows of the logical head :meth:`sharded_state` holds and :meth:`load_sharded_state`
        expects: ``{"num_classes": C, "class_range": range(start, stop)}`` (this process's classes,
        one contiguous block over its local shards). What to ask a resharding checkpoint for."""
        return {"num_classes": self.num_classes, "class_range": self.class_range}

    def sharded_state(self, optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[str, Any]:
        """This process's part of the head's state, as one block of classes whatever its sharding
        (see :func:`shardfc.head.sharded_state.sharded_state`). Reads a deferred input check first
        (:meth:`check_pending`): a state trained on a bad batch is not handed out silently."""
        self.check_pending()
        self.catch_up()
        if optimizer is not None and hasattr(optimizer, "catch_up_all_"):
            optimizer.catch_up_all_()  # its own rows too, if this head is not the one attached to it
        return _state.sharded_state(self, optimizer)

    def load_sharded_state(self, state: Mapping[str, Any], optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Load a :meth:`sharded_state` dict saved with any sharding into the local shards (see
        :func:`shardfc.head.sharded_state.load_sharded_state`)."""
        _state.load_sharded_state(self, state, optimizer)

    def grow(
        self, n: int, rows: Union[Tensor, Callable[[range], Tensor], None] = None,
        optimizer: Optional[torch.optim.Optimizer] = None,
    ) -> "ShardedMarginHead":
        """Add ``n`` classes (ids ``C .. C + n - 1``) in place, keeping every trained row and its
        optimizer state bit-identical and rebalancing the shards (see
        :func:`shardfc.head.grow.grow_head`; collective in process-group mode).

        Args:
            n: classes to add.
            rows: their centres: ``[n, D]`` (``[n, K, D]`` with sub-centres), a function of a range
                of new class ids giving those rows, or None for the seeded random rows.
            optimizer: the head's optimizer, whose parameters and per-row state grow with it.
        """
        return grow_head(self, n, rows, optimizer)

    # ------------------------------------------------------------------ predict
    @torch.no_grad()
    def predict(self, embeddings: Tensor, k: int = 5) -> Tuple[Tensor, Tensor]:
        """Top-``k`` classes over *all* classes for this rank's samples: ``(scores, class ids)``.

        Scores are the logits without the margin (``s·cos θ`` for normalised margins, ``x·w`` for
        plain softmax, ``‖x‖·cos θ`` for SphereFace). Only ``k`` candidates per sample per shard
        move between ranks or devices.
        """
        error = check_embeddings(embeddings, self.embedding_dim)
        if error is None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.num_classes):
            error = ValueError(f"k must be an int in [1, num_classes={self.num_classes}], got {k!r}")
        local_batch = embeddings.shape[0] if error is None else 0
        sizes = self._exchange(error, local_batch)
        self.catch_up()
        home = embeddings.device
        x = self._prepare_embeddings(embeddings)
        embeds = self._global_embeddings(x, sizes, autograd=False)
        B = sum(sizes)
        cand_scores, cand_ids = [], []
        for a, w, r in zip(embeds, self.shard_weights, self.shard_ranges):
            s, i = _shard_topk(a, w, r, k, self.margin, self._chunk_for(B), self.subcenters)
            cand_scores.append(s.to(home))
            cand_ids.append(i.to(home))
        scores, ids = torch.cat(cand_scores, dim=1), torch.cat(cand_ids, dim=1)
        if self.distributed:
            world = self.world_size
            scores = self.ctx.all_gather_rows(scores, [B] * world).view(world, B, k)
            ids = self.ctx.all_gather_rows(ids, [B] * world).view(world, B, k)
            scores, ids = scores.permute(1, 0, 2).reshape(B, world * k), ids.permute(1, 0, 2).reshape(B, world * k)
            offset = sum(sizes[: self.rank])
            scores, ids = scores[offset : offset + sizes[self.rank]], ids[offset : offset + sizes[self.rank]]
        top, pos = scores.topk(k, dim=1)
        return top, ids.gather(1, pos)

    def extra_repr(self) -> str:
        where = {
            "group": f"rank {self.rank}/{self.world_size}",
            "devices": f"devices={[str(d) for d in self.devices]}",
            "single": "single shard",
        }[self.mode]
        chunk = f", chunk_size={self.chunk_size}" if self.chunk_size else ""
        if self.sample_rate < 1.0:
            chunk += f", sample_rate={self.sample_rate}" + (", sparse_grad=True" if self.sparse_grad else "")
        if self.subcenters > 1:
            chunk += f", subcenters={self.subcenters}"
        if self.interclass_filter_threshold is not None:
            chunk += f", interclass_filter_threshold={self.interclass_filter_threshold}"
        return (
            f"embedding_dim={self.embedding_dim}, num_classes={self.num_classes}, margin={self.margin}, "
            f"{where}, classes={self.class_range.start}..{self.class_range.stop - 1}, "
            f"reduction={self.reduction!r}, label_smoothing={self.label_smoothing}{chunk}"
        )


def workload_key(
    head: ShardedMarginHead, batch: int, compute_dtype: torch.dtype, weight_dtype: torch.dtype,
    device: torch.device, sampling: bool, fused_update: bool = False,
) -> str:
    """The key under which ``impl="auto"`` remembers its choice for a forward of ``head`` over a
    global batch of ``batch`` samples (:func:`~shardfc.head.impl_select.workload_key`): what can
    change which implementation is fastest. Counts are global (the same on every rank) and bucketed
    to a power of two, since a shard's class count differs by one between ranks when C does not
    divide; the machine's fields (GPU name, shardfc / torch / CUDA / Triton versions) are constant in
    a process. So every rank meets a new key at the same forward, where the ranks agree.

    ``sampling``: the forward samples classes (Partial FC in training): the sample rate and
    ``sparse_grad`` then change the work; a dense forward keys them as 1.0 and False.
    ``fused_update``: the optimizer update is fused into the backward (more work there); False
    until the head can do it.
    """
    if not isinstance(sampling, bool):
        raise TypeError(f"sampling must be True or False, got {sampling!r}")
    if not isinstance(fused_update, bool):
        raise TypeError(f"fused_update must be True or False, got {fused_update!r}")
    margin = head.margin
    return impl_select.workload_key(
        batch=impl_select.bucket(batch), classes=impl_select.bucket(head.num_classes), dim=head.embedding_dim,
        subcenters=head.subcenters, sample_rate=head.sample_rate if sampling else 1.0,
        sparse_grad=head.sparse_grad and sampling, fused_update=fused_update,
        compute=str(compute_dtype), weights=str(weight_dtype), margin=type(margin).__name__,
        normalize=margin.normalize_weights, needs_norm=margin.needs_norm, smoothing=head.label_smoothing > 0,
        filter=head.interclass_filter_threshold is not None, world=head.world_size, shards=len(head.devices),
        chunk_scale=head.gpu_chunk_scale,
        **impl_select.environment_fields(device),
    )


def _local_view(device: torch.device, compute_dtype: torch.dtype,
                stats_dtype: torch.dtype) -> Tuple[Optional[str], bool, Optional[Exception]]:
    """What this rank would do under ``impl="auto"`` alone, for the agreement: ``(override, runs,
    cause)``. ``override``: what ``$SHARDFC_HEAD_IMPL`` names (None when unset or ``auto``,
    :data:`~shardfc.head.impl_select.INVALID` when it names nothing); ``runs``: that implementation
    can run here, or without one, the candidates can be timed here; ``cause``: why not. Raises
    nothing: a rank that raised here would leave the others waiting in the agreement."""
    try:
        override = impl_select.env_override()
    except ValueError as e:
        return impl_select.INVALID, False, e
    if override in (None, "auto"):
        if resolve_impl("auto", device, compute_dtype, stats_dtype) == "auto":
            return None, True, None
        why = triton_unavailable(device, compute_dtype, stats_dtype) or f"the head's tensors are on {device}, not a CUDA device"
        return None, False, RuntimeError(why)
    try:
        resolve_impl(override, device, compute_dtype, stats_dtype)
    except ValueError as e:
        return override, False, e
    return override, True, None


def _first_classes(cfg: ShardConfig, w: Tensor, labels: Tensor, rows: Optional[Tensor], n: int):
    """``(cfg, w, labels, rows)`` of a shard cut to its first ``n`` scored classes (the labels of the
    others ignored), for timing."""
    K = cfg.subcenters
    if rows is not None:
        rows = rows[: n * K]
    else:
        w = w[: n * K]
    labels = torch.where(labels < n, labels, torch.full_like(labels, -1))
    return dataclasses.replace(cfg, num_classes=max(n, 1)), w, labels, rows


def reduce_losses(losses: Tensor, valid: Tensor, sizes: Sequence[int], rank: int, reduction: str) -> Tensor:
    """Reduce the global batch's per-sample losses as ``reduction`` says (see the head);
    ``valid`` marks the samples whose label is not ``ignore_index``."""
    if reduction == "mean":
        return losses.sum() / valid.sum().clamp(min=1).to(losses.dtype)
    if reduction == "sum":
        return losses.sum()
    offset = sum(sizes[:rank])
    return losses[offset : offset + sizes[rank]]


def _shard_topk(a: Tensor, w: Tensor, r: range, k: int, margin, chunk_size: Optional[int], subcenters: int):
    """This shard's top-k margin-free logits (a class's best centre), padded with (−inf, −1) to k columns."""
    K = subcenters
    B, n = a.shape[0], w.shape[0] // K
    sd = torch.float64 if torch.float64 in (a.dtype, w.dtype) else torch.float32
    best_s = torch.full((B, k), -math.inf, dtype=sd, device=a.device)
    best_i = torch.full((B, k), -1, dtype=torch.int64, device=a.device)
    step = chunk_size or max(n, 1)
    for start in range(0, n, step):
        stop = min(start + step, n)
        centres = w[start * K : stop * K]
        if margin.normalize_weights:
            centres = l2_normalize(centres)
        z = (a.to(sd) @ centres.to(sd).t()) * margin.scale
        if K > 1:
            z = z.view(B, -1, K).amax(dim=2)
        ids = torch.arange(r.start + start, r.start + stop, device=a.device).expand(B, -1)
        s_all, i_all = torch.cat([best_s, z], dim=1), torch.cat([best_i, ids], dim=1)
        best_s, pos = s_all.topk(k, dim=1)
        best_i = i_all.gather(1, pos)
    return best_s, best_i
