"""Time a backbone's forward + backward unsplit, split over devices, and pipelined.

:func:`time_split_sweep` builds one backbone (random weights, training mode unless
``train=False``) and times, on the same weights and the same random input batch:

* ``single``    the whole model on ``devices[0]``;
* ``split``     :func:`~shardfc.parallel.model_split.split_model` over ``devices``;
* ``pipelined`` :class:`~shardfc.parallel.model_split.PipelinedModel` over the same split, once
  per ``split_size``.

A step is ``loss = out.float().square().mean(); loss.backward()`` with the parameter gradients
reset to ``None`` before it; no optimizer step (it is the same in every configuration). Each
step is timed from a synchronised start to a synchronised end on every CUDA device in use, with
``time.perf_counter``. The pipelined configurations run with ``allow_micro_batch_stats=True``:
in training mode their BatchNorms see micro-batch statistics (see ``PipelinedModel``), which
changes the numbers computed but not the work done, so the times are comparable. Every backbone
here ends in a BatchNorm1d, which cannot normalise a 1-row micro-batch in training mode, so a
``split_size`` that leaves one (``1``, or ``batch % split_size == 1``) is refused up front
unless ``train=False``.

On CPU nothing overlaps (see ``PipelinedModel``), so ``pipelined`` can only add overhead there;
the comparison means something on several GPUs.

Split points, unless given, are chosen by :func:`balanced_split_points`: contiguous stages with
the most even share of the model's multiply-accumulates (convolutions and linear layers,
counted on one sample), which on identical devices balances compute, not memory.

No dependencies beyond torch; no plotting. Each result row is a dict with the keys
:data:`FIELDS`, in that order (JSON-ready).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..models import build_backbone, input_size
from .model_split import (
    PipelinedModel,
    check_devices,
    check_split_size,
    model_segments,
    split_model,
    stages,
)
from .partition import linear_partition

__all__ = ["FIELDS", "balanced_split_points", "time_split_sweep"]

#: the keys of one result row, in order
FIELDS = (
    "config",         # "single" | "split" | "pipelined"
    "split_size",     # rows per micro-batch (pipelined), else None
    "model",          # backbone name
    "batch",          # rows per step
    "image_size",     # [H, W]
    "devices",        # devices used, one per stage (["<devices[0]>"] for single)
    "split_points",   # where the model was cut ([] for single)
    "steps",          # timed steps
    "times_s",        # each timed step's forward + backward, seconds
    "median_s",       # median of times_s
    "mean_s",
    "min_s",
    "samples_per_s",  # batch / median_s
)


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _segment_macs(model: nn.Module, sample: torch.Tensor) -> List[int]:
    """Multiply-accumulates of each segment of ``model`` on ``sample`` (conv and linear layers)."""
    count = [0]

    def hook(mod: nn.Module, args: Tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        if isinstance(mod, nn.Conv2d):
            count[0] += out.numel() * (mod.in_channels // mod.groups) * mod.kernel_size[0] * mod.kernel_size[1]
        else:
            count[0] += out.numel() * mod.in_features

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    points = [name for name, _ in model_segments(model)[:-1]]
    was_training = model.training
    macs = []
    try:
        model.eval()  # one sample; and no running-stat updates
        with torch.no_grad():
            x = sample
            for stage in stages(model, points):
                count[0] = 0
                x = stage(x)
                macs.append(count[0])
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return macs


def balanced_split_points(model: nn.Module, n_stages: int, sample: torch.Tensor) -> List[str]:
    """Split points cutting ``model`` into ``n_stages`` stages with the most even compute.

    Cost of a segment: its convolutions' and linear layers' multiply-accumulates on ``sample``
    (one input row on the model's device). Minimises the largest stage's cost over all
    contiguous partitions of the segments (:func:`shardfc.parallel.partition.linear_partition`).
    """
    _check_int("n_stages", n_stages, 1)
    decl = model_segments(model)
    if n_stages > len(decl):
        raise ValueError(
            f"n_stages={n_stages} but {type(model).__name__} has only {len(decl)} segments "
            f"({', '.join(n for n, _ in decl)}) to spread over them"
        )
    cost = _segment_macs(model, sample)
    return [decl[c][0] for c in linear_partition(cost, n_stages)]


def _sync(devices: Sequence[torch.device]) -> None:
    for d in dict.fromkeys(devices):
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def _time_steps(net: nn.Module, params: nn.Module, x: torch.Tensor, devices: Sequence[torch.device], steps: int, warmup: int) -> List[float]:
    times = []
    for step in range(warmup + steps):
        for p in params.parameters():
            p.grad = None
        _sync(devices)
        start = time.perf_counter()
        net(x).float().square().mean().backward()
        _sync(devices)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return times


def time_split_sweep(
    model_name: str,
    batch: int,
    image_size: Optional[Union[int, Tuple[int, int]]],
    devices: Sequence[Union[str, torch.device]],
    split_sizes: Sequence[int],
    steps: int,
    *,
    split_points: Optional[Sequence[str]] = None,
    warmup: int = 1,
    embedding_dim: int = 512,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    train: bool = True,
) -> List[Dict[str, Any]]:
    """Forward + backward times of ``model_name`` single, split over ``devices``, and pipelined.

    Returns one row (a dict with keys :data:`FIELDS`) for ``single``, one for ``split`` and one
    per ``split_sizes`` entry for ``pipelined``, in that order. ``image_size`` is ``H`` (square),
    ``(H, W)``, or ``None`` for the backbone's default (``tiny`` is built for the size given; the
    face backbones accept only their own). ``split_points`` defaults to
    :func:`balanced_split_points` for ``len(devices)`` stages. ``warmup`` untimed steps precede
    each configuration's ``steps`` timed ones. ``train=False`` times in eval mode.
    """
    _check_int("batch", batch, 1)
    if train and batch == 1:
        raise ValueError("batch=1: the backbone's BatchNorm1d cannot normalise 1 row in training mode; pass train=False")
    _check_int("steps", steps, 1)
    _check_int("warmup", warmup, 0)
    if isinstance(split_sizes, (int, str)):
        raise ValueError(f"split_sizes must be a sequence of positive ints, got {split_sizes!r}")
    sizes = [check_split_size(s) for s in split_sizes]
    for size in sizes:
        if train and (size == 1 or batch % size == 1):
            raise ValueError(
                f"split_size={size} leaves a 1-row micro-batch (batch={batch}), which the backbone's "
                "BatchNorm1d cannot normalise in training mode; pick another or pass train=False"
            )
    if isinstance(devices, (str, torch.device)):
        raise ValueError(f"devices must be a sequence, one device per stage, got {devices!r}")
    devs = check_devices(devices, len(devices), "len(devices)")
    if image_size is None:
        hw = input_size(model_name)
    elif isinstance(image_size, int):
        hw = (image_size, image_size)
    else:
        hw = (int(image_size[0]), int(image_size[1]))
    kwargs: Dict[str, Any] = {"input_size": hw} if model_name == "tiny" else {}

    torch.manual_seed(seed)
    model = build_backbone(model_name, embedding_dim=embedding_dim, **kwargs).to(devs[0], dtype).train(train)
    x = torch.randn(batch, 3, *hw, device=devs[0], dtype=dtype)
    if split_points is None:
        points = balanced_split_points(model, len(devs), x[:1])
    else:
        points = list(split_points)

    base = {"model": model_name, "batch": batch, "image_size": list(hw), "steps": steps}

    def row(config: str, split_size: Optional[int], used: Sequence[torch.device], cut: Sequence[str], times: List[float]) -> Dict[str, Any]:
        median = statistics.median(times)
        values = dict(
            base,
            config=config,
            split_size=split_size,
            devices=[str(d) for d in used],
            split_points=list(cut),
            times_s=times,
            median_s=median,
            mean_s=statistics.fmean(times),
            min_s=min(times),
            samples_per_s=batch / median if median > 0 else float("inf"),
        )
        return {k: values[k] for k in FIELDS}

    rows = [row("single", None, devs[:1], [], _time_steps(model, model, x, devs[:1], steps, warmup))]
    split = split_model(model, devs, points)
    rows.append(row("split", None, devs, points, _time_steps(split, model, x, devs, steps, warmup)))
    for size in sizes:
        piped = PipelinedModel(split, size, allow_micro_batch_stats=True)
        rows.append(row("pipelined", size, devs, points, _time_steps(piped, model, x, devs, steps, warmup)))
    return rows
