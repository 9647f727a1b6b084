"""Rewriting a checkpoint of the shared run as older or foreign files would be: for the weights_only tests."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch


def rewrite_file(path: Path, name: str, obj: Any, format_version: Optional[int] = None, **meta_updates: Any) -> None:
    """Put ``obj`` (pickled as torch.save does) in place of ``path/name`` with ``meta.json`` updated to
    match: sizes and hashes check out, as in a checkpoint someone converted or crafted."""
    torch.save(obj, path / name)
    data = (path / name).read_bytes()
    meta = json.loads((path / "meta.json").read_text())
    meta["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if format_version is not None:
        meta["format_version"] = format_version
    meta.update(meta_updates)
    (path / "meta.json").write_text(json.dumps(meta))


def _v1_name(name: str) -> str:
    return "optimizer.0." + name[len("optimizer."):] if name.startswith("optimizer.") else name


def as_format_1(path: Path) -> None:
    """Rewrite a ``shardfc train`` checkpoint the way format 1 stored it: the config as a dict and the
    head optimizer's param groups in ``common.pt``, optimizer rows named ``optimizer.0.<key>``, and
    Python's and numpy's RNG states as they come (a tuple and a numpy array: pickled objects)."""
    meta = json.loads((path / "meta.json").read_text())
    common = torch.load(path / "common.pt", weights_only=True)
    head0 = torch.load(path / "head_0.pt", weights_only=True)
    common["config"] = json.loads(common.pop("config_json"))
    common["head_optimizer_param_groups"] = head0["extras"]["optimizer.param_groups"]
    for r in range(meta["world_size"]):
        head = torch.load(path / f"head_{r}.pt", weights_only=True)
        head["tensors"] = {_v1_name(k): v for k, v in head["tensors"].items()}
        head["extras"] = {_v1_name(k): v for k, v in head["extras"].items() if k != "optimizer.param_groups"}
        rewrite_file(path, f"head_{r}.pt", head)
        per_rank = torch.load(path / f"rank_{r}.pt", weights_only=True)
        version, internal, gauss = per_rank["rng"]["python"]
        kind, keys, pos, has_gauss, cached = per_rank["rng"]["numpy"]
        per_rank["rng"]["python"] = (version, tuple(internal), gauss)
        per_rank["rng"]["numpy"] = (kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached)
        rewrite_file(path, f"rank_{r}.pt", per_rank)
    rewrite_file(
        path, "common.pt", common, format_version=1,
        head_tensors={_v1_name(k): v for k, v in meta["head_tensors"].items()},
        head_extras=sorted(_v1_name(k) for k in meta["head_extras"] if k != "optimizer.param_groups"),
    )
