"""Datasets and image transforms: folder / list-file datasets, a synthetic identity set."""

from .folder import IMG_EXTENSIONS, ImageFolderDataset, ListFileDataset
from .synthetic import SyntheticIdentities
from .transforms import (
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
