"""Build one stage of a model without building the rest, initialised as the whole model would be.

A pipeline rank needs the weights of its stage only, but they must be exactly those of the unsplit
model built from the same seed (so a pipeline run starts where a ddp run starts, and its loss curve
is ddp's). The unsplit model's initialisation is a sequence of operations on the global random
generator, over *all* its parameters in construction order; a stage's weights depend on how many
random numbers every parameter before them consumed.

So the model is built twice, cheaply:

1. :func:`record_build` builds it on the ``meta`` device (no memory, no random numbers drawn)
   while a dispatch mode records every operation the constructors run, in order;
2. :func:`materialise` gives the chosen modules (a stage) real storage and replays the record:
   operations that write the stage's tensors run on them; random operations on the *other*
   tensors only advance the generator by the same amount, through a small scratch buffer
   (``uniform_`` / ``normal_`` of a large tensor draw the same random numbers as a series of
   small ``uniform_`` calls, which is checked once against the real operation on this build of
   torch, else a scratch tensor of the full size is used, one at a time); everything else is
   skipped.

The stage's parameters and buffers end bit-identical to the whole build's, and the generator ends
in the same state (so whatever is drawn next, a head's initialisation or a data order, is the
same too). The build must run on the CPU (as :func:`shardfc.models.build_backbone` does): that is
the generator replayed. A construction this replay cannot follow (a stage's tensor computed from
a tensor outside the stage, or one never written) raises :class:`NotReplayable`; the caller can
then build the whole model instead (:func:`build_stage` does, with a warning).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["NotReplayable", "RecordedBuild", "build_stage", "materialise", "record_build"]

logger = logging.getLogger("shardfc.parallel")

#: Elements a scratch buffer holds when a random operation on another stage's tensor is skipped.
SKIP_CHUNK = 1 << 18


class NotReplayable(RuntimeError):
    """The recorded construction cannot be replayed for these modules alone."""


@dataclass
class _Op:
    func: Any
    args: tuple
    kwargs: dict
    out: Any


@dataclass
class RecordedBuild:
    """A model built on the meta device and the operations its construction ran, in order."""

    model: nn.Module
    ops: List[_Op] = field(default_factory=list)


class _Recorder(TorchDispatchMode):
    def __init__(self, ops: List[_Op]) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append(_Op(func, args, kwargs, out))
        return out


def record_build(build: Callable[[], nn.Module]) -> RecordedBuild:
    """``build()`` on the meta device, recorded; the global generator is left as it was."""
    state = torch.random.get_rng_state()
    ops: List[_Op] = []
    try:
        with torch.device("meta"), _Recorder(ops):
            model = build()
    finally:
        torch.random.set_rng_state(state)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.device.type != "meta":
            raise NotReplayable(f"{name} was built on {t.device}, not on the meta device: the build ignores torch.device()")
    return RecordedBuild(model, ops)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _written(op: _Op) -> List[torch.Tensor]:
    """The tensors ``op`` writes in place (its mutable arguments, ``out=`` included)."""
    out = []
    schema = op.func._schema
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = op.args[i] if i < len(op.args) else op.kwargs.get(arg.name)
        out += [v for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor)]
    return out


def _seeded(op: _Op) -> bool:
    return torch.Tag.nondeterministic_seeded in op.func.tags


_skip_ok: Dict[Tuple[Any, torch.dtype], bool] = {}


def _draws(func: Any, n: int) -> Optional[int]:
    """How many ``uniform_`` draws of the same dtype ``func`` makes on ``n`` contiguous elements, if known."""
    if func is torch.ops.aten.uniform_.default:
        return n
    if func is torch.ops.aten.normal_.default and n >= 16:
        return n + (16 if n % 16 else 0)  # the vectorised normal_: n uniforms, the last 16 redrawn
    return None


def _skip(n: int, dtype: torch.dtype, generator: Optional[torch.Generator] = None, chunk: int = SKIP_CHUNK) -> None:
    scratch = torch.empty(min(n, chunk), dtype=dtype)
    while n > 0:
        k = min(n, scratch.numel())
        scratch[:k].uniform_(generator=generator)
        n -= k


def _skip_matches(func: Any, dtype: torch.dtype) -> bool:
    """Whether :func:`_draws` holds for ``func`` on ``dtype`` in this build of torch (checked once,
    on a private generator, against the real operation)."""
    key = (func, dtype)
    if key not in _skip_ok:
        ok = True
        for n in (1000, 1024, 4099):
            real, skipped = torch.Generator().manual_seed(n), torch.Generator().manual_seed(n)
            t = torch.empty(n, dtype=dtype)
            if func is torch.ops.aten.uniform_.default:
                t.uniform_(generator=real)
            else:
                t.normal_(generator=real)
            _skip(_draws(func, n), dtype, skipped, chunk=300)  # several chunks: they must not change the draws
            ok &= bool(torch.equal(real.get_state(), skipped.get_state()))
        _skip_ok[key] = ok
    return _skip_ok[key]


def _advance_generator(op: _Op, target: torch.Tensor) -> None:
    """Draw what ``op`` on ``target`` (another stage's tensor) would have drawn, without its memory."""
    n = target.numel()
    draws = _draws(op.func, n) if target.is_contiguous() and target.dtype in (torch.float32, torch.float64) else None
    if draws is not None and n > SKIP_CHUNK and not any(k == "generator" for k in op.kwargs) and _skip_matches(op.func, target.dtype):
        _skip(draws, target.dtype)
        return
    scratch = torch.empty_strided(target.size(), target.stride(), dtype=target.dtype)
    args = tuple(scratch if a is target else a for a in op.args)
    if any(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in tree_flatten((args, op.kwargs))[0]):
        raise NotReplayable(f"{op.func} on another stage's tensor reads a tensor outside this stage")
    op.func(*args, **op.kwargs)


_EMPTY = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default}


def _on_cpu(value: Any) -> Any:
    if isinstance(value, torch.device) and value.type == "meta":
        return torch.device("cpu")
    if isinstance(value, str) and value == "meta":
        return "cpu"
    return value


def materialise(recorded: RecordedBuild, modules: nn.Module) -> None:
    """Give ``modules`` (a part of ``recorded.model``, e.g. a stage) real CPU storage, in place, with
    exactly the values the whole model's build gives them, advancing the global generator as that
    build does; the rest of the model stays on the meta device."""
    tensors = [*modules.named_parameters(), *modules.named_buffers()]
    meta: Dict[int, Tuple[str, torch.Tensor]] = {}
    for name, t in tensors:
        if t.device.type != "meta":
            raise NotReplayable(f"{name} is on {t.device}: materialise() takes modules of a meta build")
        key = _storage(t)
        if key in meta:
            raise NotReplayable(f"{name} shares its storage with {meta[key][0]}")
        if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            raise NotReplayable(f"{name} is a view into a larger storage")
        meta[key] = (name, t)
    modules.to_empty(device="cpu")
    real_by_name = dict([*modules.named_parameters(), *modules.named_buffers()])
    base = {key: real_by_name[name] for key, (name, _) in meta.items()}
    derived: Dict[int, torch.Tensor] = {}  # id(meta tensor) -> real, for temporaries computed from ours
    keep: List[Any] = []  # keeps the meta temporaries alive, so their ids stay theirs
    written: set = set()

    def real(t: torch.Tensor) -> Optional[torch.Tensor]:
        if t.device.type != "meta":
            return t
        b = base.get(_storage(t))
        if b is not None:
            return b.as_strided(t.size(), t.stride(), t.storage_offset())
        return derived.get(id(t))

    with torch.no_grad():
        for op in recorded.ops:
            inputs = [a for a in tree_flatten((op.args, op.kwargs))[0] if isinstance(a, torch.Tensor)]
            outputs = [o for o in tree_flatten(op.out)[0] if isinstance(o, torch.Tensor)]
            writes = _written(op)
            writes_ours = [w for w in writes if _storage(w) in base]
            resolved = [real(a) for a in inputs]
            ours_out = [o for o in outputs if _storage(o) in base]
            if not inputs and ours_out and op.func in _EMPTY:
                continue  # uninitialised memory: what the build writes into it comes next
            if not inputs and ours_out:  # a factory (zeros, ones, randn...) whose result is ours
                value = op.func(*tree_map(_on_cpu, op.args), **tree_map(_on_cpu, op.kwargs))
                for o, v in zip(outputs, tree_flatten(value)[0]):
                    real(o).copy_(v)
                    written.add(_storage(o))
                continue
            if inputs and all(r is not None for r in resolved) and not [w for w in writes if real(w) is None]:
                # every input is ours (or computed from ours): compute it for real
                mapping = {id(a): r for a, r in zip(inputs, resolved)}
                value = op.func(*tree_map(lambda v: mapping.get(id(v), _on_cpu(v)), op.args),
                                **tree_map(lambda v: mapping.get(id(v), _on_cpu(v)), op.kwargs))
                written.update(_storage(w) for w in writes_ours)
                for o, v in zip(outputs, tree_flatten(value)[0]):
                    if isinstance(v, torch.Tensor) and _storage(o) not in base:
                        derived[id(o)] = v
                        keep.append(o)
                continue
            if writes_ours:
                raise NotReplayable(f"{op.func} writes a tensor of these modules from a tensor outside them")
            if _seeded(op):  # another stage's random draw: advance the generator alike
                if writes:
                    _advance_generator(op, writes[0])
                else:
                    op.func(*tree_map(_on_cpu, op.args), **tree_map(_on_cpu, op.kwargs))
    missing = [name for key, (name, _) in meta.items() if key not in written]
    if missing:
        raise NotReplayable(f"the build never writes {', '.join(missing[:5])}: their values are not in the record")


@dataclass
class StageBuild:
    """What :func:`build_stage` returns."""

    model: nn.Module
    """The whole model: this stage's modules real (CPU), the others on the meta device."""
    stages: List[nn.Module]
    """All stages of ``model`` (only ``stages[stage]`` holds real tensors, unless ``replayed`` is False)."""
    split_points: List[str]
    replayed: bool
    """False when the construction could not be replayed and the whole model was built for real."""


def build_stage(
    build: Callable[[], nn.Module],
    stage: int,
    split_points: Callable[[nn.Module], Sequence[str]],
) -> StageBuild:
    """Stage ``stage`` of ``build()`` cut at ``split_points(model)`` (given the meta-built model),
    its tensors real on the CPU and equal to the whole build's, the others never allocated.

    Falls back to building the whole model (and warns) when the construction cannot be replayed.
    """
    from shardfc.parallel.model_split import stages as cut_stages

    recorded = record_build(build)
    points = list(split_points(recorded.model))
    stage_list = cut_stages(recorded.model, points)
    if not 0 <= stage < len(stage_list):
        raise ValueError(f"stage={stage} but split_points={points} cut the model into {len(stage_list)} stages")
    state = torch.random.get_rng_state()
    try:
        materialise(recorded, stage_list[stage])
        return StageBuild(recorded.model, stage_list, points, True)
    except NotReplayable as e:
        torch.random.set_rng_state(state)
        logger.warning("building the whole model, then keeping stage %d: its construction cannot be replayed "
                       "for one stage (%s)", stage, e)
        whole = build()
        stage_list = cut_stages(whole, points)
        return StageBuild(whole, stage_list, points, False)
