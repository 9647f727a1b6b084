"""The class of every index of a dataset, read without decoding an image.

What the P x K identity sampler (:mod:`shardfc.train.loader.identity_sampler`), a relabelled dataset
(:class:`~shardfc.data.relabel.RelabelledDataset`) and imprinting read.
"""

from __future__ import annotations

import numpy as np
from torch.utils.data import Dataset

from shardfc import files

__all__ = ["dataset_labels", "check_class_count", "MAX_CLASSES_WITHOUT_IMAGES"]

#: A data set may declare more classes than it has images (labels left unused, a ``property`` for
#: a larger set) up to this many; past both, the count is refused before anything is allocated:
#: each class is a head row, and a list file or RecordIO header announcing 10^9 classes would
#: otherwise ask the trainer for terabytes. ``SHARDFC_MAX_CLASSES_WITHOUT_IMAGES`` raises it.
MAX_CLASSES_WITHOUT_IMAGES = 1 << 16


def check_class_count(num_classes: int, images: int, where: str) -> int:
    """``num_classes`` if it is at most ``images`` (the file's own record count: one class per image)
    or :data:`MAX_CLASSES_WITHOUT_IMAGES`, whichever is more; else a FileRefused naming ``where``."""
    floor = files.env_limit("SHARDFC_MAX_CLASSES_WITHOUT_IMAGES", MAX_CLASSES_WITHOUT_IMAGES)
    if num_classes > max(int(images), floor):
        raise files.FileRefused(
            f"{where} declares {num_classes} classes for {images} images: more than one class per image and more "
            f"than {floor} (raise it with SHARDFC_MAX_CLASSES_WITHOUT_IMAGES)")
    return int(num_classes)


def dataset_labels(dataset: Dataset) -> np.ndarray:
    """The class of every index of a training dataset, without decoding an image."""
    inner = getattr(dataset, "inner", dataset)
    if hasattr(inner, "labels"):  # RecordIODataset
        return np.asarray(inner.labels, dtype=np.int64)
    if hasattr(inner, "samples"):  # folder, list and Market-1501 datasets
        return np.fromiter((label for _, label in inner.samples), dtype=np.int64, count=len(inner.samples))
    if hasattr(inner, "images_per_identity"):  # SyntheticIdentities: index = identity * per + k
        return np.arange(len(inner), dtype=np.int64) // inner.images_per_identity
    raise TypeError(f"cannot read the labels of {type(inner).__name__} without loading its images")
