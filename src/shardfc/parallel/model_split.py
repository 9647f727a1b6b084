"""Model parallelism in one process: cut a backbone into stages, one device per stage.

A backbone that is too large (or too slow) for one accelerator is cut at named *split points*
into consecutive stages; stage ``k``'s modules live on ``devices[k]`` and each stage's output
activation is moved to the next stage's device with ``.to(next_device)``. Autograd follows the
copies, so the backward runs on the devices that hold each stage's weights, and outputs and
gradients are those of the unsplit model.

* :func:`stages` cuts a model into an ordered list of :class:`Stage` modules (no copying, no
  moving: the stages hold the model's own submodules).
* :func:`split_model` moves the stages to their devices and returns a :class:`SplitModel`.
* :class:`PipelinedModel` runs a :class:`SplitModel` on micro-batches in a wavefront, the schedule
  of PyTorch's single-machine model-parallel tutorial, so that on CUDA the stages overlap.

Where a model may be cut
------------------------
A model describes its ``forward`` as named *segments* in a ``segments`` class attribute: an
ordered tuple of ``(segment_name, items)``, each item the name of a top-level child module or
``"flatten"`` (``torch.flatten(x, 1)``, the glue between a conv trunk and a linear head). Running
the segments in order must be exactly ``forward`` (minus its input-shape check); the tests check
this for every registered backbone. A split point is the name of a segment the model may be cut
*after*: every segment but the last. The backbones here:

==================  ==========================================================================
backbone            segments (split points are all but the last)
==================  ==========================================================================
``iresnet*``        ``stem`` (conv1, bn1, prelu), ``layer1`` .. ``layer4``,
                    ``head`` (bn2, dropout, flatten, fc, features)
``resnet50``        ``stem``, ``layer1`` .. ``layer4``, ``head`` (pool, flatten, reduce, neck)
``tiny``            ``body``, ``head`` (pool, flatten, fc, features)
``mobilefacenet``   ``stem``, ``blocks``, ``head`` (conv_expand, gdc, flatten, fc, features)
``mbf*``            ``trunk`` (layers: arcface_torch's keys hold every stage in one child),
                    ``conv_sep``, ``head`` (features)
``nn.Sequential``   one segment per child, named as the child
==================  ==========================================================================

A subclass that changes ``forward`` must change ``segments`` too.

Cuts between blocks
-------------------
A segment that is one ``nn.Sequential`` of blocks (iresnet's ``layer1`` .. ``layer4``, resnet50's)
may also be cut *between* its blocks, where the model says so in a ``block_segments`` class
attribute: the split point ``"layer3.14"`` cuts after block ``14`` of ``layer3``, so one stage
runs ``layer3[:15]`` and the next ``layer3[15:]`` (slices of the same ``nn.Sequential`` that keep
the block keys, so ``state_dict`` keys stay the model's). Whole segments are what a person names
(:func:`available_split_points`); the block boundaries (``available_split_points(model,
blocks=True)``) are what makes stages of equal size possible: iresnet100's ``layer3`` alone holds
more than half of its parameters, so no cut between segments gives four stages of about a
quarter each, and :func:`shardfc.parallel.pipeline.balanced_split_points` cuts between blocks.

Caveats
-------
* The model's modules are moved in place and shared with the stages: keep using ``model`` for
  ``state_dict()`` (its keys are unchanged), build the optimizer after splitting, and do not call
  ``.to(device)`` / ``.cuda()`` on the split model (that would put every stage on one device; dtype
  conversions such as ``.double()`` are fine).
* Stages do not repeat a backbone's input-shape check (an iresnet fed the wrong size fails at its
  FC instead of with the backbone's message).

(Longer than ~400 lines on purpose: cutting, placing and pipelining a model share the segment
declarations, the device checks and the stage type, and are read together.)
"""

from __future__ import annotations

import difflib
import numbers
from collections import OrderedDict
from typing import Iterable, Sequence, Union

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = [
    "FLATTEN",
    "PipelinedModel",
    "SplitModel",
    "Stage",
    "available_split_points",
    "batch_stats_module",
    "model_segments",
    "split_model",
    "stages",
]

#: the segment item meaning ``torch.flatten(x, 1)`` (a reserved name: no child may be called so)
FLATTEN = "flatten"

Segments = tuple[tuple[str, tuple[str, ...]], ...]
DeviceLike = Union[str, int, torch.device]



# --------------------------------------------------------------------------- segments
def model_segments(model: nn.Module) -> Segments:
    """``model``'s forward as ``((segment_name, (item, ...)), ...)``, checked against its children.

    From ``model.segments`` if it has one, else, for an ``nn.Sequential``, one segment per child. Raises TypeError for a
    model with none of these and ValueError for a declaration that does not match the model.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    decl = getattr(model, "segments", None)
    if decl is None and isinstance(model, nn.Sequential):
        decl = tuple((name, (name,)) for name, _ in model.named_children())
    if decl is None:
        raise TypeError(
            f"{type(model).__name__} declares no segments, so it cannot be cut: give the class a "
            "`segments` attribute (see shardfc.models.IResNet.segments), or build the model as an "
            "nn.Sequential, or cut it yourself and pass the stage modules to SplitModel"
        )
    decl = tuple((str(name), tuple(items)) for name, items in decl)
    _check_segments(model, decl)
    return decl


def _check_segments(model: nn.Module, decl: Segments) -> None:
    cls = type(model).__name__
    if not decl:
        raise ValueError(f"{cls}.segments is empty")
    children = dict(model.named_children())
    if FLATTEN in children:
        raise ValueError(f"{cls} has a child named {FLATTEN!r}, a reserved segment item")
    own = [n for n, _ in model.named_parameters(recurse=False)] + [n for n, _ in model.named_buffers(recurse=False)]
    if own:
        raise ValueError(
            f"{cls} holds parameters/buffers directly ({', '.join(own)}), outside any child "
            "module, so no stage could own them"
        )
    names = [name for name, _ in decl]
    if len(set(names)) != len(names):
        raise ValueError(f"{cls}.segments repeats a segment name: {names}")
    placed: dict[str, str] = {}
    for name, items in decl:
        for item in items:
            if item == FLATTEN:
                continue
            if item not in children:
                raise ValueError(f"{cls}.segments: segment {name!r} names {item!r}, which is not a child of the model")
            if item in placed:
                raise ValueError(f"{cls}.segments: child {item!r} is in both {placed[item]!r} and {name!r}")
            placed[item] = name
    missing = [c for c in children if c not in placed]
    if missing:
        raise ValueError(
            f"{cls}.segments does not place the children {missing}; every child must be in a "
            "segment (else it would stay behind on its device, unused)"
        )


class _Unit:
    """The smallest piece a model is cut into: a whole segment, or one block of a block segment."""

    __slots__ = ("point", "segment", "block", "blocks")

    def __init__(self, point: str, segment: int, block: int | None, blocks: int) -> None:
        self.point = point
        """The split point that cuts right after this unit."""
        self.segment = segment
        """Index of its segment in the declaration."""
        self.block = block
        """Block index inside its segment's ``nn.Sequential`` (None: the whole segment)."""
        self.blocks = blocks
        """How many blocks its segment has (1 for a segment that is not cut between blocks)."""


def _block_segments(model: nn.Module, decl: Segments) -> dict[str, nn.Sequential]:
    """The segments of ``model.block_segments``, checked: each must be one plain ``nn.Sequential``."""
    names = tuple(getattr(model, "block_segments", ()) or ())
    cls = type(model).__name__
    by_name = dict(decl)
    children = dict(model.named_children())
    out: dict[str, nn.Sequential] = {}
    for name in names:
        items = by_name.get(name)
        if items is None:
            raise ValueError(f"{cls}.block_segments names {name!r}, which is not one of its segments")
        child = children.get(items[0]) if len(items) == 1 else None
        if not isinstance(child, nn.Sequential) or type(child).forward is not nn.Sequential.forward:
            raise ValueError(
                f"{cls}.block_segments names {name!r}, which is not a single nn.Sequential child: "
                "only a plain sequence of blocks can be cut between its blocks"
            )
        out[name] = child
    return out


def split_units(model: nn.Module, decl: Segments) -> list[_Unit]:
    blocky = _block_segments(model, decl)
    units: list[_Unit] = []
    for i, (name, items) in enumerate(decl):
        seq = blocky.get(name)
        if seq is None or len(seq) < 2:
            units.append(_Unit(name, i, None, 1))
            continue
        keys = list(seq._modules)
        for b, key in enumerate(keys):
            last = b == len(keys) - 1
            units.append(_Unit(name if last else f"{items[0]}.{key}", i, b, len(keys)))
    return units


def available_split_points(model: nn.Module, blocks: bool = False) -> tuple[str, ...]:
    """The names ``model`` may be cut after, in forward order: every segment but the last; with
    ``blocks``, also the boundaries between the blocks of its ``block_segments`` (``"layer3.14"``)."""
    decl = model_segments(model)
    if not blocks:
        return tuple(name for name, _ in decl[:-1])
    return tuple(u.point for u in split_units(model, decl)[:-1])


def _check_split_points(model: nn.Module, decl: Segments, split_points: Sequence[str]) -> tuple[list[int], list[_Unit]]:
    """Indices (into the model's units) of the units to cut after, and the units; ValueError/TypeError
    naming the problem."""
    cls = type(model).__name__
    if isinstance(split_points, (str, bytes)) or not isinstance(split_points, Iterable):
        raise TypeError(
            f"split_points must be a sequence of segment names (e.g. ['layer2']), got {split_points!r}"
        )
    points = list(split_points)
    units = split_units(model, decl)
    fine = [u.point for u in units[:-1]]
    valid = [name for name, _ in decl[:-1]]
    last = decl[-1][0]
    listing = ", ".join(valid) if valid else "(none: the model is a single segment)"
    inner = [u.point for u in units[:-1] if u.block is not None and u.point != decl[u.segment][0]]
    between = (
        f"{cls} may also be cut between the blocks of {', '.join(dict.fromkeys(p.rsplit('.', 1)[0] for p in inner))} "
        f"({inner[0]!r}: after block {inner[0].rsplit('.', 1)[1]} of {inner[0].rsplit('.', 1)[0]})" if inner else ""
    )
    for i, p in enumerate(points):
        if not isinstance(p, str):
            raise TypeError(f"split_points[{i}] must be a segment name (str), got {p!r}")
        if p == last:
            raise ValueError(
                f"split_points: {p!r} is the last segment of {cls}, so nothing follows it to put on "
                f"another device; valid split points, in forward order: {listing}"
            )
        if p not in fine:
            close = difflib.get_close_matches(p, valid, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            also = f"{'' if close else '.'} {between}" if between else ""  # a second sentence
            raise ValueError(
                f"split_points: unknown split point {p!r} for {cls}; valid split points, in "
                f"forward order: {listing}{hint}{also}"
            )
    for p in points:
        if points.count(p) > 1:
            raise ValueError(f"split_points lists {p!r} more than once: {points}")
    index = [fine.index(p) for p in points]
    if index != sorted(index):
        raise ValueError(
            f"split_points must be in forward order ({listing}), got {points}"
        )
    return index, units


# --------------------------------------------------------------------------- stages
class Stage(nn.Sequential):
    """Consecutive segments of a model: its children (shared, not copied) run in order.

    Children keep their names from the model, so a stage's ``state_dict`` keys are the model's
    keys for the parameters it holds. ``segment_names`` names the segments the stage runs.
    """

    def __init__(self, modules: "OrderedDict[str, nn.Module]", segment_names: Sequence[str]) -> None:
        super().__init__(modules)
        self.segment_names = tuple(segment_names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # nn.Sequential's, written here: torch.compile (a pipeline stage under --compile) traces from
        # a frame in this file, where it skips one in torch's own nn.Sequential (nothing compiled).
        for module in self:
            x = module(x)
        return x

    def extra_repr(self) -> str:
        return f"segments={list(self.segment_names)}"


def stages(model: nn.Module, split_points: Sequence[str]) -> list[Stage]:
    """Cut ``model`` after each of ``split_points`` into ``len(split_points) + 1`` stages.

    Running the stages in order is ``model(x)`` exactly (the same modules and ops in the same
    order; bit-identical on one device). Nothing is copied or moved: the stages hold the model's
    own submodules (a segment cut between its blocks is held as slices of its ``nn.Sequential``
    that keep the block keys). ``split_points`` must be names from :func:`available_split_points`
    (``blocks=True`` for the boundaries between blocks), in forward order, each once; ``[]`` gives
    one stage.
    """
    decl = model_segments(model)
    cuts, units = _check_split_points(model, decl, split_points)
    bounds = [0] + [i + 1 for i in cuts] + [len(units)]
    children = dict(model.named_children())
    out: list[Stage] = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        modules: OrderedDict[str, nn.Module] = OrderedDict()
        names: list[str] = []
        for seg in sorted({u.segment for u in units[lo:hi]}):
            mine = [u for u in units[lo:hi] if u.segment == seg]
            name, items = decl[seg]
            if mine[0].block is not None and len(mine) < mine[0].blocks:  # part of a block segment
                b0, b1 = mine[0].block, mine[-1].block + 1
                modules[items[0]] = children[items[0]][b0:b1]  # a slice keeps the blocks' keys
                names.append(f"{name}[{b0}:{b1}]")
                continue
            names.append(name)
            for item in items:
                if item == FLATTEN:
                    key, n = FLATTEN, 1
                    while key in modules or key in children:
                        key, n = f"{FLATTEN}{n}", n + 1
                    modules[key] = nn.Flatten(1)
                else:
                    modules[item] = children[item]
        out.append(Stage(modules, names))
    return out


# --------------------------------------------------------------------------- devices
def _resolve_device(value: DeviceLike, where: str) -> torch.device:
    """``value`` as a torch.device that exists here; ValueError naming ``where`` and the value."""
    if isinstance(value, bool):
        raise ValueError(f"{where}={value!r} is not a device")
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError, ValueError) as err:
        raise ValueError(f"{where}={value!r} is not a device: {err}") from None
    if dev.type == "meta":
        raise ValueError(f"{where}={value!r}: the meta device holds no data; a stage moved there would lose its weights")
    if dev.type == "cpu":
        if dev.index not in (None, 0):
            raise ValueError(f"{where}={value!r} does not exist: there is one CPU device, 'cpu' (list it once per stage)")
        return torch.device("cpu")
    backend = getattr(torch, dev.type, None)
    count = getattr(backend, "device_count", None)
    if callable(count):
        available = getattr(backend, "is_available", None)
        n = count() if (available is None or available()) else 0
        if n == 0:
            raise ValueError(f"{where}={value!r} does not exist: this machine has no {dev.type} device")
        if dev.index is not None and dev.index >= n:
            raise ValueError(
                f"{where}={value!r} does not exist: this machine has {n} {dev.type} device(s), "
                f"{dev.type}:0 .. {dev.type}:{n - 1}"
            )
    try:
        torch.empty(0, device=dev)
    except Exception as err:  # noqa: BLE001 - any backend's "not here" error, reported as one
        raise ValueError(f"{where}={value!r} is not usable on this machine: {err}") from None
    return dev


def check_devices(devices: Sequence[DeviceLike], n_stages: int, why: str) -> tuple[torch.device, ...]:
    if isinstance(devices, (str, bytes, int, torch.device)) or not isinstance(devices, Iterable):
        raise TypeError(f"devices must be a sequence with one device per stage (e.g. ['cuda:0', 'cuda:1']), got {devices!r}")
    devs = list(devices)
    if len(devs) != n_stages:
        raise ValueError(f"devices: got {len(devs)} ({devs}) but {why} = {n_stages}, one device per stage")
    return tuple(_resolve_device(d, f"devices[{i}]") for i, d in enumerate(devs))


def _to(x: torch.Tensor, device: torch.device, stage: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        what = "the input" if stage == 0 else f"stage {stage - 1}'s output"
        raise TypeError(
            f"{what} is a {type(x).__name__}; stages pass a single tensor from one to the next"
        )
    return x.to(device)


# --------------------------------------------------------------------------- split model
class SplitModel(nn.Module):
    """Stages on devices, run in order; ``forward(x)`` returns the last stage's output on the last device.

    ``SplitModel(stages, devices)`` moves ``stages[k]`` to ``devices[k]`` (in place) and, in
    ``forward``, moves the input to ``devices[0]`` and each stage's output to the next stage's
    device. The output and, through autograd, every gradient equal the unsplit model's (on one
    device, bit for bit). Usually built by :func:`split_model`. Attributes: ``stages``
    (``nn.ModuleList``), ``devices`` (tuple of ``torch.device``), ``split_points`` (names, when
    built by :func:`split_model`, else ``None``).
    """

    def __init__(self, stages: Sequence[nn.Module], devices: Sequence[DeviceLike]) -> None:
        super().__init__()
        if isinstance(stages, nn.Module) and not isinstance(stages, nn.ModuleList):
            raise TypeError(
                f"stages must be a sequence of modules, got a single {type(stages).__name__}; "
                "use split_model(model, devices, split_points) to cut a model"
            )
        stage_list = list(stages)
        if not stage_list:
            raise ValueError("stages is empty: a SplitModel needs at least one stage")
        for i, s in enumerate(stage_list):
            if not isinstance(s, nn.Module):
                raise TypeError(f"stages[{i}] must be an nn.Module, got {type(s).__name__}")
        devs = check_devices(devices, len(stage_list), "len(stages)")
        _check_not_shared(stage_list, devs)
        for s, d in zip(stage_list, devs):
            s.to(d)
        self.stages = nn.ModuleList(stage_list)
        self.devices: tuple[torch.device, ...] = devs
        self.split_points: tuple[str, ...] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, (stage, dev) in enumerate(zip(self.stages, self.devices)):
            x = stage(_to(x, dev, k))
        return x

    def extra_repr(self) -> str:
        points = "" if self.split_points is None else f"split_points={list(self.split_points)}, "
        return f"{points}devices={[str(d) for d in self.devices]}"


def _check_not_shared(stage_list: Sequence[nn.Module], devs: Sequence[torch.device]) -> None:
    """A tensor cannot live on two devices: no parameter/buffer may be in stages on different ones."""
    owner: dict[int, int] = {}
    for k, s in enumerate(stage_list):
        for name, t in [*s.named_parameters(), *s.named_buffers()]:
            j = owner.setdefault(id(t), k)
            if j != k and devs[j] != devs[k]:
                raise ValueError(
                    f"stages[{j}] and stages[{k}] share the tensor {name!r} but are on different "
                    f"devices ({devs[j]}, {devs[k]}); a tensor cannot live on both"
                )


def split_model(
    model: nn.Module, devices: Sequence[DeviceLike], split_points: Sequence[str]
) -> SplitModel:
    """Cut ``model`` after each of ``split_points`` and put stage ``k`` on ``devices[k]``.

    ``len(devices)`` must be ``len(split_points) + 1``. Devices may repeat (on a CPU-only machine
    all are ``"cpu"``). Everything is validated before anything moves: unknown, duplicated or
    out-of-order split points, a wrong number of devices, and devices that do not exist here
    (``"cuda:3"`` on a machine with fewer GPUs) raise ValueError naming the argument and value.
    The model's modules move in place (see the module docstring); the returned
    :class:`SplitModel`'s output is on ``devices[-1]``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    stage_list = stages(model, split_points)
    points = tuple(split_points)
    check_devices(devices, len(stage_list), f"len(split_points) + 1 (split_points={list(points)})")
    split = SplitModel(stage_list, devices)
    split.split_points = points
    return split


# --------------------------------------------------------------------------- pipelining
def check_split_size(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise ValueError(f"split_size must be a positive int (rows per micro-batch), got {value!r}")
    return int(value)


def batch_stats_module(module: nn.Module) -> tuple[str, nn.Module] | None:
    """The first BatchNorm that would normalise with the statistics of the batch it is given."""
    for name, m in module.named_modules():
        # torch's own rule: batch statistics in training mode, or always without running stats.
        if isinstance(m, _BatchNorm) and (m.training or (m.running_mean is None and m.running_var is None)):
            return name, m
    return None


def _infer_devices(stage_list: Sequence[nn.Module]) -> list[torch.device]:
    devs = []
    for k, s in enumerate(stage_list):
        found = {t.device for t in [*s.parameters(), *s.buffers()]}
        if len(found) != 1:
            what = "has no parameters or buffers" if not found else f"is spread over {sorted(map(str, found))}"
            raise ValueError(f"cannot infer the device of stages[{k}], which {what}; pass devices=[...]")
        devs.append(found.pop())
    return devs


class PipelinedModel(nn.Module):
    """Run a :class:`SplitModel` on micro-batches of ``split_size`` rows, the stages in a wavefront.

    The schedule of PyTorch's single-machine model-parallel tutorial, for any number of stages:
    the batch is cut into ``M = ceil(B / split_size)`` micro-batches, and at tick ``t`` stage
    ``k`` runs micro-batch ``t - k``, the deepest stage first, so while stage ``k`` works on
    micro-batch ``i`` stage ``k - 1`` works on ``i + 1``. The outputs of the last stage are
    concatenated: ``forward`` returns ``[B, ...]`` on the last device, in input order.

    Overlap. On CUDA, kernel launches and GPU-to-GPU copies are asynchronous, so the Python loop
    only queues work and stages on *different* GPUs run at the same time; that is where the
    speed-up over :class:`SplitModel` comes from (fill and drain cost ``K - 1`` ticks of ``M +
    K - 1``). On CPU the ops run synchronously in one thread, so nothing overlaps: the result is
    the same, only slower than unsplit by the per-micro-batch overhead. A stage on the CPU, or a
    copy to the CPU, blocks the loop and serialises the pipeline there. Only the forward is
    scheduled; the backward is autograd's (on CUDA it runs one thread per device, so it overlaps
    across devices too). Pipelining does not cut activation memory: every micro-batch's
    activations are kept for the backward, as in the unsplit model.

    Exactness. The output and the gradients of any loss on it are those of the unsplit model for
    any ``split_size`` (one that does not divide the batch gives a smaller last micro-batch;
    ``split_size >= B`` gives one micro-batch), up to floating-point summation order in the
    parameter gradients, which are accumulated over micro-batches — provided no layer couples
    the rows of a batch. BatchNorm in training mode does: each micro-batch would be normalised
    with its own statistics and the running statistics updated ``M`` times per step. So, by
    default, a forward that would cut a batch into several micro-batches while a BatchNorm uses
    batch statistics (training mode, or ``track_running_stats=False``) raises RuntimeError rather
    than silently computing something else. Ways out: ``.eval()`` (running statistics: exact),
    ``split_size >= B`` (exact, no pipelining), or ``allow_micro_batch_stats=True``, which accepts
    GPipe's semantics: the output is that of running the unsplit model on each micro-batch in
    turn and concatenating. Only ``_BatchNorm`` subclasses are detected. Dropout in training mode
    draws its masks in a different order than the unsplit forward, so outputs differ sample by
    sample (same distribution); that is not checked.

    ``stages_or_split_model`` is a :class:`SplitModel` or a list of stage modules (with
    ``devices``, or each stage's device inferred from its parameters). ``split_size`` can be
    changed between calls.
    """

    def __init__(
        self,
        stages_or_split_model: SplitModel | Sequence[nn.Module],
        split_size: int,
        *,
        devices: Sequence[DeviceLike] | None = None,
        allow_micro_batch_stats: bool = False,
    ) -> None:
        super().__init__()
        src = stages_or_split_model
        if isinstance(src, SplitModel):
            if devices is not None:
                raise ValueError("devices: a SplitModel already places its stages; pass devices only with a list of stages")
            split = src
        elif isinstance(src, nn.Module) and not isinstance(src, nn.ModuleList):
            raise TypeError(
                f"stages_or_split_model must be a SplitModel or a list of stage modules, got a "
                f"single {type(src).__name__}; cut it first: "
                "PipelinedModel(split_model(model, devices, split_points), split_size)"
            )
        else:
            stage_list = list(src)
            for i, s in enumerate(stage_list):
                if not isinstance(s, nn.Module):
                    raise TypeError(f"stages_or_split_model[{i}] must be an nn.Module, got {type(s).__name__}")
            split = SplitModel(stage_list, _infer_devices(stage_list) if devices is None else devices)
        self.split = split
        self.split_size = split_size
        self.allow_micro_batch_stats = bool(allow_micro_batch_stats)

    @property
    def split_size(self) -> int:
        return self._split_size

    @split_size.setter
    def split_size(self, value: int) -> None:
        self._split_size = check_split_size(value)

    @property
    def stages(self) -> nn.ModuleList:
        return self.split.stages

    @property
    def devices(self) -> tuple[torch.device, ...]:
        return self.split.devices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stage_list, devs = list(self.split.stages), self.split.devices
        x = _to(x, devs[0], 0)
        chunks = list(x.split(self._split_size)) if x.dim() > 0 else [x]
        n_micro, n_stages = len(chunks), len(stage_list)
        if n_micro > 1 and not self.allow_micro_batch_stats:
            found = batch_stats_module(self.split)
            if found is not None:
                name, m = found
                raise RuntimeError(
                    f"PipelinedModel: {type(m).__name__} {name!r} normalises with batch statistics "
                    f"(training mode or track_running_stats=False), and split_size={self._split_size} "
                    f"cuts this batch of {x.shape[0]} rows into {n_micro} micro-batches, each of "
                    "which it would normalise with its own statistics, unlike the unsplit model. "
                    "Call .eval() (exact), use split_size >= the batch (exact, no pipelining), or "
                    "pass allow_micro_batch_stats=True to accept micro-batch statistics (GPipe's behaviour)"
                )
        acts: list[torch.Tensor] = chunks
        outs: list[torch.Tensor] = [x] * n_micro  # placeholders, all overwritten
        for tick in range(n_micro + n_stages - 1):
            # Deepest stage first: its input was produced in the previous tick.
            for k in range(min(n_stages - 1, tick), max(0, tick - n_micro + 1) - 1, -1):
                i = tick - k
                y = stage_list[k](acts[i])
                if k + 1 < n_stages:
                    acts[i] = _to(y, devs[k + 1], k + 1)
                else:
                    outs[i] = y
        return outs[0] if n_micro == 1 else torch.cat(outs, 0)

    def extra_repr(self) -> str:
        return f"split_size={self._split_size}, allow_micro_batch_stats={self.allow_micro_batch_stats}"
