"""Reading a trained backbone back from a run: what ``shardfc eval``, ``export`` and ``embed`` share."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch
from torch import nn

from shardfc import checkpoint as ckpt
from shardfc.checkpoint.format import short_repr
from shardfc.data import IMG_EXTENSIONS
from shardfc.models import build_backbone
from shardfc.train.config import ConfigError, TrainConfig, config_from_mapping

__all__ = ["add_checkpoint_args", "TrainedBackbone", "resolve_checkpoint", "saved_config", "load_backbone",
           "load_stages_streaming", "list_images", "pick_device"]

def add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    """``--checkpoint`` and ``--trust-checkpoint``, as every command that reads a trained run takes them."""
    p.add_argument("--checkpoint", required=True, metavar="PATH", help="a checkpoint folder, or a run folder (its newest checkpoint)")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="load a checkpoint whose files need full unpickling (written by shardfc before checkpoint format 2, "
                        "or not by shardfc): unpickling can run arbitrary code, so only for checkpoints you trust")


def resolve_checkpoint(path: "str | os.PathLike[str]") -> Path:
    """A checkpoint folder from ``path``: the folder itself, or the newest complete one in a run
    folder (``<run>/checkpoints``) or a checkpoint root."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"--checkpoint {str(path)!r} does not exist")
    found = ckpt.checkpoint_at(p, check_hashes=False)
    if found is not None:
        return found
    raise FileNotFoundError(f"--checkpoint {str(path)!r} is neither a checkpoint nor a folder holding complete ones")


@dataclass
class TrainedBackbone:
    """A backbone read back from a checkpoint."""

    model: nn.Module
    """The backbone, in eval mode."""
    config: TrainConfig
    """The configuration of the run that saved it."""
    image_size: Tuple[int, int]
    """Input ``(H, W)`` it was trained at."""
    path: Path
    """The checkpoint folder."""


def saved_config(common: Dict[str, Any], where: Path) -> TrainConfig:
    """The :class:`TrainConfig` a run stored in its ``common.pt`` (JSON text; a dict in format 1).

    Fields this shardfc does not know are dropped, missing ones take their defaults; the result is
    validated by the rules of the command line (:meth:`TrainConfig.validate`), before anything is built.

    Raises:
        CheckpointError: no config, or one that is not JSON of a dict, of the wrong types or invalid,
            naming ``common.pt`` and the field.
    """
    source = where / ckpt.COMMON_FILE
    raw = None
    if isinstance(common.get("config_json"), str):
        try:
            raw = json.loads(common["config_json"])
        except (ValueError, RecursionError) as e:
            raise ckpt.CheckpointError(f"{source}: its config_json is not JSON ({str(e)[:200]})") from None
    elif isinstance(common.get("config"), dict):  # checkpoint format 1
        raw = common["config"]
    if raw is None:
        raise ckpt.CheckpointError(f"{where} was not saved by 'shardfc train' (no config in common.pt)")
    if not isinstance(raw, dict):
        raise ckpt.CheckpointError(f"{source}: its config is a {type(raw).__name__}, not a dict of fields")
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    for key, value in raw.items():
        if key in known and not _flag_value(value):
            raise ckpt.CheckpointError(f"{source}: the saved config's {key!r} is {short_repr(value)}, not a value "
                                       "a flag takes")
    try:
        cfg = config_from_mapping({k: v for k, v in raw.items() if k in known}, source=str(source))
        check_saved_config(cfg)
    except ConfigError as e:
        raise ckpt.CheckpointError(f"{source}: the saved config is invalid: {e}") from None
    return cfg


_SCALARS = (str, int, float, bool, type(None))


def _flag_value(value: Any) -> bool:
    """Whether ``value`` is what a config field holds (a scalar, or a short list of them): anything
    else is refused before a message could quote it (a crafted structure's repr has no end)."""
    if isinstance(value, (list, tuple)):
        return len(value) <= 1024 and all(type(v) in _SCALARS for v in value)
    return type(value) in _SCALARS


def check_saved_config(cfg: TrainConfig) -> None:
    """:meth:`TrainConfig.validate` of a saved config, on a copy whose loader is 'torch': a checkpoint
    is read without its training data, so whether its data loader is installed here does not matter;
    nor its evaluation targets' plan (``shardfc eval`` checks the targets it builds; ``embed`` and
    ``export`` need none)."""
    dataclasses.replace(cfg, loader="torch").validate(evaluations=False)


def _input_size(meta: Dict[str, Any], folder: Path) -> Tuple[int, int]:
    """The ``(H, W)`` a checkpoint records, checked by the rule of ``--image-size``."""
    size = meta["fingerprint"].get("image_size")
    try:
        if not (isinstance(size, list) and len(size) == 2 and all(type(v) is int for v in size)):
            raise ConfigError(f"image_size must be two ints 'H W', got {short_repr(size)}")
        dataclasses.replace(TrainConfig(), image_size=list(size)).validate()
    except ConfigError as e:
        raise ckpt.CheckpointError(f"{folder / ckpt.META_FILE}: the recorded input size is invalid: {e}") from None
    return size[0], size[1]


def load_backbone(
    path: "str | os.PathLike[str]", device: "str | torch.device" = "cpu", *, trust_pickle: bool = False
) -> TrainedBackbone:
    """The backbone of a checkpoint (a checkpoint folder or a run folder: see :func:`resolve_checkpoint`).

    Only the replicated part (``common.pt``, hash-checked) is read: the head shards, which can
    be gigabytes, are not needed for inference; a pipeline run's backbone is assembled from its
    stage files one at a time (:func:`load_stages_streaming`). ``trust_pickle``: read a ``common.pt`` that needs
    full unpickling (``--trust-checkpoint``; see :func:`shardfc.checkpoint.load_checkpoint`).
    """
    folder = resolve_checkpoint(path)
    common, meta = ckpt.load_common(folder, trust_pickle=trust_pickle)
    if "backbone" not in common and "backbone_stages" not in meta:
        raise ckpt.CheckpointError(f"{folder} was not saved by 'shardfc train' (no backbone in common.pt)")
    cfg = saved_config(common, folder)
    h, w = _input_size(meta, folder)
    from shardfc.train.builder.factory import backbone_kwargs  # build imports the training stack; only needed here

    model = build_backbone(cfg.backbone, cfg.embedding_dim, **backbone_kwargs(cfg, (h, w)))
    if "backbone" in common:
        _load_strict(model, common["backbone"], folder / ckpt.COMMON_FILE)
    else:
        load_stages_streaming(model, folder, meta, trust_pickle=trust_pickle)
    return TrainedBackbone(model.to(device).eval(), cfg, (h, w), folder)


def _load_strict(model: nn.Module, state: Any, where: Path, whole: bool = True) -> None:
    """``model.load_state_dict(state)``: every key of ``state`` the model's, each of its shape, and
    (``whole``) every key of the model in it; a mismatch is a CheckpointError naming the file ``where``."""
    try:
        result = model.load_state_dict(state, strict=whole)
    except (RuntimeError, TypeError, AttributeError, KeyError, ValueError) as e:
        detail = " ".join(str(e).split())
        raise ckpt.CheckpointError(
            f"{where} does not hold the weights of this {type(model).__name__}: "
            f"{detail if len(detail) <= 300 else detail[:297] + '...'}"
        ) from None
    if result.unexpected_keys:
        raise ckpt.CheckpointError(f"{where} holds keys this {type(model).__name__} does not have: "
                                   f"{short_repr(result.unexpected_keys)}")


def load_stages_streaming(model: nn.Module, folder: Path, meta: Dict[str, Any], *, trust_pickle: bool = False) -> None:
    """Fill ``model`` from a per-stage checkpoint (a pipeline run's), one stage file at a time: each is
    memory-mapped, copied into the model and released before the next is opened, so the unsplit model
    is the only whole copy in memory. The weights alone: no optimizer state is read."""
    expected = list(model.state_dict())
    if sorted(meta["backbone_stages"]["keys"]) != sorted(expected):
        raise ckpt.CheckpointError(f"{folder}'s stage files do not hold the keys of a {type(model).__name__}")
    # read_meta checked that the files' keys partition the recorded ones: each file fills its keys
    # (strictly: all of them, each of its shape), and together they fill the whole model.
    filled: set = set()
    for fname, entry in meta["backbone_stages"]["files"].items():
        part, _ = ckpt.read_stage_state(folder, meta, entry["keys"], [], trust_pickle=trust_pickle)
        _load_strict(model, part, folder / fname, whole=False)
        filled.update(part)
        del part  # unmaps the file
    if filled != set(expected):
        raise ckpt.CheckpointError(f"{folder}'s stage files leave {sorted(set(expected) - filled)[:5]} unfilled")


def list_images(folder: "str | os.PathLike[str]") -> List[Path]:
    """Image files under ``folder`` (recursively, sorted); an error if there are none."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"--images {str(folder)!r} does not exist or is not a folder")
    # os.walk follows no link to a folder (a link out of --images, or a loop, is never entered); a
    # link to a file out of it is refused when it is read (decode_image's root).
    files = sorted(
        Path(d) / f for d, _, names in os.walk(root) for f in names
        if Path(f).suffix.lower() in IMG_EXTENSIONS and not f.startswith(".")
    )
    if not files:
        raise ValueError(f"--images {str(folder)!r} holds no images (extensions: {', '.join(sorted(IMG_EXTENSIONS))})")
    return files


def pick_device(name: str) -> torch.device:
    """``--device``: ``auto`` (CUDA when available, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``.

    Anything else is refused by name before a checkpoint is read: torch would otherwise take
    ``meta`` (and fail copying the weights out of it) or raise its own list of a dozen device types.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            raise ConfigError(f"--device {name!r} but CUDA is not available here")
        if device.index is not None and device.index >= count:
            raise ConfigError(f"--device {name!r} but this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
    return device
