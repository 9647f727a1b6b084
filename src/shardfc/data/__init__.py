"""Datasets and image transforms: folder / list-file datasets, a synthetic identity set and its pre-rendered pool."""

from shardfc.data.folder import IMG_EXTENSIONS, ImageFolderDataset, ListFileDataset
from shardfc.data.synthetic import SyntheticIdentities, SyntheticPool
from shardfc.data.transforms import (
    CorruptImageError,
    ImageTransform,
    decode_image,
    image_to_tensor,
    normalize,
    pil_to_tensor,
)

__all__ = [
    "IMG_EXTENSIONS",
    "CorruptImageError",
    "ImageFolderDataset",
    "ImageTransform",
    "ListFileDataset",
    "SyntheticIdentities",
    "SyntheticPool",
    "decode_image",
    "image_to_tensor",
    "normalize",
    "pil_to_tensor",
]
