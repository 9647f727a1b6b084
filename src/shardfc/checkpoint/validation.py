"""Argument checks of save and load: class ranges, dict keys, fingerprints, head shard tensors, cross-rank agreement."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch


def check_class_range(class_range: Any, num_classes: int) -> range:
    if not isinstance(class_range, range) or class_range.step != 1:
        raise ValueError(f"class_range must be a range with step 1, got {class_range!r}")
    if not 0 <= class_range.start <= class_range.stop <= num_classes:
        raise ValueError(f"class_range={class_range!r} must lie within [0, num_classes={num_classes}]")
    return class_range


def check_str_keys(name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a dict, got {type(value).__name__}")
    bad = [k for k in value if not isinstance(k, str)]
    if bad:
        raise ValueError(f"{name} keys must be str, got {bad[0]!r}")
    return dict(value)


def json_roundtrip(name: str, value: Any) -> Any:
    """Normalise through JSON (tuples -> lists) so saved and live values compare equal."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be JSON-serialisable: {e}") from e


def prepare_head_tensors(head_tensors: Any, rows: int) -> dict[str, torch.Tensor]:
    """Validate shard tensors and make them compact CPU tensors.

    torch.save writes a view's whole storage, so views are copied to store only their rows.
    """
    tensors = check_str_keys("head_tensors", head_tensors)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"head_tensors[{name!r}] must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 1 or t.shape[0] != rows:
            raise ValueError(
                f"head_tensors[{name!r}] has shape {tuple(t.shape)}; its first dim must equal "
                f"len(class_range)={rows}"
            )
        out[name] = compact_cpu(t)
    return out


def compact_cpu(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU, holding its own elements only (torch.save writes a view's whole storage)."""
    t = t.detach()
    if t.device.type != "cpu":
        return t.cpu()
    if not (
        t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    ):
        return t.clone(memory_format=torch.contiguous_format)
    return t


def check_consistency(infos: list[dict[str, Any]]) -> None:
    """Cross-rank checks, run identically on every rank so all ranks raise together."""
    first = infos[0]
    expected_start = 0
    for r, info in enumerate(infos):
        for key in ("step", "num_classes"):
            if info[key] != first[key]:
                raise ValueError(f"{key} differs across ranks: rank 0 has {first[key]!r}, rank {r} has {info[key]!r}")
        start, stop = info["class_range"]
        if start != expected_start:
            raise ValueError(
                f"class ranges must be contiguous in rank order: rank {r} has class_range=range({start}, {stop}) "
                f"but the previous rank ends at {expected_start}"
            )
        expected_start = stop
        if info["specs"] != first["specs"]:
            raise ValueError(
                f"head_tensors differ across ranks: rank 0 has {first['specs']!r}, rank {r} has {info['specs']!r}"
            )
        if info["extras"] != first["extras"]:
            raise ValueError(
                f"head_extras names differ across ranks: rank 0 has {first['extras']!r}, "
                f"rank {r} has {info['extras']!r}"
            )
    if expected_start != first["num_classes"]:
        raise ValueError(
            f"class ranges of all ranks cover [0, {expected_start}) but num_classes={first['num_classes']}"
        )
