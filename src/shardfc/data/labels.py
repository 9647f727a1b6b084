"""The class of every index of a dataset, read without decoding an image.

What the P x K identity sampler (:mod:`shardfc.train.loader.identity_sampler`), a relabelled dataset
(:class:`~shardfc.data.relabel.RelabelledDataset`) and imprinting read.
"""

from __future__ import annotations

import numpy as np
from torch.utils.data import Dataset

__all__ = ["dataset_labels"]


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
