"""The Market-1501 training folder: names -> relabelled person ids, junk and distractors left out."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from shardfc.data.market1501 import Market1501TrainDataset


def _write(folder, names):
    folder.mkdir(parents=True)
    for i, name in enumerate(names):
        Image.fromarray(np.full((12, 6, 3), 10 * i, dtype=np.uint8)).save(folder / name)


def test_labels_are_relabelled_person_ids(tmp_path):
    _write(tmp_path / "bounding_box_train", [
        "0002_c1s1_000451_03.jpg", "0002_c3s1_000551_01.jpg", "0007_c2s1_000001_00.jpg",
        "1501_c6s4_001877_02.jpg", "0000_c1s1_000001_00.jpg", "-1_c1s1_000002_00.jpg",
    ])
    (tmp_path / "bounding_box_train" / "Thumbs.db").write_bytes(b"x")
    ds = Market1501TrainDataset(tmp_path, image_size=(16, 8), train=False)
    assert ds.pids == [2, 7, 1501] and ds.num_classes == 3
    assert [label for _, label in ds.samples] == [0, 0, 1, 2]  # distractor 0000 and junk -1 left out
    assert ds.cams == [1, 3, 2, 6]
    image, label = ds[2]
    assert image.shape == (3, 16, 8) and label == 1


def test_errors_name_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="bounding_box_train.*does not exist"):
        Market1501TrainDataset(tmp_path)
    _write(tmp_path / "bounding_box_train", ["0000_c1s1_000001_00.jpg"])
    with pytest.raises(ValueError, match="no images of a person"):
        Market1501TrainDataset(tmp_path)
    (tmp_path / "bounding_box_train" / "photo.jpg").write_bytes(b"x")
    with pytest.raises(ValueError, match="cannot parse person/camera id from 'photo.jpg'"):
        Market1501TrainDataset(tmp_path)


def test_hidden_files_and_other_files_anywhere_in_the_folder_are_passed_over(tmp_path):
    _write(tmp_path / "bounding_box_train", ["0002_c1s1_000451_03.jpg", ".0003_c1s1_000001_00.jpg"])
    (tmp_path / "bounding_box_train" / "+notes.txt").write_text("sorted before the images")
    ds = Market1501TrainDataset(tmp_path, image_size=(16, 8))
    assert ds.pids == [2] and len(ds.samples) == 1


def test_a_training_set_by_default_and_the_settings_kept(tmp_path):
    _write(tmp_path / "bounding_box_train", ["0002_c1s1_000451_03.jpg"])
    ds = Market1501TrainDataset(tmp_path)
    assert ds.train is True and ds.transform.random_flip and ds.seed == 0 and ds.image_size == (256, 128)
    ds = Market1501TrainDataset(tmp_path, image_size=(16, 8), train=False, flip_prob=0.3, seed=4)
    assert ds.train is False and not ds.transform.random_flip and ds.seed == 4 and ds.transform.flip_prob == 0.3
