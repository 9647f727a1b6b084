"""One training step of the real head on the ``meta`` device, its allocations counted.

:func:`replay_step` builds a :class:`~shardfc.ShardedMarginHead` and its optimizer
(:func:`~shardfc.head.partial_fc.head_optimizer`) on the ``meta`` device — tensors with a shape and
no data, so any ``C`` costs nothing — and runs the step ``shardfc bench`` runs
(:func:`shardfc.tools.bench.runner.train_step`) under :class:`_MetaStep`, a
:class:`~shardfc.tools.bench.memory.LiveTensorBytes` that also makes the meta device usable:

* **collectives**: for ``W > 1`` the process is rank 0 of a fake process group (torch's
  ``FakeProcessGroup``, which moves no data and copies a rank's contribution to every slot), so the
  head runs in process-group mode with its real gathers, reduce-scatters and all-reduces and their
  buffers. Every rank then holds rank 0's ``⌈B/W⌉`` rows. The group is destroyed afterwards.
* **values**: a meta tensor has none. Where the step's result shape depends on them, :func:`_policy`
  answers as if every boolean were True: every mask keeps every element, ``unique`` keeps every
  element, a boolean read is True (the input checks pass); a copy off the meta device is zeros. Any
  other value-dependent operator stops the replay with :class:`ReplayError`. (A head step no longer
  has any such operator — issue 31: Partial FC's sample has a fixed count, ``max(⌈r·n⌉, B)``, from
  shapes alone — so the policy now only serves the immediate input checks and older code.)
* **speed**: many meta kernels are Python; :class:`_MetaStep` remembers the output shapes of each
  operator for given input shapes and scalars, so the chunk loop's repeated operators cost a lookup.

With the head's ``impl="triton"`` or ``"gemm"`` the GPU launchers allocate their outputs on the meta device and
launch nothing (:mod:`shardfc.head.fused`), and the optimizer is the one a CUDA run builds
(:func:`fused_as_on_cuda`): torch's ``fused=True`` SGD/AdamW for fp32 centres (in place: the fused
SGD, which has no meta kernel, allocates nothing) and the row-sparse SGD's fused kernel.

Nothing here describes the head's buffers: a change in the head changes the replay.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from shardfc import progress
from shardfc.tools.bench.memory import LiveTensorBytes, tensors_in

aten = torch.ops.aten
META = torch.device("meta")

#: the replay's hyper-parameters (values do not change what a step allocates)
LR, MOMENTUM = 0.1, 0.9


class ReplayError(RuntimeError):
    """The replay reached something the meta device cannot answer."""


# --------------------------------------------------------------------------- value-dependent operators
def _as_indices(indices) -> list:
    """Boolean masks (all True, by the policy) as the integer index tensors they stand for."""
    out = []
    for i in indices:
        if i is not None and i.dtype in (torch.bool, torch.uint8):
            out += [torch.empty(i.numel(), dtype=torch.int64, device=i.device)] * i.dim()
        else:
            out.append(i)
    return out


def _unique(x, return_inverse: bool = False, return_counts: bool = False):
    n = x.numel()
    inverse = torch.empty(x.shape if return_inverse else (0,), dtype=torch.int64, device=x.device)
    counts = torch.empty(n if return_counts else 0, dtype=torch.int64, device=x.device)
    return torch.empty(n, dtype=x.dtype, device=x.device), inverse, counts


def _policy(func, args, kwargs):
    """The result of a value-dependent operator on meta tensors (see the module docstring)."""
    if func is aten._local_scalar_dense.default and args[0].dtype == torch.bool:
        return True
    if func is aten.nonzero.default:
        return torch.empty(args[0].numel(), args[0].dim(), dtype=torch.int64, device=args[0].device)
    if func is aten.index.Tensor:
        return func(args[0], _as_indices(args[1]))
    if func in (aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default):
        return func(args[0], _as_indices(args[1]), *args[2:], **kwargs)
    if func is aten.masked_select.default:
        n = torch.broadcast_shapes(args[0].shape, args[1].shape).numel()
        return torch.empty(n, dtype=args[0].dtype, device=args[0].device)
    if func is aten._unique2.default:  # (self, sorted, return_inverse, return_counts)
        flags = dict(zip(("sorted", "return_inverse", "return_counts"), args[1:]), **kwargs)
        return _unique(args[0], flags.get("return_inverse", False), flags.get("return_counts", False))
    if func is aten._to_copy.default and args[0].device.type == "meta":  # .cpu(): zeros
        x = args[0]
        return torch.zeros(x.shape, dtype=kwargs.get("dtype") or x.dtype, device=kwargs.get("device"))
    if func is aten.copy_.default and args[1].device.type == "meta":
        return args[0].zero_()
    if func is aten._fused_sgd_.default:  # torch's fused SGD (no meta kernel): updates in place, allocates nothing
        return None
    return NotImplemented


# --------------------------------------------------------------------------- the mode
class _Uncacheable(Exception):
    pass


_SCALAR_ARGS: Dict[Any, frozenset] = {}


def _scalar_args(func) -> frozenset:
    """Positions and names of ``func``'s ``Scalar`` arguments: their values never change an
    output's shape or dtype (their type may), so the cache keys them by type."""
    found = _SCALAR_ARGS.get(func)
    if found is None:
        args = func._schema.arguments
        found = frozenset(x for i, a in enumerate(args) if "number" in str(a.type) for x in (i, a.name))
        _SCALAR_ARGS[func] = found
    return found


def _describe(x, tensors: list, scalar: bool = False):
    """A hashable description of an operator argument: meta tensors by dtype, shape and strides,
    ``Scalar`` arguments by type, other values by type and value."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "meta":
            raise _Uncacheable
        tensors.append(x)
        return (x.dtype, tuple(x.shape), x.stride())
    if isinstance(x, (list, tuple)):
        return (type(x), tuple(_describe(v, tensors) for v in x))
    if x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return type(x) if scalar else (type(x), x)
    raise _Uncacheable


def _key(func, args, kwargs, tensors: list):
    scalars = _scalar_args(func)
    key = [func]
    for i, a in enumerate(args):
        key.append(_describe(a, tensors, i in scalars))
    for name in sorted(kwargs):
        key.append((name, _describe(kwargs[name], tensors, name in scalars)))
    return tuple(key)


#: (operator, description of its arguments) -> how to make its outputs
_SHAPES: Dict[Any, Tuple[Any, list]] = {}
_SHAPES_MAX = 100_000


def _leaf_recipe(leaf, tensors: list):
    if not isinstance(leaf, torch.Tensor):
        if leaf is None or isinstance(leaf, (bool, int, float)):
            return ("value", leaf)
        raise _Uncacheable
    if leaf.device.type != "meta":
        raise _Uncacheable
    for i, t in enumerate(tensors):
        if leaf is t:
            return ("same", i)
    key = leaf.untyped_storage()._cdata
    for i, t in enumerate(tensors):
        if t.untyped_storage()._cdata == key:
            return ("view", i, tuple(leaf.shape), leaf.stride(), leaf.storage_offset() - t.storage_offset())
    if leaf.storage_offset():
        raise _Uncacheable
    return ("new", tuple(leaf.shape), leaf.stride(), leaf.dtype)


def _output_recipe(out, tensors: list) -> Tuple[Any, list]:
    if isinstance(out, (tuple, list)):
        return type(out), [_leaf_recipe(v, tensors) for v in out]
    return None, [_leaf_recipe(out, tensors)]


def _make_leaf(item, tensors: list):
    kind = item[0]
    if kind == "new":
        return torch.empty_strided(item[1], item[2], dtype=item[3], device=META)
    if kind == "same":
        return tensors[item[1]]
    if kind == "view":
        base = tensors[item[1]]
        return aten.as_strided.default(base, item[2], item[3], base.storage_offset() + item[4])
    return item[1]


def _make_outputs(recipe: Tuple[Any, list], tensors: list):
    container, items = recipe
    if container is None:
        return _make_leaf(items[0], tensors)
    return container(_make_leaf(item, tensors) for item in items)


#: Operators replayed between two updates of the progress bar (a bar's update costs more than one).
BAR_EVERY = 1024


class _MetaStep(LiveTensorBytes):
    """:class:`LiveTensorBytes` that answers value-dependent operators on meta tensors by
    :func:`_policy` and remembers the output shapes of operators on meta tensors. It counts only
    while :attr:`tracking` (the warm-up runs under it too)."""

    #: a :class:`~shardfc.tools.plan.traffic.TrafficCounter` told of every operator (``--bytes``)
    observer = None
    #: a :func:`shardfc.progress.counter` advanced every :data:`BAR_EVERY` operators (a step at
    #: 10^9 classes replays a million of them: minutes on a terminal would otherwise be silent)
    bar = None
    calls = 0

    def call(self, func, args, kwargs):
        out = self._call(func, args, kwargs)
        if self.observer is not None and self.tracking:
            self.observer.op(func, args, kwargs, out)
        self.calls += 1
        if self.bar is not None and self.calls % BAR_EVERY == 0:
            self.bar.update(BAR_EVERY)
        return out

    def _call(self, func, args, kwargs):
        if func.namespace == "c10d" or func.is_view:  # the fake group's calls; views are cheap
            return self._run(func, args, kwargs)
        tensors: list = []
        try:
            key = _key(func, args, kwargs, tensors)
        except _Uncacheable:
            return self._run(func, args, kwargs)
        if not tensors:
            return self._run(func, args, kwargs)
        hit = _SHAPES.get(key)
        if hit is not None:
            return _make_outputs(hit, tensors)
        out = self._run(func, args, kwargs)
        try:
            recipe = _output_recipe(out, tensors)
        except _Uncacheable:
            return out
        if len(_SHAPES) >= _SHAPES_MAX:
            _SHAPES.clear()
        _SHAPES[key] = recipe
        return out

    @staticmethod
    def _run(func, args, kwargs):
        try:
            return func(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as error:
            if not any(t.device.type == "meta" for t in tensors_in((args, kwargs))):
                raise
            out = _policy(func, args, kwargs)
            if out is NotImplemented:
                raise ReplayError(
                    f"shardfc plan: the head's step calls {func} on the meta device, whose result "
                    f"depends on tensor values, and the replay has no rule for it ({error})"
                ) from error
            return out


# --------------------------------------------------------------------------- the world and the head
@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """This process as rank 0 of ``world_size`` ranks of a fake process group (nothing for 1)."""
    if dist.is_available() and dist.is_initialized():
        raise ReplayError("shardfc plan needs a process without torch.distributed initialised")
    if world_size == 1:
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _meta_rows(start: int, stop: int, dim: int, seed: int, device=None) -> torch.Tensor:
    return torch.empty(stop - start, dim, device=META)


def build_head(num_classes: int, dim: int, dtype: torch.dtype, **options):
    """The head as the caller would build it, on the meta device. Its initial values are skipped
    (``init_rows`` draws them block by block, for every class)."""
    from unittest import mock

    from shardfc.head import module

    if not hasattr(module, "init_rows"):
        raise ReplayError("shardfc plan replaces shardfc.head.module.init_rows to build the head without "
                          "values; it is gone: update shardfc/tools/plan/replay.py:build_head")
    with mock.patch.object(module, "init_rows", _meta_rows):
        return module.ShardedMarginHead(dim, num_classes, device=META, dtype=dtype, **options)


@contextlib.contextmanager
def fused_as_on_cuda() -> Iterator[None]:
    """:func:`~shardfc.head.partial_fc.head_optimizer` choosing for meta parameters what it chooses
    for CUDA ones of their dtype (torch's ``fused=True`` SGD/AdamW for fp32 centres), and torch
    building that optimizer on the meta device (its check of the parameters' device lets meta pass)."""
    import importlib
    from types import SimpleNamespace
    from unittest import mock

    from shardfc.head import partial_fc

    # where torch's SGD / Adam(W) look the check up (torch.optim deletes these names from itself)
    modules = [importlib.import_module(f"torch.optim.{name}") for name in ("optimizer", "sgd", "adam")]
    checks = [m for m in modules if hasattr(m, "_device_dtype_check_for_fused")]
    if not hasattr(partial_fc, "fused_optimizer_ok") or not checks:
        raise ReplayError("shardfc plan replaces shardfc.head.partial_fc.fused_optimizer_ok and torch's "
                          "_device_dtype_check_for_fused to replay the fused optimizer; one is gone: update "
                          "shardfc/tools/plan/replay.py:fused_as_on_cuda")
    choose = partial_fc.fused_optimizer_ok

    def as_on_cuda(params):
        return choose([SimpleNamespace(is_cuda=True, dtype=p.dtype) for p in params])

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(partial_fc, "fused_optimizer_ok", as_on_cuda))
        for m in checks:
            stack.enter_context(mock.patch.object(m, "_device_dtype_check_for_fused", lambda *a, **k: None))
        yield


# --------------------------------------------------------------------------- the step
@dataclass
class Replay:
    """Bytes of one step on rank 0 (the largest shard) and of the state it rests on."""

    step_peak: int  # everything the step allocates, at its peak
    step_parts: Dict[str, int]  # the same by part: gradients / activations / communication
    weights: int
    gradients: int  # the .grad kept between steps (0 when freed)
    optimizer_state: int
    n_local: int
    local_batch: int
    traffic: Optional[Dict[str, Any]] = None  # with ``traffic_l2``: .traffic.summarise's dict


def _nbytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.untyped_storage().nbytes()


def replay_step(
    num_classes: int, dim: int, batch: int, world_size: int, dtype: torch.dtype, optimizer: str,
    weight_decay: float, grads_kept: bool, fused_update: bool = False, traffic_l2: Optional[int] = None,
    **head_options,
) -> Replay:
    """Replay one step (after a warm-up that creates the gradients and the optimizer state) inside
    :func:`fake_world`. ``head_options`` go to the head (margin, chunk_size, sample_rate, ...);
    ``fused_update``: :func:`~shardfc.head.partial_fc.head_optimizer`'s; ``traffic_l2``: also count
    the step's HBM bytes kernel by kernel behind an L2 of that many bytes (:mod:`.traffic`)."""
    from shardfc.head.fused import traffic as fused_traffic
    from shardfc.head.partial_fc import RowSparseSGD, head_optimizer
    from shardfc.tools.bench.runner import train_step

    local_batch = math.ceil(batch / world_size)  # rank 0's
    head = build_head(num_classes, dim, dtype, **head_options)
    head.train()
    name = "adamw" if optimizer == "adamw" else "sgd"
    gpu = head_options.get("impl") in ("triton", "gemm")
    # The GPU path's optimizer as a CUDA run builds it: torch's fused SGD/AdamW for fp32 centres, the
    # row-sparse SGD's fused kernel.
    stack = contextlib.ExitStack()
    if gpu:
        stack.enter_context(fused_as_on_cuda())
    with stack:
        opt = head_optimizer(head, name, lr=LR, weight_decay=weight_decay, fused_update=fused_update,
                             **({} if name == "adamw" else dict(momentum=MOMENTUM if optimizer == "sgd" else 0.0)))
    if gpu and isinstance(opt, RowSparseSGD):
        opt.fused = True  # as on a CUDA GPU, where the automatic choice is its fused kernel
    if gpu and hasattr(opt, "catch_up_kernel"):
        opt.catch_up_kernel = True  # the idle rows' kernel, as on a CUDA GPU
    params = list(head.parameters())
    grad_serials: List[Optional[int]] = []
    mode = _MetaStep()
    mode.tracking = False
    counter = None
    if traffic_l2 is not None:
        from shardfc.tools.plan.traffic import TrafficCounter

        counter = mode.observer = TrafficCounter(traffic_l2, active=lambda: mode.tracking)
    sparse = getattr(head, "sparse_grad", False)
    no_grad = sparse or fused_update  # a fused update leaves no .grad: the step frees none, makes none
    if sparse:  # the compact gradients a sparse_grad backward hands the head are the step's gradients
        keep = head.keep_row_grad

        def keep_and_note(shard, rows, grad):
            grad_serials.append(mode.serial_of(grad))
            keep(shard, rows, grad)

        head.keep_row_grad = keep_and_note
    recording = fused_traffic.recording(counter.kernel) if counter is not None else contextlib.nullcontext()
    mode.bar = progress.counter(f"replaying a step of {num_classes:,} classes, batch {batch:,}", "op")
    with contextlib.closing(mode.bar), fused_as_on_cuda() if gpu else contextlib.nullcontext(), recording, mode:
        # warm-up: the state a step rests on (a kept .grad, the optimizer's buffers); a sparse_grad
        # head keeps no .grad between steps
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=not grads_kept or no_grad)
        x = torch.empty(local_batch, dim, device=META, dtype=dtype, requires_grad=True)
        labels = torch.zeros(local_batch, dtype=torch.int64)  # checked on the CPU, then moved
        if (gpu and fused_update) or getattr(head, "sample_rate", 1.0) < 1.0:
            # The steady state: a step whose forward uses the operand the previous step's fused
            # update wrote (chunks.NextOperand, held between steps), not a first step's pass over W;
            # under Partial FC, one whose forward catches up rows that sat a step out (catch_up).
            train_step(head, opt, x, labels, set_to_none=not grads_kept or no_grad)
            x.grad = None
        def note_grad(p) -> None:
            if p.grad is not None:  # a sparse_grad head's weights get none
                grad_serials.append(mode.serial_of(p.grad))

        hooks = [p.register_post_accumulate_grad_hook(note_grad) for p in params]
        mode.tracking = True
        train_step(head, opt, x, labels, set_to_none=not grads_kept or no_grad)
        mode.tracking = False
        for h in hooks:
            h.remove()
        grads = set(grad_serials) - {None}

        def part(serial: int) -> str:
            if serial in grads:
                return "gradients"
            return "communication" if serial in mode.communication else "activations"

        parts = mode.peak_by(part)
        # What the head keeps between steps for the next forward is alive through the step: on top
        # of what the step allocates (as the first step, which allocates it, would count it).
        held = sum(k.nbytes for k in getattr(head, "_next_operands", None) or ())
        parts["activations"] = parts.get("activations", 0) + held
        traffic = None
        if counter is not None:
            from shardfc.tools.plan.traffic import summarise

            traffic = summarise(counter.finish())
    state = sum(_nbytes(t) for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    state += getattr(opt, "idle_state_bound", 0)  # catch_up's stamps and step tables, at their largest
    return Replay(
        step_peak=mode.peak + held,
        step_parts={k: parts.get(k, 0) for k in ("gradients", "activations", "communication")},
        weights=sum(_nbytes(p) for p in params),
        gradients=sum(_nbytes(p.grad) for p in params) if grads_kept else 0,
        optimizer_state=state,
        n_local=sum(p.shape[0] for p in params) // getattr(head, "subcenters", 1),  # classes, not centre rows
        local_batch=local_batch,
        traffic=traffic,
    )


__all__ = ["Replay", "ReplayError", "build_head", "fake_world", "fused_as_on_cuda", "replay_step"]
