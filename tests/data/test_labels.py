"""The class of every index of a dataset, read without decoding an image (``shardfc.data.labels``):
each kind of dataset, through the trainer's keyed wrapper, always as int64; the refusal of a dataset
that would have to be decoded. (The class-count limit is tested with the readers that apply it, in
``test_recordio_reader.py`` and ``test_hostile_data.py``.)"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from shardfc.data import ImageFolderDataset, SyntheticIdentities
from shardfc.data.labels import dataset_labels
from shardfc.train.loader.data import KeyedSamples


class Decoded:
    """A dataset that knows its labels only by decoding: nothing to read them from."""

    def __len__(self):
        return 2

    def __getitem__(self, i):
        raise AssertionError("dataset_labels must not decode an image")


class Listed:
    """A dataset that keeps its labels as int32 (as a reader of a compact index might)."""

    labels = np.array([3, 0, 2], dtype=np.int32)


def _folder(tmp_path):
    for name, count in (("alice", 2), ("bob", 3)):
        (tmp_path / name).mkdir()
        for k in range(count):
            Image.new("RGB", (4, 4)).save(tmp_path / name / f"{k}.png")
    return ImageFolderDataset(str(tmp_path), image_size=(4, 4))


def _decoded_labels(ds) -> list:
    return [int(ds[i][1]) for i in range(len(ds))]


def test_each_kind_of_dataset_gives_its_labels_as_int64(tmp_path):
    synthetic = SyntheticIdentities(4, 3, (8, 8), seed=0)
    folder = _folder(tmp_path)
    for ds, expected in ((synthetic, _decoded_labels(synthetic)), (folder, _decoded_labels(folder)),
                         (Listed(), [3, 0, 2])):
        labels = dataset_labels(ds)
        assert labels.dtype == np.int64, type(ds).__name__
        assert labels.tolist() == expected, type(ds).__name__
    assert dataset_labels(folder).tolist() == [0, 0, 1, 1, 1]


def test_the_trainers_keyed_wrapper_is_read_through():
    """The P x K sampler and imprinting get the dataset as the trainer wraps it."""
    synthetic = SyntheticIdentities(4, 3, (8, 8), seed=0)
    assert dataset_labels(KeyedSamples(synthetic)).tolist() == dataset_labels(synthetic).tolist()
    assert dataset_labels(KeyedSamples(Listed())).dtype == np.int64


def test_a_dataset_that_must_be_decoded_is_refused_by_name():
    with pytest.raises(TypeError, match="^cannot read the labels of Decoded without loading its images$"):
        dataset_labels(Decoded())
    with pytest.raises(TypeError, match="^cannot read the labels of Decoded without"):
        dataset_labels(KeyedSamples(Decoded()))  # the wrapped dataset is named, not the wrapper
