"""Which head row each identity gets against a checkpoint's recorded class names: grown, reordered,
vanished, nameless and disjoint identity sets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from shardfc.data import ImageFolderDataset
from shardfc.data.relabel import RelabelledDataset
from shardfc.train.checkpointing.classes import plan_classes
from shardfc.train.config import ConfigError


def test_a_grown_set_keeps_old_rows_and_appends_new_ones_in_dataset_order():
    plan = plan_classes(["b", "d"], 2, ["a", "b", "c", "d"], init=False)
    assert plan.names == ["b", "d", "a", "c"] and plan.kept == 2 and plan.added == ["a", "c"]
    assert plan.label_map.tolist() == [2, 0, 3, 1]  # a -> 2, b -> 0, c -> 3, d -> 1
    assert "2 classes from the checkpoint, 2 new" == plan.note


def test_the_same_set_needs_no_relabelling():
    plan = plan_classes(["x", "y"], 2, ["x", "y"], init=False)
    assert plan.label_map is None and plan.kept == 2 and plan.num_classes == 2


def _folders(root: Path, names):
    from PIL import Image

    for name in names:
        (root / name).mkdir(parents=True)
        Image.new("RGB", (8, 8), color=(len(name) * 40 % 255, 0, 0)).save(root / name / "0.png")


def test_a_reordered_folder_listing_maps_every_identity_to_its_old_row(tmp_path: Path):
    _folders(tmp_path / "old", ["m", "q", "z"])
    old = ImageFolderDataset(tmp_path / "old", (8, 8))
    # New identities sort before, between and after the old ones: every folder's label changes.
    _folders(tmp_path / "new", ["a", "m", "n", "q", "z", "zz"])
    new = ImageFolderDataset(tmp_path / "new", (8, 8))
    plan = plan_classes(old.class_names, old.num_classes, new.class_names, init=False)
    relabelled = RelabelledDataset(new, plan.label_map, plan.names)
    assert relabelled.num_classes == 6
    row_of = {name: i for i, name in enumerate(old.class_names)}
    for index, (path, _) in enumerate(new.samples):
        identity = Path(path).parent.name
        _, label = relabelled[index]
        _, label_keyed, _ = relabelled.load_sample(index, 0)
        assert label == label_keyed
        if identity in row_of:
            assert label == row_of[identity], identity
        else:
            assert label >= 3
    assert sorted(int(x) for x in relabelled.labels) == list(range(6))
    assert isinstance(relabelled.labels, np.ndarray) and torch.is_tensor(relabelled[0][0])


def test_vanished_or_renamed_identities_are_refused_naming_them():
    saved = [f"id{i}" for i in range(8)]
    data = saved[:1] + [f"new{i}" for i in range(3)]  # 7 vanished (or renamed)
    with pytest.raises(ConfigError, match=r"7 of the checkpoint's 8 classes are not in the dataset.*'id1', 'id2', "
                                          r"'id3', 'id4', 'id5' and 2 more.*--on-missing-classes keep"):
        plan_classes(saved, 8, data, init=False)
    kept = plan_classes(saved, 8, data, init=False, on_missing="keep")
    assert kept.names == saved + ["new0", "new1", "new2"] and kept.kept == 8 and len(kept.vanished) == 7
    assert kept.label_map.tolist() == [0, 8, 9, 10]
    fresh = plan_classes(saved, 8, data, init=False, on_missing="fresh")
    assert fresh.kept == 0 and fresh.names == data and fresh.label_map is None


def test_no_names_is_refused_when_the_count_changes():
    with pytest.raises(ConfigError, match=r"records no class names .* has 5 classes, the dataset 7: which row is "
                                          r"which identity cannot be told.*--on-missing-classes fresh"):
        plan_classes(None, 5, [str(i) for i in range(7)], init=False)
    same = plan_classes(None, 7, [str(i) for i in range(7)], init=False)  # as before names were recorded
    assert same.kept == 7 and same.label_map is None
    assert plan_classes(None, 5, [str(i) for i in range(7)], init=True).kept == 0  # fine-tuning: a new head


def test_fine_tuning_on_a_disjoint_set_builds_a_new_head_but_a_partial_overlap_must_be_decided():
    plan = plan_classes(["a", "b"], 2, ["c", "d", "e"], init=True)
    assert plan.kept == 0 and plan.num_classes == 3 and "its head is dropped" in plan.note
    with pytest.raises(ConfigError, match="1 of the checkpoint's 2 classes"):
        plan_classes(["a", "b"], 2, ["b", "c"], init=True)


def test_duplicate_names_are_refused():
    with pytest.raises(ConfigError, match="the dataset names classes more than once: 'a'"):
        plan_classes(["a"], 1, ["a", "a"], init=False)


def test_renamed_identities_keep_their_rows_under_their_new_names(tmp_path: Path):
    from shardfc.train.checkpointing.classes import read_renames, rename

    renames_file = tmp_path / "renames.tsv"
    renames_file.write_text("# old\tnew\nbob\trobert smith\n\n", encoding="utf-8")
    renames = read_renames(renames_file)
    assert renames == {"bob": "robert smith"}
    saved = rename(["al", "bob", "cy"], renames)
    assert saved == ["al", "robert smith", "cy"]
    plan = plan_classes(saved, 3, ["robert smith", "al", "cy", "dee"], init=False)
    assert plan.names == ["al", "robert smith", "cy", "dee"] and plan.kept == 3
    assert plan.label_map.tolist() == [1, 0, 2, 3]  # robert smith trains bob's row 1
    # a later resume passes the same file: its checkpoint already has the new name
    assert rename(plan.names, renames) == plan.names
    with pytest.raises(ConfigError, match=r"renames 1 name\(s\) the checkpoint does not have: 'zed'"):
        rename(["al"], {"zed": "z"})


@pytest.mark.parametrize("text, message", [
    ("bob robert\n", r"line 1: expected 'old name<TAB>new name', got 'bob robert'"),
    ("a\tb\n\na\tc\n", r"line 3: 'a' is renamed twice"),
    ("a\t\n", r"line 1: expected"),
])
def test_a_bad_renames_file_is_refused_naming_the_line(tmp_path: Path, text, message):
    from shardfc.train.checkpointing.classes import read_renames

    f = tmp_path / "renames.tsv"
    f.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match=message):
        read_renames(f)
    with pytest.raises(ConfigError, match=r"rename_classes='.*missing.tsv': cannot read it"):
        read_renames(tmp_path / "missing.tsv")
