"""A training dataset whose labels are mapped to other class ids: how a grown or reordered
identity set keeps every identity on its old head row (the rows never move; the labels do)."""

from __future__ import annotations

from typing import Any, List, Sequence

import numpy as np
from torch.utils.data import Dataset

from shardfc.data.labels import dataset_labels

__all__ = ["RelabelledDataset"]


class RelabelledDataset(Dataset):
    """``base`` with label ``y`` read as class ``label_map[y]``, in a head of ``num_classes`` classes.

    Everything else (images, augmentation, corrupt-image counters, ``load_sample`` when ``base``
    has it) is ``base``'s own.

    Args:
        base: the dataset as read from disk.
        label_map: ``label_map[y]``, the class id of ``base``'s label ``y`` (one entry per label).
        names: the identity of each class id of the head, ``names[class id]`` (``num_classes`` of them).
    """

    def __init__(self, base: Dataset, label_map: Sequence[int], names: List[str]) -> None:
        self.base = base
        self.label_map = np.asarray(label_map, dtype=np.int64)
        self.class_names = list(names)
        self.num_classes = len(self.class_names)
        if hasattr(base, "load_sample"):  # only then: KeyedSamples asks with hasattr
            self.load_sample = self._load_sample

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int):
        image, label = self.base[index]
        return image, int(self.label_map[label])

    def _load_sample(self, index: int, epoch: int):
        image, label, skipped = self.base.load_sample(index, epoch)
        return image, int(self.label_map[label]), skipped

    @property
    def labels(self) -> np.ndarray:
        """The class id of every index, without decoding an image (for the P x K sampler)."""
        return self.label_map[dataset_labels(self.base)]

    def __getattr__(self, name: str) -> Any:  # transform, corrupt counters, sample_name, ...
        if name == "base":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.base, name)

    def __repr__(self) -> str:
        return f"RelabelledDataset({self.base!r}, num_classes={self.num_classes})"

