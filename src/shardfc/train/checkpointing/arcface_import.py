"""Importing an insightface ``arcface_torch`` run into a shardfc checkpoint.

arcface_torch writes:

* the backbone as a plain state dict (``model.pt``, the released ``backbone.pth``), with the
  parameter names of its ``iresnet*``, ``mbf`` or ``mbf_large`` (shardfc's backbones of those
  names use the same names and shapes; a ``module.`` prefix left by DataParallel/DDP is dropped);
* per GPU ``checkpoint_gpu_<rank>.pt`` (PartialFC_V2, ``save_all_states``): a dict with
  ``state_dict_backbone``, ``state_dict_softmax_fc`` (``{"weight": [n_rank, D]}``),
  ``state_optimizer`` (its FC weight is the last parameter), ``epoch`` and ``global_step``;
* or, with the older PartialFC, ``rank_<rank>_softmax_weight.pt`` (the weight rows as a tensor)
  beside ``rank_<rank>_softmax_weight_mom.pt`` (their SGD momentum).

Rank ``r`` of ``W`` holds classes ``[start, start + n)`` with ``n = C // W + (r < C % W)`` and
``start = (C // W) * r + min(r, C % W)``; each shard is checked against that split. The shards are
joined in class order into one head saved as a world of one: shardfc checkpoints are read by
class range, so ``shardfc train --resume`` continues on any number of processes. Foreign files are
read with ``torch.load(weights_only=True)`` (no code runs); ``trust_pickle`` opts out.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from shardfc import checkpoint as ckpt
from shardfc.checkpoint.weights_only import load_pt
from shardfc.models import build_backbone
from shardfc.train.checkpointing.resume import checkpoint_root, fingerprint
from shardfc.train.config import MAX_EMBEDDING_DIM, TrainConfig

__all__ = ["arcface_class_range", "load_arcface_backbone", "ArcfaceHead", "read_arcface_head", "import_arcface"]

logger = logging.getLogger("shardfc.train")


def arcface_class_range(num_classes: int, world_size: int, rank: int) -> Tuple[int, int]:
    """``(start, stop)`` of the classes arcface_torch's PartialFC gives ``rank`` of ``world_size``."""
    base, extra = divmod(num_classes, world_size)
    start = base * rank + min(rank, extra)
    return start, start + base + int(rank < extra)


def _load(path: Path, trust_pickle: bool) -> Any:
    if not os.path.lexists(path):
        raise FileNotFoundError(f"arcface_torch file not found: {str(path)!r}")
    # load_pt holds the gate's rule (a regular file; a FIFO or /dev/zero is one line; a link is
    # followed: the user named the file) and reads weights only, its zip records checked stored
    # before torch inflates anything.
    return load_pt(path, "cpu", trust_pickle=trust_pickle, meta={})


def _strip_prefix(state: Mapping[str, Any]) -> Dict[str, Any]:
    return {k[len("module."):] if k.startswith("module.") else k: v for k, v in state.items()}


def load_arcface_backbone(
    path: "str | Path", backbone: str, embedding_dim: int = 512, *, trust_pickle: bool = False, **kwargs: Any
) -> Tuple[torch.nn.Module, Dict[str, torch.Tensor]]:
    """shardfc backbone ``backbone`` with the weights of an arcface_torch backbone file (a state
    dict, or a ``checkpoint_gpu_*.pt`` holding ``state_dict_backbone``): ``(model, state dict)``.

    Raises:
        ValueError: names or shapes do not match (the first differences named).
    """
    path = Path(path)
    obj = _load(path, trust_pickle)
    if isinstance(obj, Mapping) and "state_dict_backbone" in obj:
        obj = obj["state_dict_backbone"]
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{path} is not a backbone state dict (a mapping of parameter names to tensors)")
    state = _strip_prefix(obj)
    model = build_backbone(backbone, embedding_dim, **kwargs)
    mine = model.state_dict()
    missing = [k for k in mine if k not in state]
    unexpected = [k for k in state if k not in mine]
    shapes = [f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in mine.items()
              if k in state and tuple(state[k].shape) != tuple(v.shape)]
    if missing or unexpected or shapes:
        parts = [f"{label} ({len(items)}): {', '.join(items[:5])}{' ...' if len(items) > 5 else ''}"
                 for label, items in (("missing", missing), ("unexpected", unexpected), ("shape", shapes)) if items]
        raise ValueError(
            f"{path} does not fit shardfc's {backbone} with embedding_dim={embedding_dim}: " + "; ".join(parts)
        )
    state = {k: state[k].to(v.dtype) for k, v in mine.items()}
    model.load_state_dict(state)
    return model, state


@dataclass
class ArcfaceHead:
    """The class centres of an arcface_torch run, joined in class order."""

    weight: torch.Tensor
    """``[C, D]``."""
    momentum: Optional[torch.Tensor]
    """SGD momentum ``[C, D]`` when every shard had it, else None."""
    world_size: int
    epoch: int = 0
    global_step: int = 0
    notes: List[str] = field(default_factory=list)


_RANK_RE = re.compile(r"(?:checkpoint_gpu_|rank_|softmax_weight_)(\d+)")


def _rank_of(path: Path) -> int:
    m = _RANK_RE.search(path.name)
    if not m:
        raise ValueError(f"cannot tell the rank of {path.name!r}: expected checkpoint_gpu_<r>.pt or rank_<r>_softmax_weight.pt")
    return int(m.group(1))


def _v2_shard(obj: Mapping[str, Any], path: Path) -> Tuple[torch.Tensor, Optional[torch.Tensor], List[str]]:
    fc = obj["state_dict_softmax_fc"]
    if not isinstance(fc, Mapping) or not isinstance(fc.get("weight"), torch.Tensor):
        raise ValueError(f"{path}: state_dict_softmax_fc holds no 'weight' tensor")
    weight, notes = fc["weight"], []
    opt = obj.get("state_optimizer")
    momentum = None
    if isinstance(opt, Mapping) and opt.get("param_groups"):
        try:  # an optimizer's state_dict: arcface_torch puts the FC weight last
            index = opt["param_groups"][-1]["params"][-1]
            state = opt.get("state", {}).get(index, {})
            if not isinstance(state, Mapping):
                raise TypeError
        except (KeyError, IndexError, TypeError, AttributeError):
            raise ValueError(f"{path}: state_optimizer is not an optimizer's state_dict (param_groups[-1]['params'][-1] "
                             "should name the FC weight's entry of state)") from None
        if isinstance(state.get("momentum_buffer"), torch.Tensor) and state["momentum_buffer"].shape == weight.shape:
            momentum = state["momentum_buffer"]
        elif "exp_avg" in state:
            notes.append("AdamW moments of the FC are not imported (they restart at zero)")
    return weight, momentum, notes


def _count(obj: Mapping[str, Any], key: str, path: Path) -> int:
    """``obj[key]`` (0 when absent), an ``int >= 0`` as arcface_torch saves its epoch and step."""
    value = obj.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{path}: {key} must be an int >= 0, got {value!r}")
    return value


def read_arcface_head(paths: Sequence["str | Path"], *, trust_pickle: bool = False) -> ArcfaceHead:
    """Read and join the per-rank FC shards ``paths`` (any order; ranks ``0..W-1`` all present)."""
    by_rank: Dict[int, Path] = {}
    for p in map(Path, paths):
        r = _rank_of(p)
        if r in by_rank:
            raise ValueError(f"two head files for rank {r}: {by_rank[r].name} and {p.name}")
        by_rank[r] = p
    if not by_rank:
        raise ValueError("no head files given")
    world = len(by_rank)
    if sorted(by_rank) != list(range(world)):
        raise ValueError(f"head files must cover ranks 0..{world - 1}, got ranks {sorted(by_rank)}")
    weights, moms, notes, steps = [], [], [], set()
    for r in range(world):
        path = by_rank[r]
        obj = _load(path, trust_pickle)
        if isinstance(obj, Mapping) and "state_dict_softmax_fc" in obj:
            weight, mom, shard_notes = _v2_shard(obj, path)
            notes += shard_notes
            steps.add((_count(obj, "epoch", path), _count(obj, "global_step", path)))
        elif isinstance(obj, torch.Tensor):
            weight = obj
            mom_path = path.with_name(path.name.replace("softmax_weight", "softmax_weight_mom"))
            mom = _load(mom_path, trust_pickle) if mom_path != path and os.path.lexists(mom_path) else None
        else:
            raise ValueError(f"{path} is neither an arcface_torch checkpoint_gpu_<r>.pt nor a softmax weight tensor")
        if weight.dim() != 2:
            raise ValueError(f"{path}: the FC weight must be [classes, embedding_dim], got shape {tuple(weight.shape)}")
        weights.append(weight.float())
        moms.append(mom.float() if isinstance(mom, torch.Tensor) and mom.shape == weight.shape else None)
    dims = {w.shape[1] for w in weights}
    if len(dims) != 1:
        raise ValueError(f"the head shards have different embedding sizes: {sorted(dims)}")
    num_classes = sum(w.shape[0] for w in weights)
    for r, w in enumerate(weights):
        start, stop = arcface_class_range(num_classes, world, r)
        if w.shape[0] != stop - start:
            raise ValueError(
                f"{by_rank[r].name} holds {w.shape[0]} classes, but arcface_torch gives rank {r} of {world} "
                f"{stop - start} of {num_classes} classes: files of another run or a missing rank?"
            )
    if len(steps) > 1:
        raise ValueError(f"the head files were saved at different (epoch, step): {sorted(steps)}")
    epoch, step = steps.pop() if steps else (0, 0)
    momentum = torch.cat(moms) if all(m is not None for m in moms) else None
    return ArcfaceHead(torch.cat(weights), momentum, world, epoch, step, sorted(set(notes)))


def _physical_memory() -> Optional[int]:
    """Bytes of this machine's memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def import_arcface(
    out_dir: "str | Path",
    backbone_path: "str | Path",
    backbone: str,
    head_paths: Sequence["str | Path"] = (),
    *,
    num_classes: Optional[int] = None,
    embedding_dim: Optional[int] = None,
    optimizer: str = "sgd",
    seed: int = 0,
    trust_pickle: bool = False,
    **backbone_kwargs: Any,
) -> Tuple[Path, Optional[ArcfaceHead]]:
    """Write ``<out_dir>/checkpoints/step_<global_step>``: the backbone and the joined head (or,
    without ``head_paths``, ``num_classes`` fresh centres drawn as arcface_torch draws them,
    N(0, 0.01), for fine-tuning a released backbone). Backbone optimizer, schedule and scaler are
    absent: ``shardfc train --resume`` starts them fresh at the imported step.
    """
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise ValueError(f"--out {str(out_dir)!r} is a file; name the folder to create the run in")
    if embedding_dim is not None and not 1 <= embedding_dim <= MAX_EMBEDDING_DIM:
        raise ValueError(f"--embedding-dim must be in [1, {MAX_EMBEDDING_DIM}], got {embedding_dim}")
    existing = ckpt.find_checkpoints(checkpoint_root(TrainConfig(output_dir=str(out_dir))))
    if existing:
        raise ValueError(f"{out_dir} already holds checkpoints (newest: {existing[-1].name}); import into a new folder")
    head = read_arcface_head(head_paths, trust_pickle=trust_pickle) if head_paths else None
    if head is not None:
        if num_classes is not None and num_classes != head.weight.shape[0]:
            raise ValueError(f"--num-classes {num_classes} but the head files hold {head.weight.shape[0]} classes")
        if embedding_dim is not None and embedding_dim != head.weight.shape[1]:
            raise ValueError(f"--embedding-dim {embedding_dim} but the head files hold {head.weight.shape[1]}-d centres")
        num_classes, embedding_dim = head.weight.shape
    elif num_classes is None or num_classes < 1:
        raise ValueError(f"without --head, --num-classes must be a positive int (the classes to fine-tune on), got {num_classes!r}")
    embedding_dim = 512 if embedding_dim is None else embedding_dim
    if head is None:  # drawn whole in this process's memory: more than the machine has would fail in the allocator
        need, have = num_classes * embedding_dim * 4, _physical_memory()
        if have is not None and need > have:
            raise ValueError(f"--num-classes {num_classes} x --embedding-dim {embedding_dim}: the fresh head's "
                             f"{need / 2**30:,.1f} GiB of float32 centres exceed this machine's {have / 2**30:,.1f} GiB of memory")
    model, state = load_arcface_backbone(backbone_path, backbone, embedding_dim, trust_pickle=trust_pickle, **backbone_kwargs)
    size = tuple(model.input_size)  # every backbone states the input size it was built for
    if head is None:
        weight = torch.normal(0.0, 0.01, (num_classes, embedding_dim), generator=torch.Generator().manual_seed(seed))
        tensors = {"weight": weight}
    else:
        tensors = {"weight": head.weight}
        if head.momentum is not None and optimizer == "sgd":
            tensors["optimizer.momentum_buffer"] = head.momentum
    cfg = TrainConfig(backbone=backbone, embedding_dim=embedding_dim, optimizer=optimizer, output_dir=str(out_dir))
    step, epoch = (head.global_step, head.epoch) if head is not None else (0, 0)
    common = {
        "backbone": state,
        "state": {"step": step, "epoch": epoch, "batch_in_epoch": 0, "batches_per_epoch": 0, "samples_seen": 0},
        "world_size": head.world_size if head is not None else 1,
        "batch_size": None,
        "config_json": json.dumps({"backbone": backbone, "embedding_dim": embedding_dim, "optimizer": optimizer}),
        "imported_from": "arcface_torch",
    }
    path = ckpt.save_checkpoint(
        checkpoint_root(cfg), step, common=common, per_rank=None, head_tensors=tensors,
        head_extras={"sample_step": 0}, class_range=range(num_classes), num_classes=num_classes,
        fingerprint=fingerprint(cfg, num_classes, size),
    )
    return path, head
