"""A backbone saved in parts, one file per pipeline stage, read back by the keys a layout needs.

A pipeline run holds its backbone split over ranks: stage ``i``'s ranks hold some of the unsplit
model's state-dict entries and their parameters' optimizer state. A per-stage save writes each
stage's share as ``backbone_stage<i>.pt``, in the unsplit model's names::

    {"model": {state-dict key: Tensor},
     "optimizer": {"state": {parameter name: {...}},
                   "param_groups": [{"lr": ..., ..., "params": [parameter names]}]}}

The stage's replica 0 writes it; its other replicas hold the same parameters and optimizer state
(their gradients are averaged) and only contribute a digest of them, which must equal replica
0's before anything is published (their BatchNorm statistics, of their own data, may differ and
are not compared: replica 0's are saved, as a ddp run saves rank 0's). ``meta.json`` records which
keys and parameters each file holds (``backbone_stages``, see :mod:`~shardfc.checkpoint.format`).

A reader names the keys and parameters it needs (its stage's, or all of them for an unsplit
model) and :func:`read_stage_state` reads only the files holding some of them, memory-mapped, so
that only the tensors it takes are paged in: a checkpoint moves between any stage count and ddp
by reading slices, never by gathering on one rank. The optimizer state is keyed by parameter
name, not index: :func:`optimizer_by_name` and :func:`optimizer_by_index` convert to and from a
torch optimizer's ``state_dict``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from shardfc.checkpoint.format import CheckpointError, stage_file
from shardfc.checkpoint.load import load_file, objects_equal
from shardfc.checkpoint.validation import check_str_keys, compact_cpu
from shardfc.checkpoint.weights_only import check_plain
from shardfc.checks import check_int

__all__ = [
    "StagePart",
    "optimizer_by_index",
    "optimizer_by_name",
    "read_stage_state",
    "stage_file",
]


@dataclass
class StagePart:
    """One stage's share of a model, as a rank passes it to :func:`~shardfc.checkpoint.save_checkpoint`."""

    index: int
    """The stage: names the file ``backbone_stage<index>.pt``."""
    model: Mapping[str, torch.Tensor]
    """The stage's state-dict entries, under the unsplit model's keys."""
    optimizer: Mapping[str, Any]
    """The stage's optimizer state by parameter name (:func:`optimizer_by_name`)."""
    all_keys: Sequence[str]
    """Every state-dict key of the unsplit model, in its order."""
    all_params: Sequence[str]
    """Every trainable parameter of the unsplit model, in its optimizer's order."""
    writes: bool = True
    """False: a replica of a stage another rank writes; its digest is compared with the writer's."""


def optimizer_by_name(state_dict: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """A torch optimizer's ``state_dict`` over parameters ``names`` (in its order), keyed by name."""
    return {
        "state": {names[i]: s for i, s in state_dict["state"].items()},
        "param_groups": [dict(g, params=[names[i] for i in g["params"]]) for g in state_dict["param_groups"]],
    }


def optimizer_by_index(by_name: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The ``state_dict`` of an optimizer over parameters ``names`` (in its order, in the groups
    ``by_name`` records) from a by-name state, e.g. :func:`read_stage_state`'s: the inverse of
    :func:`optimizer_by_name`, for any subset or superset of a saved stage's parameters."""
    index = {n: i for i, n in enumerate(names)}
    grouped = [n for g in by_name["param_groups"] for n in g["params"] if n in index]
    if sorted(grouped) != sorted(names):
        missing = sorted(set(names) - set(grouped))
        raise CheckpointError(f"the saved optimizer state has no parameter group for {missing[:5]}")
    groups = [dict(g, params=sorted(index[n] for n in g["params"] if n in index)) for g in by_name["param_groups"]]
    state = {index[n]: s for n, s in by_name["state"].items() if n in index}
    return {"state": dict(sorted(state.items())), "param_groups": [g for g in groups if g["params"]]}


# --------------------------------------------------------------------------- saving


def prepare_part(part: Any, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(description, payload)`` of a rank's :class:`StagePart`: checked, tensors compact on the CPU,
    and the digest of what the stage's replicas must agree on."""
    if not isinstance(part, StagePart):
        raise ValueError(f"{where} must be a StagePart, got {type(part).__name__}")
    check_int(f"{where}.index", part.index, 0)
    model = check_str_keys(f"{where}.model", part.model)
    for key, t in model.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{where}.model[{key!r}] must be a torch.Tensor, got {type(t).__name__}")
    optimizer = check_str_keys(f"{where}.optimizer", part.optimizer)
    if set(optimizer) != {"state", "param_groups"}:
        raise ValueError(f"{where}.optimizer must have the keys 'state' and 'param_groups', got {sorted(optimizer)}")
    check_plain(f"{where}.optimizer", optimizer)
    params = [n for g in optimizer["param_groups"] for n in g["params"]]
    outside = sorted(set(params) - set(model)) + sorted(set(optimizer["state"]) - set(params))
    if outside:
        raise ValueError(f"{where}.optimizer names parameters that are not the stage's: {outside[:5]}")
    unknown = sorted(set(model) - set(part.all_keys)) + sorted(set(params) - set(part.all_params))
    if unknown:
        raise ValueError(f"{where} holds keys the whole model does not have: {unknown[:5]}")
    payload = {"model": {k: compact_cpu(t) for k, t in model.items()}, "optimizer": _cpu(optimizer)}
    # What replicas must agree on: the parameters and their optimizer state (not the BN statistics).
    digest = hashlib.sha256()
    _hash(digest, [[n, payload["model"][n]] for n in params])
    _hash(digest, payload["optimizer"])
    info = {
        "index": part.index,
        "writes": bool(part.writes),
        "keys": list(model),
        "params": params,
        "digest": digest.hexdigest(),
        "all_keys": list(part.all_keys),
        "all_params": list(part.all_params),
    }
    return info, payload


def _cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return compact_cpu(value)
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu(v) for v in value)
    return value


def _hash(h: "hashlib._Hash", value: Any) -> None:
    """Feed ``value`` (tensors and plain data) to ``h`` deterministically: dicts by sorted key."""
    if isinstance(value, torch.Tensor):
        h.update(f"T{value.dtype}{tuple(value.shape)}".encode())
        if value.numel():
            h.update(value.contiguous().reshape(-1).view(torch.uint8).numpy())
    elif isinstance(value, Mapping):
        h.update(b"{")
        for k in sorted(value, key=repr):
            h.update(repr(k).encode())
            _hash(h, value[k])
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"[")
        for v in value:
            _hash(h, v)
        h.update(b"]")
    else:
        h.update(repr(value).encode())


def check_parts(infos: Sequence[Optional[Sequence[dict[str, Any]]]]) -> Optional[dict[str, Any]]:
    """Every rank's part descriptions (``infos[rank]``, None or [] for a rank with none) checked
    together, identically on every rank; returns ``meta.json``'s ``backbone_stages`` (None: no parts).

    Raises:
        ValueError: The parts do not describe one model: a stage written twice or never, replicas
            that differ, keys or parameters held by two stages or by none.
    """
    parts = [(rank, p) for rank, ps in enumerate(infos) for p in (ps or [])]
    if not parts:
        return None
    first = parts[0][1]
    for rank, p in parts:
        if p["all_keys"] != first["all_keys"] or p["all_params"] != first["all_params"]:
            raise ValueError(f"rank {rank}'s stage part describes another model than rank {parts[0][0]}'s")
    writers: dict[int, tuple[int, dict[str, Any]]] = {}
    for rank, p in parts:
        if p["writes"]:
            if p["index"] in writers:
                raise ValueError(f"stage {p['index']} is written by ranks {writers[p['index']][0]} and {rank}")
            writers[p["index"]] = (rank, p)
    for rank, p in parts:
        if p["index"] not in writers:
            raise ValueError(f"stage {p['index']} (rank {rank}) is written by no rank")
        writer, saved = writers[p["index"]]
        if p["digest"] != saved["digest"] or p["keys"] != saved["keys"]:
            raise ValueError(
                f"rank {rank} and rank {writer} hold stage {p['index']} with different parameters or optimizer "
                "state: its replicas have diverged, so no checkpoint of it is written"
            )
    if sorted(writers) != list(range(len(writers))):
        raise ValueError(f"the stages saved are {sorted(writers)}; expected 0 to {len(writers) - 1}")
    for what in ("keys", "params"):
        held = [n for i in sorted(writers) for n in writers[i][1][what]]
        if sorted(held) != sorted(first[f"all_{what}"]):
            twice = sorted({n for n in held if held.count(n) > 1})
            none = sorted(set(first[f"all_{what}"]) - set(held))
            raise ValueError(f"the stages' {what} do not tile the model's: held twice {twice[:5]}, by none {none[:5]}")
    return {
        "keys": first["all_keys"],
        "params": first["all_params"],
        "files": {stage_file(i): {"keys": p["keys"], "params": p["params"]} for i, (_, p) in sorted(writers.items())},
    }


# --------------------------------------------------------------------------- loading


def read_stage_state(
    path: str | os.PathLike[str],
    meta: Mapping[str, Any],
    keys: Optional[Sequence[str]] = None,
    params: Optional[Sequence[str]] = None,
    *,
    verify: bool = True,
    trust_pickle: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(state-dict entries, optimizer state by name)`` of ``keys`` and ``params`` (None: all)
    from a per-stage checkpoint, reading only the files that hold some of them (memory-mapped).

    The entries come in the unsplit model's order, as CPU tensors backed by the mapped files
    (copy them, e.g. with ``load_state_dict``, and drop them to release the mapping).

    Raises:
        CheckpointError: The checkpoint has no per-stage backbone, lacks a key or parameter asked
            for, or a file is missing, corrupt or does not hold what ``meta.json`` says.
    """
    path = Path(path)
    stages = meta.get("backbone_stages")
    if stages is None:
        raise CheckpointError(f"{path} holds no per-stage backbone (its common.pt holds it whole)")
    want_keys = set(stages["keys"] if keys is None else keys)
    want_params = set(stages["params"] if params is None else params)
    unknown = sorted(want_keys - set(stages["keys"])) + sorted(want_params - set(stages["params"]))
    if unknown:
        raise CheckpointError(f"the backbone saved in {path} has no {unknown[:5]} (another architecture?)")
    model: dict[str, torch.Tensor] = {}
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for fname, entry in stages["files"].items():
        if want_keys.isdisjoint(entry["keys"]) and want_params.isdisjoint(entry["params"]):
            continue  # another stage's file: not even opened
        part = load_file(path, fname, meta, "cpu", verify, trust_pickle, mmap=True)
        if not (isinstance(part, dict) and set(part) == {"model", "optimizer"} and isinstance(part["model"], dict)
                and list(part["model"]) == list(entry["keys"])
                and all(isinstance(t, torch.Tensor) for t in part["model"].values())
                and _optimizer_shaped(part["optimizer"])):
            raise CheckpointError(f"{path / fname} does not hold the stage part meta.json describes")
        model.update((k, part["model"][k]) for k in entry["keys"] if k in want_keys)
        saved = part["optimizer"]
        state.update((n, s) for n, s in saved["state"].items() if n in want_params)
        _merge_groups(groups, saved["param_groups"], want_params, path / fname)
    missing = sorted(want_keys - set(model))
    if missing:
        raise CheckpointError(f"{path}'s stage files hold no {missing[:5]}")
    ordered = {k: model[k] for k in stages["keys"] if k in model}
    return ordered, {"state": state, "param_groups": groups}


def _optimizer_shaped(saved: Any) -> bool:
    """Whether ``saved`` has the shape of an optimizer state by name (what :func:`_merge_groups` reads)."""
    return (isinstance(saved, dict) and isinstance(saved.get("state"), dict)
            and isinstance(saved.get("param_groups"), list)
            and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in saved["param_groups"]))


def _merge_groups(groups: list[dict[str, Any]], saved: list[dict[str, Any]], wanted: set, where: Path) -> None:
    """Group ``j`` of the whole optimizer: every stage's group ``j``, the same hyperparameters."""
    if groups and len(saved) != len(groups):
        raise CheckpointError(f"{where} has {len(saved)} parameter groups, another stage file {len(groups)}")
    for j, g in enumerate(saved):
        mine = [n for n in g["params"] if n in wanted]
        if j == len(groups):
            groups.append(dict(g, params=mine))
            continue
        if not objects_equal({k: v for k, v in g.items() if k != "params"},
                             {k: v for k, v in groups[j].items() if k != "params"}, f"the parameter groups of {where}"):
            raise CheckpointError(f"{where}'s parameter group {j} has other hyperparameters than another stage's")
        groups[j]["params"] += mine
