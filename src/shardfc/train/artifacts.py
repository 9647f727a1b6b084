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
    if (p / "meta.json").is_file():
        ckpt.verify_checkpoint(p, check_hashes=False)
        return p
    for root in (p / "checkpoints", p):
        found = ckpt.latest_checkpoint(root) if root.is_dir() else None
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

    Fields this shardfc does not know are dropped, missing ones take their defaults.
    """
    if isinstance(common.get("config_json"), str):
        raw = json.loads(common["config_json"])
    elif isinstance(common.get("config"), dict):  # checkpoint format 1
        raw = common["config"]
    else:
        raise ckpt.CheckpointError(f"{where} was not saved by 'shardfc train' (no config in common.pt)")
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    return config_from_mapping({k: v for k, v in raw.items() if k in known}, source=str(where / ckpt.COMMON_FILE))


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
    h, w = meta["fingerprint"]["image_size"]
    from shardfc.train.build import backbone_kwargs  # build imports the training stack; only needed here

    model = build_backbone(cfg.backbone, cfg.embedding_dim, **backbone_kwargs(cfg, (int(h), int(w))))
    if "backbone" in common:
        model.load_state_dict(common["backbone"])
    else:
        load_stages_streaming(model, folder, meta, trust_pickle=trust_pickle)
    return TrainedBackbone(model.to(device).eval(), cfg, (int(h), int(w)), folder)


def load_stages_streaming(model: nn.Module, folder: Path, meta: Dict[str, Any], *, trust_pickle: bool = False) -> None:
    """Fill ``model`` from a per-stage checkpoint (a pipeline run's), one stage file at a time: each is
    memory-mapped, copied into the model and released before the next is opened, so the unsplit model
    is the only whole copy in memory. The weights alone: no optimizer state is read."""
    expected = list(model.state_dict())
    if sorted(meta["backbone_stages"]["keys"]) != sorted(expected):
        raise ckpt.CheckpointError(f"{folder}'s stage files do not hold the keys of a {type(model).__name__}")
    for entry in meta["backbone_stages"]["files"].values():
        part, _ = ckpt.read_stage_state(folder, meta, entry["keys"], [], trust_pickle=trust_pickle)
        model.load_state_dict(part, strict=False)
        del part  # unmaps the file


def list_images(folder: "str | os.PathLike[str]") -> List[Path]:
    """Image files under ``folder`` (recursively, sorted); an error if there are none."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"--images {str(folder)!r} does not exist or is not a folder")
    files = sorted(
        p for p in root.rglob("*")
        if p.is_file() and p.suffix.lower() in IMG_EXTENSIONS and not p.name.startswith(".")
    )
    if not files:
        raise ValueError(f"--images {str(folder)!r} holds no images (extensions: {', '.join(sorted(IMG_EXTENSIONS))})")
    return files


def pick_device(name: str) -> torch.device:
    """``auto``: CUDA when available, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {name!r} but CUDA is not available here")
    return torch.device(name)
