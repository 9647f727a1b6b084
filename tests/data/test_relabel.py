"""``RelabelledDataset``: every way of reading a label (an item, ``load_sample``, ``labels`` for the
P x K sampler and for imprinting) gives the mapped class id."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from shardfc.data.relabel import RelabelledDataset
from shardfc.train.loader.identity_sampler import dataset_labels


class _Folder(Dataset):
    """A folder-like dataset: ``samples`` of ``(path, label)``; counts the images it decodes."""

    def __init__(self, labels):
        self.samples = [(f"img{i}.jpg", y) for i, y in enumerate(labels)]
        self.decoded = 0

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        self.decoded += 1
        return torch.full((1,), float(index)), self.samples[index][1]

    def load_sample(self, index, epoch):
        image, label = self[index]
        return image, label, []


# Base labels 0..2 moved to rows 4, 0 and 2 of a grown head of 6 classes (a permutation of the old
# rows and new ids past them): unmapped labels would be a different list with the same sorted set.
BASE = [0, 0, 1, 2, 2, 1, 0]
LABEL_MAP = [4, 0, 2]
MAPPED = [4, 4, 0, 2, 2, 0, 4]


def test_every_way_of_reading_a_label_gives_the_mapped_class_id():
    base = _Folder(BASE)
    relabelled = RelabelledDataset(base, LABEL_MAP, [f"id{i}" for i in range(6)])
    labels = relabelled.labels
    assert base.decoded == 0  # read without decoding an image
    assert isinstance(labels, np.ndarray) and labels.tolist() == MAPPED
    assert dataset_labels(relabelled).tolist() == MAPPED  # what the P x K sampler and imprinting read
    assert [relabelled[i][1] for i in range(len(BASE))] == MAPPED
    assert [relabelled.load_sample(i, 0)[1] for i in range(len(BASE))] == MAPPED
    assert relabelled.num_classes == 6 and relabelled.class_names[4] == "id4"
