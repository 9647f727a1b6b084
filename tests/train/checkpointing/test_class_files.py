"""The class names a run reads — a renames file, a checkpoint's ``class_names`` — and the plan made
from them, at their edges: each message word for word, each bound at its value, in the test's
process with small checkpoints (``test_classes.py`` holds the plans on real datasets)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from shardfc import checkpoint as ckpt
from shardfc.checkpoint.format import CheckpointError
from shardfc.data.relabel import RelabelledDataset
from shardfc.train.checkpointing.classes import (
    SHOWN,
    fresh_plan,
    plan_classes,
    plan_run_classes,
    read_renames,
    saved_classes,
)
from shardfc.train.config import ConfigError, TrainConfig


def _renames(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "renames.tsv"
    path.write_text(text)
    return path


def _refused(func, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        func(*args, **kwargs)
    return str(info.value)


# ------------------------------------------------------------------ the renames file


def test_comments_blank_lines_and_names_with_spaces(tmp_path):
    path = _renames(tmp_path, "# a header\n   # indented comment\n\n  \nold name\tnew name\nx\ty\n")
    assert read_renames(path) == {"old name": "new name", "x": "y"}


@pytest.mark.parametrize("line", ["\tnew", "old\t", "old", "a\tb\tc"])
def test_a_line_that_is_not_two_names_is_refused(tmp_path, line):
    path = _renames(tmp_path, f"ok\tfine\n{line}\n")
    assert _refused(read_renames, path) == (
        f"rename_classes={str(path)!r}, line 2: expected 'old name<TAB>new name', got {line!r}")


def test_a_name_renamed_twice_is_refused(tmp_path):
    path = _renames(tmp_path, "a\tb\na\tc\n")
    assert _refused(read_renames, path) == f"rename_classes={str(path)!r}, line 2: 'a' is renamed twice"


@pytest.mark.parametrize("text, name, line", [
    ("a\tb\nb\tc\n", "b", 2),   # a chain: b is renamed (line 2) and a new name (line 1)
    ("b\tc\na\tb\n", "b", 2),   # the same chain written the other way round
    ("a\tb\nb\ta\n", "a", 2),   # a swap
    ("x\ty\na\tb\nb\tc\nc\ta\n", "a", 4),  # a cycle after a sound line
])
def test_chains_swaps_and_cycles_are_refused_naming_a_name_and_its_last_line(tmp_path, text, name, line):
    path = _renames(tmp_path, text)
    assert _refused(read_renames, path) == (
        f"rename_classes={str(path)!r}, line {line}: {name!r} is both renamed and a new name (a swap, cycle or "
        "chain of renames): passed again on a later resume it would rename again while the rows stay, so "
        "identities would trade rows. Rename in separate runs through names no class has")


def test_an_unreadable_renames_file_is_named(tmp_path):
    assert _refused(read_renames, tmp_path) == (
        f"rename_classes={str(tmp_path)!r}: cannot read it (refusing to read renames file {tmp_path}: "
        "it is a folder, not a regular file)")


# ------------------------------------------------------------------ plans


def test_a_fresh_plan_adds_every_name():
    plan = fresh_plan(["a", "b"], "why")
    assert (plan.names, plan.label_map, plan.kept, plan.added, plan.note) == (
        ["a", "b"], None, 0, ["a", "b"], "new head of 2 classes (why)")


def test_names_given_twice_are_named_up_to_a_few():
    many = [f"n{i}" for i in range(SHOWN + 1)]
    assert _refused(plan_classes, None, 0, many + many, init=True) == (
        f"the dataset names classes more than once: {', '.join(repr(n) for n in many[:SHOWN])} and 1 more")
    assert _refused(plan_classes, ["a", "b", "a", "c", "b"], 5, ["a"], init=True, source="ck") == (
        "ck names classes more than once: 'a', 'b'")
    five = many[:SHOWN]
    assert _refused(plan_classes, five + five, 10, ["zz"], init=False) == (
        f"the checkpoint names classes more than once: {', '.join(repr(n) for n in five)}")


def test_vanished_identities_are_refused_by_default_and_kept_when_asked():
    hint = ("pass --rename-classes FILE for renamed ones (old<TAB>new per line: they keep their rows), "
            "--on-missing-classes keep to keep their rows (no identity moves), or --on-missing-classes fresh to "
            "start a new head for this dataset's 2 classes (the backbone is kept)")
    assert _refused(plan_classes, ["a", "b", "c"], 3, ["a", "d"], init=False) == (
        f"2 of the checkpoint's 3 classes are not in the dataset (vanished or renamed): 'b', 'c'; rows are never "
        f"shifted silently: {hint}")
    plan = plan_classes(["a", "b", "c"], 3, ["a", "d"], init=False, on_missing="keep")
    assert (plan.names, plan.label_map.tolist(), plan.kept, plan.added, plan.vanished) == (
        ["a", "b", "c", "d"], [0, 3], 3, ["d"], ["b", "c"])
    assert plan.label_map.dtype == np.int64
    assert plan.note == "3 classes from the checkpoint, 1 new, 2 kept without images ('b', 'c')"
    fresh = plan_classes(["a", "b"], 2, ["a", "d"], init=False, on_missing="fresh")
    assert (fresh.names, fresh.kept, fresh.note) == (["a", "d"], 0, "new head of 2 classes (--on-missing-classes fresh)")


def test_a_checkpoint_without_names():
    same = plan_classes(None, 2, ["x", "y"], init=False, source="ck")
    assert (same.names, same.label_map, same.kept) == (["x", "y"], None, 2)
    assert same.note == "ck records no class names: its 2 rows are taken as the dataset's labels 0..C-1 in order"
    fresh = plan_classes(None, 3, ["x", "y"], init=True, source="ck")
    assert fresh.note == "new head of 2 classes (ck records no class names and has 3 classes)" and fresh.kept == 0
    assert _refused(plan_classes, None, 3, ["x", "y"], init=False, source="ck") == (
        "ck records no class names (saved before shardfc recorded them, or imported) and has 3 classes, the dataset "
        "2: which row is which identity cannot be told. Pass --on-missing-classes fresh to start a new head (the "
        "backbone is kept)")
    assert _refused(plan_classes, ["a"], 2, ["a"], init=False, source="ck") == "ck records 1 class names for 2 classes"


# ------------------------------------------------------------------ a checkpoint's class_names


def _checkpoint(root: Path, names, count: int) -> Path:
    common = {} if names is None else {"class_names": names}
    return ckpt.save_checkpoint(root, 0, common=common, per_rank=None, head_tensors={"weight": torch.zeros(count, 2)},
                                head_extras={}, class_range=range(count), num_classes=count, fingerprint={})


@pytest.mark.parametrize("names, why", [
    ("ABCD", "class_names must be a list of strings, got 'ABCD'"),
    (["a", 1], "class_names must be a list of strings, got ['a', 1]"),
    (["a", "a"], "class_names must be 2 distinct names (one per class), got 2 (1 repeated)"),
    (["a"], "class_names must be 2 distinct names (one per class), got 1 (0 repeated)"),
    (["a", "a", "b"], "class_names must be 2 distinct names (one per class), got 3 (1 repeated)"),
])
def test_a_checkpoints_class_names_are_checked(tmp_path, names, why):
    path = _checkpoint(tmp_path, names, 2)
    with pytest.raises(CheckpointError) as info:
        saved_classes(path, False)
    assert str(info.value) == f"{path / ckpt.COMMON_FILE}: {why}"


def test_a_checkpoints_class_names_are_read(tmp_path):
    names, count, common = saved_classes(_checkpoint(tmp_path / "a", ("x", "y"), 2), False)
    assert (names, count, common["class_names"]) == (["x", "y"], 2, ("x", "y"))
    assert saved_classes(_checkpoint(tmp_path / "b", None, 3), False)[:2] == (None, 3)


def test_a_checkpoint_that_needs_unpickling_is_read_only_when_trusted(tmp_path):
    import argparse

    from train.legacy import rewrite_file  # tests/ is on sys.path (its conftest.py)

    path = _checkpoint(tmp_path, ["x"], 1)
    obj = torch.load(path / ckpt.COMMON_FILE, weights_only=True)
    rewrite_file(path, ckpt.COMMON_FILE, {**obj, "cfg": argparse.Namespace(lr=0.1)})  # meta.json's hash matches
    with pytest.raises(CheckpointError, match="refusing to load"):
        saved_classes(path, False)
    assert saved_classes(path, True)[0] == ["x"]
    dataset = _Names(["x"])
    with pytest.raises(CheckpointError, match="refusing to load"):
        plan_run_classes(TrainConfig(), dataset, path, init=False)
    assert plan_run_classes(TrainConfig(trust_checkpoint=True), dataset, path, init=False)[1].kept == 1


# ------------------------------------------------------------------ the run's plan


class _Names:
    """A dataset's class names and count (what plan_run_classes reads)."""

    def __init__(self, names=None, num_classes=None):
        if names is not None:
            self.class_names = list(names)
        self.num_classes = len(names) if names is not None else num_classes

    def __len__(self):
        return 0


def test_the_same_classes_leave_the_dataset_alone(tmp_path):
    path = _checkpoint(tmp_path, ["a", "b"], 2)
    dataset = _Names(["a", "b"])
    got, plan = plan_run_classes(TrainConfig(), dataset, path, init=False)
    assert got is dataset and plan.label_map is None and plan.note == (
        f"2 classes from checkpoint {path}, 0 new")


def test_a_dataset_without_names_is_its_labels_as_text(tmp_path):
    path = _checkpoint(tmp_path, ["0", "1"], 2)
    dataset = _Names(num_classes=3)
    got, plan = plan_run_classes(TrainConfig(), dataset, path, init=False)
    assert got is dataset and plan.names == ["0", "1", "2"] and plan.added == ["2"]  # grown: label y is row y


def test_a_reordered_dataset_is_relabelled(tmp_path):
    path = _checkpoint(tmp_path, ["a", "b"], 2)
    dataset = _Names(["b", "a"])
    got, plan = plan_run_classes(TrainConfig(), dataset, path, init=False)
    assert isinstance(got, RelabelledDataset) and got.base is dataset
    assert got.label_map.tolist() == [1, 0] and got.class_names == ["a", "b"]


def test_kept_rows_without_images_grow_the_head(tmp_path):
    path = _checkpoint(tmp_path, ["a", "b"], 2)
    dataset = _Names(["a"])
    assert "--on-missing-classes keep" in _refused(plan_run_classes, TrainConfig(), dataset, path, init=False)
    got, plan = plan_run_classes(TrainConfig(on_missing_classes="keep"), dataset, path, init=False)
    assert got.label_map.tolist() == [0] and got.num_classes == 2 and plan.vanished == ["b"]
    got, plan = plan_run_classes(TrainConfig(on_missing_classes="fresh"), dataset, path, init=False)
    assert got is dataset and plan.kept == 0


def test_renames_reach_the_checkpoints_names(tmp_path):
    path = _checkpoint(tmp_path / "a", ["old", "b"], 2)
    renames = _renames(tmp_path, "old\tnew\n")
    dataset = _Names(["b", "new"])
    got, plan = plan_run_classes(TrainConfig(rename_classes=str(renames)), dataset, path, init=False)
    assert plan.names == ["new", "b"] and got.label_map.tolist() == [1, 0]
    ghost = _renames(tmp_path, "ghost\tnew\n")
    assert _refused(plan_run_classes, TrainConfig(rename_classes=str(ghost)), dataset, path, init=False) == (
        f"rename_classes renames 1 name(s) checkpoint {path} does not have: 'ghost'")
    unnamed = _checkpoint(tmp_path / "b", None, 2)
    assert _refused(plan_run_classes, TrainConfig(rename_classes=str(renames)), dataset, unnamed, init=False) == (
        f"rename_classes={str(renames)!r}: checkpoint {unnamed} records no class names to rename")


def test_an_exported_model_gives_a_fresh_head(tmp_path):
    model = torch.jit.script(torch.nn.Linear(2, 2))
    path = tmp_path / "model.pt"
    torch.jit.save(model, str(path))
    dataset = _Names(["a", "b"])
    got, plan = plan_run_classes(TrainConfig(), dataset, path, init=True)
    assert got is dataset and plan.note == "new head of 2 classes (an exported model holds no head)"


def test_fine_tuning_on_a_disjoint_set_starts_a_new_head_where_a_resume_refuses(tmp_path):
    path = _checkpoint(tmp_path, ["a", "b"], 2)
    dataset = _Names(["x", "y", "z"])
    got, plan = plan_run_classes(TrainConfig(), dataset, path, init=True)
    assert got is dataset and plan.kept == 0 and plan.note == (
        f"new head of 3 classes (none of checkpoint {path}'s 2 classes is in the dataset: its head is dropped)")
    assert _refused(plan_run_classes, TrainConfig(), dataset, path, init=False).startswith(
        f"2 of checkpoint {path}'s 2 classes are not in the dataset")
