"""Datasets and image transforms: folder / list-file datasets, a synthetic identity set."""

from shardfc.data.folder import IMG_EXTENSIONS, ImageFolderDataset, ListFileDataset
from shardfc.data.synthetic import SyntheticIdentities
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
    "decode_image",
    "image_to_tensor",
    "normalize",
    "pil_to_tensor",
]
