"""Which head row each identity of a run's dataset gets, given the checkpoint it starts from.

A checkpoint records its classes' names (``class_names``: folder names, person ids, label
numbers as text). The run's dataset lists its own. An identity the checkpoint knows keeps its
row; a new one is appended after the checkpoint's ``C`` (ids ``C, C + 1, ...``, in the dataset's
order); the dataset's labels are then mapped to those ids (:class:`~shardfc.data.relabel.RelabelledDataset`),
so a reordered listing changes nothing. Rows never shift silently: an identity the checkpoint
has and the dataset lacks (vanished, or renamed) is an error that names them, unless
``on_missing_classes`` says what to do, or a renames file (``rename_classes``: old name, new name)
gives a renamed identity its old row under its new name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from torch.utils.data import Dataset

from shardfc import checkpoint as ckpt
from shardfc import files
from shardfc.checkpoint.exported import is_torchscript
from shardfc.checkpoint.format import CheckpointError, short_repr
from shardfc.data.relabel import RelabelledDataset
from shardfc.train.config import ConfigError, TrainConfig

__all__ = ["ClassPlan", "plan_classes", "plan_run_classes", "fresh_plan", "read_renames", "rename", "saved_classes",
           "SHOWN"]

#: Offending names an error shows (then a count of the rest).
SHOWN = 5


@dataclass
class ClassPlan:
    """How the run's head relates to the checkpoint's.

    Attributes:
        names: the identity of each class id of the run's head.
        label_map: ``label_map[dataset label]`` = class id, or None when they are equal.
        kept: classes whose rows come from the checkpoint: ids ``0 .. kept - 1`` (0: a fresh head).
        added: names of the classes after ``kept`` (new rows).
        vanished: names the checkpoint has and the dataset lacks (rows kept without images, or dropped).
        note: one line for the log saying what was loaded, new and dropped.
    """

    names: List[str]
    label_map: Optional[np.ndarray]
    kept: int
    added: List[str] = field(default_factory=list)
    vanished: List[str] = field(default_factory=list)
    note: str = ""

    @property
    def num_classes(self) -> int:
        return len(self.names)


def _shown(names: Sequence[str]) -> str:
    head = ", ".join(repr(n) for n in names[:SHOWN])
    return head + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def _check_unique(names: Sequence[str], where: str) -> None:
    if len(set(names)) != len(names):
        seen, dup = set(), []
        for n in names:
            if n in seen:
                dup.append(n)
            seen.add(n)
        raise ConfigError(f"{where} names classes more than once: {_shown(dup)}")


def read_renames(path: "str | Path") -> Dict[str, str]:
    """``{old name: new name}`` from a renames file: one ``old<TAB>new`` per line (a name may hold
    spaces, not tabs); blank lines and lines starting with ``#`` are skipped.

    A name may not be both renamed and a new name (a swap ``A -> B, B -> A``, a cycle or a chain
    ``A -> B, B -> C``): applied again on the next resume, as passing the same file again is meant
    to be harmless, such renames would move the names again while the rows stay, so identities
    would trade rows silently. They are refused; rename through unused names over several runs.

    Raises:
        ConfigError: the file is missing or not a regular file, a line is not two tab-separated
            names, a name is renamed twice, or names chain, swap or cycle (naming the file and the line).
    """
    where = f"rename_classes={str(path)!r}"
    try:  # the gate: a regular file of at most 1 GiB, UTF-8
        text = files.read_text(path, "names", "renames file")
    except files.FileRefused as e:
        raise ConfigError(f"{where}: cannot read it ({e})") from None
    renames: Dict[str, str] = {}
    lines: Dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = line.split("\t")
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise ConfigError(f"{where}, line {number}: expected 'old name<TAB>new name', got {line!r}")
        if parts[0] in renames:
            raise ConfigError(f"{where}, line {number}: {parts[0]!r} is renamed twice")
        renames[parts[0]] = parts[1]
        lines[parts[0]] = lines[parts[1]] = number
    targets = set(renames.values())
    for old, new in renames.items():
        if old in targets or new in renames:
            name = old if old in targets else new
            raise ConfigError(
                f"{where}, line {lines[name]}: {name!r} is both renamed and a new name (a swap, cycle or chain of "
                "renames): passed again on a later resume it would rename again while the rows stay, so identities "
                "would trade rows. Rename in separate runs through names no class has"
            )
    return renames


def rename(saved: Sequence[str], renames: Dict[str, str], source: str = "the checkpoint") -> List[str]:
    """``saved`` class names with ``renames`` applied (each row keeps its place). A rename already
    applied (``source`` has the new name and not the old: a checkpoint of the renaming run) is left
    alone, so the same file may be passed on every later resume.

    Raises:
        ConfigError: a name to rename that ``source`` has under neither name (naming the first few).
    """
    known = set(saved)
    unknown = [old for old, new in renames.items() if old not in known and new not in known]
    if unknown:
        raise ConfigError(f"rename_classes renames {len(unknown)} name(s) {source} does not have: {_shown(unknown)}")
    return [renames.get(n, n) for n in saved]


def fresh_plan(names: List[str], why: str) -> ClassPlan:
    """A new head for classes ``names`` (ids in their order); ``why`` goes into the log's note."""
    return ClassPlan(list(names), None, 0, list(names), note=f"new head of {len(names)} classes ({why})")


def plan_classes(
    saved: Optional[Sequence[str]],
    saved_classes: int,
    dataset: Sequence[str],
    *,
    init: bool,
    on_missing: str = "error",
    source: str = "the checkpoint",
) -> ClassPlan:
    """The run's classes, from the checkpoint's ``saved`` names (None: it recorded none) and
    ``saved_classes`` count, and the dataset's names.

    Args:
        saved: the checkpoint's class names, or None.
        saved_classes: the checkpoint head's class count.
        dataset: the run's dataset's class names, ``dataset[label]``.
        init: ``--init-from`` (a new run: a disjoint class set starts a fresh head) rather than
            ``--resume`` (the run goes on: its rows must be kept).
        on_missing: what to do with checkpoint classes the dataset lacks: ``"error"``; ``"keep"``
            (their rows stay, without images: no id moves); ``"fresh"`` (a new head for the
            dataset's classes: only the backbone is kept).
        source: the checkpoint, as the messages name it.

    Raises:
        ConfigError: vanished identities under ``"error"``, no names where they are needed, or
            names given twice.
    """
    dataset = list(dataset)
    _check_unique(dataset, "the dataset")
    hint = (f"pass --rename-classes FILE for renamed ones (old<TAB>new per line: they keep their rows), "
            f"--on-missing-classes keep to keep their rows (no identity moves), or --on-missing-classes fresh "
            f"to start a new head for this dataset's {len(dataset)} classes (the backbone is kept)")
    if on_missing == "fresh":
        return fresh_plan(dataset, "--on-missing-classes fresh")
    if saved is None:
        if saved_classes == len(dataset):  # as before names were recorded: label y is row y
            return ClassPlan(dataset, None, saved_classes,
                             note=f"{source} records no class names: its {saved_classes} rows are taken as the dataset's "
                                  "labels 0..C-1 in order")
        if init:
            return fresh_plan(dataset, f"{source} records no class names and has {saved_classes} classes")
        raise ConfigError(
            f"{source} records no class names (saved before shardfc recorded them, or imported) and has "
            f"{saved_classes} classes, the dataset {len(dataset)}: which row is which identity cannot be told. "
            "Pass --on-missing-classes fresh to start a new head (the backbone is kept)"
        )
    saved = list(saved)
    if len(saved) != saved_classes:
        raise ConfigError(f"{source} records {len(saved)} class names for {saved_classes} classes")
    _check_unique(saved, source)
    known = set(saved)
    in_data = set(dataset)
    added = [n for n in dataset if n not in known]
    vanished = [n for n in saved if n not in in_data]
    if init and len(vanished) == len(saved):
        return fresh_plan(dataset, f"none of {source}'s {saved_classes} classes is in the dataset: its head is dropped")
    if vanished and on_missing != "keep":
        raise ConfigError(
            f"{len(vanished)} of {source}'s {saved_classes} classes are not in the dataset (vanished or renamed): "
            f"{_shown(vanished)}; rows are never shifted silently: {hint}"
        )
    names = saved + added
    row_of = {n: i for i, n in enumerate(names)}
    label_map = np.fromiter((row_of[n] for n in dataset), dtype=np.int64, count=len(dataset))
    identity = len(names) == len(dataset) and bool((label_map == np.arange(len(dataset))).all())
    note = f"{saved_classes} classes from {source}, {len(added)} new"
    if vanished:
        note += f", {len(vanished)} kept without images ({_shown(vanished)})"
    return ClassPlan(names, None if identity else label_map, saved_classes, added, vanished, note)


def saved_classes(path: Path, trust_pickle: bool) -> Tuple[Optional[list], int, dict]:
    """``(class names or None, class count, common dict)`` of checkpoint ``path``.

    Raises:
        CheckpointError: ``class_names`` is not a list of distinct strings, one per class (a string
            ``"ABCD"`` is not four names).
    """
    common, meta = ckpt.load_common(path, trust_pickle=trust_pickle)
    names = common.get("class_names")
    count = int(meta["num_classes"])
    if names is not None:
        where = path / ckpt.COMMON_FILE
        if not (isinstance(names, (list, tuple)) and all(type(n) is str for n in names)):
            raise CheckpointError(f"{where}: class_names must be a list of strings, got {short_repr(names)}")
        if len(names) != count or len(set(names)) != len(names):
            raise CheckpointError(
                f"{where}: class_names must be {count} distinct names (one per class), got {len(names)} "
                f"({len(names) - len(set(names))} repeated)"
            )
    return (list(names) if names is not None else None), count, common


def plan_run_classes(cfg: TrainConfig, dataset: Dataset, path: Path, init: bool) -> Tuple[Dataset, ClassPlan]:
    """The run's class plan against checkpoint ``path`` and its dataset, relabelled when the plan
    moves labels (a grown or reordered identity set). An exported model (no head) gives a fresh head."""
    dataset_names = getattr(dataset, "class_names", None)
    if dataset_names is None:
        dataset_names = [str(i) for i in range(dataset.num_classes)]
    if is_torchscript(path):
        return dataset, fresh_plan(dataset_names, "an exported model holds no head")
    names, count, _ = saved_classes(path, cfg.trust_checkpoint)
    if cfg.rename_classes:  # renamed identities keep their rows under their new names
        if names is None:
            raise ConfigError(f"rename_classes={cfg.rename_classes!r}: checkpoint {path} records no class names to rename")
        names = rename(names, read_renames(cfg.rename_classes), source=f"checkpoint {path}")
    plan = plan_classes(names, count, dataset_names, init=init, on_missing=cfg.on_missing_classes,
                        source=f"checkpoint {path}")
    if plan.label_map is not None or plan.num_classes != dataset.num_classes:
        dataset = RelabelledDataset(dataset, plan.label_map if plan.label_map is not None
                                    else np.arange(dataset.num_classes), plan.names)
    return dataset, plan
