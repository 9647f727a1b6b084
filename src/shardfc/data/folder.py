"""Datasets over image files on disk: a folder per identity, or a list file.

Corrupt-image policy (both datasets)
------------------------------------
Large face / re-ID crawls always contain a few broken files, and one of them
must not kill a multi-day run. So an image that fails to decode is **skipped
and counted**:

* ``dataset[i]`` on a corrupt image returns the next decodable sample in index
  order (``i+1``, ``i+2``, ... wrapping around), so the substitute is
  deterministic and independent of timing or worker layout;
* ``corrupt_count`` is incremented once per skip and the path is added to
  ``corrupt_paths``; a warning naming the path is logged once per path on the
  ``"shardfc.data"`` logger (unless ``log_corrupt`` is off: the trainer names
  them itself, once over all workers and ranks, from :meth:`load_sample`);
* known-corrupt indices are remembered, so later epochs skip them without
  decoding again;
* if every image is corrupt, :class:`RuntimeError` is raised;
* an image that is not a regular file inside the data set's folder (a FIFO, ``/dev/zero``, a link
  out of ``data_root``), or that declares more pixels than ``SHARDFC_MAX_IMAGE_PIXELS`` allows, is
  corrupt too: it is never opened or decoded (the file gate, :mod:`shardfc.files`); the trainer
  stops past ``max_corrupt_images`` different ones.

Counters live in the process that decoded the image: with DataLoader workers
each worker has its own copy, so read the warnings log for a global picture.
A *missing* file is not corrupt, it is a configuration error, and raises
:class:`FileNotFoundError`.

Random augmentation (both datasets)
-----------------------------------
The random flip of sample ``i`` in epoch ``e`` draws from a generator seeded
with ``mix_seed(seed, e, i)``, never from a process's global RNG: the same
images come out whichever DataLoader worker loads them, however many workers
there are, and after a resume (workers restart with fresh RNGs). ``dataset[i]``
uses the epoch set with :meth:`set_epoch`; :meth:`load_sample` takes it as an
argument (what the trainer uses, since workers hold copies of the dataset).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple, Union

import torch
from torch.utils.data import Dataset

from shardfc import files
from shardfc.checks import check_seed, integer_value
from shardfc.data.labels import check_class_count
from shardfc.data.transforms import CorruptImageError, ImageTransform, check_size, decode_image
from shardfc.outputs import write_atomically
from shardfc.seeding import mix_seed

__all__ = ["IMG_EXTENSIONS", "ImageFolderDataset", "ListFileDataset"]

logger = logging.getLogger("shardfc.data")

#: File extensions (lower case) treated as images when scanning folders.
IMG_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".webp"})

PathLike = Union[str, "os.PathLike[str]"]

#: Stream tag of the augmentation generators (keeps them apart from other uses of the seed).
_STREAM_AUGMENT = 0x617567


def _is_image(name: str) -> bool:
    return not name.startswith(".") and os.path.splitext(name)[1].lower() in IMG_EXTENSIONS


class FileImageDataset(Dataset):
    """Shared decoding, transform and corrupt-image handling (see module docstring)."""

    samples: List[Tuple[str, int]]
    num_classes: int

    def __init__(self, image_size: Tuple[int, int], train: bool, flip_prob: float, seed: int) -> None:
        self.train = train
        # Flip augmentation only for training; evaluation adds flips explicitly.
        # checks image_size (None, which the transform reads as "keep each image's size", too: a batch
        # of images of several sizes cannot be stacked)
        self.transform = ImageTransform(check_size(image_size), random_flip=train, flip_prob=flip_prob)
        self.image_size = self.transform.image_size
        self.seed = check_seed("seed", seed)
        self.epoch = 0
        self.log_corrupt = True
        self.corrupt_count = 0
        self.corrupt_paths: Set[str] = set()
        self._corrupt_reasons: Dict[int, str] = {}
        #: The folder every image must resolve inside (a data set found by scanning it); None: the
        #: paths were named by the user (a list file), read where they are.
        self.image_root: Optional[str] = None

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def class_names(self) -> List[str]:
        """The identity behind each class id, as text (a checkpoint records them, so a grown or
        reordered dataset maps every identity to its old row): here the label numbers."""
        return [str(i) for i in range(self.num_classes)]

    def set_epoch(self, epoch: int) -> None:
        """The epoch ``dataset[i]`` draws its augmentation for (see the module docstring)."""
        self.epoch = int(epoch)

    def augmentation_generator(self, index: int, epoch: int) -> Optional[torch.Generator]:
        """The generator of sample ``index``'s random choices in ``epoch``; ``None`` without augmentation."""
        if not self.transform.random_flip:
            return None
        return torch.Generator().manual_seed(mix_seed(self.seed, _STREAM_AUGMENT, epoch, index))

    def _load(self, index: int, generator: Optional[torch.Generator]) -> Tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        return self.transform(decode_image(path, root=self.image_root), generator), label

    def sample_name(self, index: int) -> str:
        """How ``index`` is named in corrupt-image reports (the file path)."""
        return self.samples[index][0]

    def label_of(self, index: int) -> int:
        """The class of ``index``, without loading its image."""
        return int(self.samples[index][1])

    def read_image_bytes(self, index: int) -> bytes:
        """The encoded image of ``index``, undecoded (what the DALI loader decodes).

        Raises:
            FileNotFoundError: the file is missing (as when it is decoded here).
            CorruptImageError: it is not a regular file inside the data set's folder, or too large
                (the file gate, :mod:`shardfc.files`).
        """
        path = self.sample_name(index)
        try:
            return files.read_bytes(path, "image", root=self.image_root)
        except files.FileMissing:
            raise FileNotFoundError(f"image file not found: {path!r}") from None
        except files.FileRefused as e:
            raise CorruptImageError(path, str(e)) from None

    def _record_corrupt(self, index: int, err: CorruptImageError) -> None:
        self._corrupt_reasons[index] = err.reason
        path = self.sample_name(index)
        if path not in self.corrupt_paths:
            self.corrupt_paths.add(path)
            if self.log_corrupt:
                logger.warning("skipping corrupt image %s (%s); substituting the next valid sample", path, err.reason)

    def load_sample(self, index: int, epoch: int) -> Tuple[torch.Tensor, int, List[Tuple[str, str]]]:
        """``(image, label, skipped)`` of ``index`` in ``epoch``: ``skipped`` holds ``(name, reason)`` of
        each corrupt image passed over to reach a decodable one (see the module docstring)."""
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for dataset of size {n}")
        index %= n
        # Drawn for the requested index, so the choice does not depend on which images are corrupt.
        generator = self.augmentation_generator(index, epoch)
        skipped: List[Tuple[str, str]] = []
        for step in range(n):
            i = (index + step) % n
            if i not in self._corrupt_reasons:
                try:
                    image, label = self._load(i, generator)
                    return image, label, skipped
                except CorruptImageError as err:
                    self._record_corrupt(i, err)
            self.corrupt_count += 1
            skipped.append((self.sample_name(i), self._corrupt_reasons[i]))
        raise RuntimeError(f"all {n} images of {self!r} are corrupt")

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, int]:
        image, label, _ = self.load_sample(index, self.epoch)
        return image, label

    def __repr__(self) -> str:
        return f"{type(self).__name__}(samples={len(self.samples)}, num_classes={self.num_classes})"


class ImageFolderDataset(FileImageDataset):
    """One sub-folder per identity: ``root/<identity>/**/<image>``.

    Labels are the index of the identity folder in sorted name order, over all
    non-hidden sub-folders (a folder without images still takes its index, so
    labels stay stable when a folder is emptied). Images are found recursively
    by extension (:data:`IMG_EXTENSIONS`) and listed in sorted path order.
    Corrupt images are skipped and counted (see the module docstring).

    Args:
        root: dataset root.
        image_size: output ``(height, width)``; images are resized if needed.
        train: apply random horizontal flips.
        flip_prob: flip probability when ``train``.
        seed: seed of the augmentation (see the module docstring).

    Attributes:
        classes: identity folder names; ``classes[label]``.
        samples: ``(path, label)`` pairs.
        num_classes: ``len(classes)``.

    Raises:
        FileNotFoundError: ``root`` does not exist or is not a directory.
        ValueError: ``root`` contains no images in identity sub-folders.
    """

    def __init__(
        self,
        root: PathLike,
        image_size: Tuple[int, int] = (112, 112),
        train: bool = True,
        flip_prob: float = 0.5,
        seed: int = 0,
    ) -> None:
        super().__init__(image_size, train, flip_prob, seed)
        self.root = os.fspath(root)
        if not os.path.isdir(self.root):
            raise FileNotFoundError(f"ImageFolderDataset root {self.root!r} does not exist or is not a directory")
        self.classes = sorted(
            e.name for e in os.scandir(self.root) if e.is_dir() and not e.name.startswith(".")
        )
        self.image_root = self.root
        for name in self.classes:  # a class folder linked out of the root would read outside it
            files.inside(os.path.join(self.root, name), self.root, "class folder")
        self.samples = []
        for label, name in enumerate(self.classes):
            for dirpath, dirnames, filenames in os.walk(os.path.join(self.root, name)):
                dirnames.sort()  # os.walk visits sub-folders in list order
                for fname in sorted(filenames):
                    if _is_image(fname):
                        self.samples.append((os.path.join(dirpath, fname), label))
        if not self.samples:
            raise ValueError(
                f"ImageFolderDataset root {self.root!r} contains no images in identity sub-folders "
                f"(found {len(self.classes)} sub-folders; extensions: {sorted(IMG_EXTENSIONS)})"
            )
        self.num_classes = len(self.classes)

    @property
    def class_names(self) -> List[str]:
        """The identity folder names, ``class_names[label]`` (= :attr:`classes`)."""
        return list(self.classes)


class ListFileDataset(FileImageDataset):
    """Images listed in an insightface-style text file, one ``path label`` per line.

    ``path`` may contain spaces (the label is the last whitespace-separated
    field); relative paths are resolved against ``root``, which defaults to the
    list file's directory. Blank lines and lines starting with ``#`` are
    ignored. ``num_classes`` is ``max(label) + 1``. Files are not checked for
    existence up front (lists can hold millions of entries); a missing file
    raises :class:`FileNotFoundError` when loaded. Corrupt images are skipped
    and counted (see the module docstring).

    Args:
        list_file: the list file.
        root: base folder for relative paths.
        image_size: output ``(height, width)``.
        train: apply random horizontal flips.
        flip_prob: flip probability when ``train``.
        seed: seed of the augmentation (see the module docstring).

    Raises:
        FileNotFoundError: ``list_file`` does not exist.
        ValueError: a malformed line (message names the file and line number),
            or a list without entries.
    """

    def __init__(
        self,
        list_file: PathLike,
        root: Optional[PathLike] = None,
        image_size: Tuple[int, int] = (112, 112),
        train: bool = True,
        flip_prob: float = 0.5,
        seed: int = 0,
    ) -> None:
        super().__init__(image_size, train, flip_prob, seed)
        self.list_file = os.fspath(list_file)
        self.root = os.fspath(root) if root is not None else os.path.dirname(os.path.abspath(self.list_file))
        self.samples = []
        # Streamed through the gate: a regular file, UTF-8, each line at most files.MAX_LINE_BYTES.
        for lineno, raw in files.iter_lines(self.list_file, "list"):
            parts = _list_entry(raw)
            if parts is None:
                continue
            if len(parts) != 2:
                raise ValueError(
                    f"{self.list_file}:{lineno}: expected '<path> <label>', got {raw.strip()!r}"
                )
            rel, label_str = parts
            try:
                label = int(label_str)
            except ValueError:
                raise ValueError(
                    f"{self.list_file}:{lineno}: label must be an integer, got {label_str!r}"
                ) from None
            if label < 0:
                raise ValueError(f"{self.list_file}:{lineno}: label must be >= 0, got {label}")
            self.samples.append((os.path.join(self.root, rel), label))
        if not self.samples:
            raise ValueError(f"ListFileDataset list_file {self.list_file!r} contains no entries")
        self.num_classes = check_class_count(max(label for _, label in self.samples) + 1, len(self.samples),
                                             f"list file {self.list_file}")

    @staticmethod
    def write(list_file: PathLike, samples: List[Tuple[PathLike, int]]) -> None:
        """Write ``(path, label)`` pairs in the format this class reads.

        A path that would not read back as itself is refused, naming it (a line break in it, whitespace
        at either end, a leading ``#``: the reader strips lines and skips comments), as is a label that
        is not an int ``>= 0`` (``1.5`` was written as class 1). The file is written whole through a
        scratch file or not at all: a crash leaves the previous list as it was.
        """
        lines = []
        for path, label in samples:
            text = os.fspath(path)
            value = _class_id(label)
            if value is None:
                raise ValueError(f"ListFileDataset.write: label must be an int >= 0, got {label!r} for {text!r}")
            if "\n" in text or _list_entry(f"{text} {value}") != [text, str(value)]:
                raise ValueError(f"ListFileDataset.write: path {text!r} would not read back as itself (a line break "
                                 "in it, whitespace at either end, or a leading '#')")
            lines.append(f"{text} {value}\n")
        write_atomically(Path(list_file), lambda scratch: scratch.write_text("".join(lines), encoding="utf-8"))


def _class_id(label: object) -> Optional[int]:
    """``label`` as a class id (:func:`~shardfc.checks.integer_value` ``>= 0``), else None."""
    value = integer_value(label)
    return value if value is not None and value >= 0 else None


def _list_entry(line: str) -> Optional[List[str]]:
    """A list file's line split into ``[path, label]`` (any other length is malformed); None for a
    blank line or a ``#`` comment. Surrounding whitespace is not part of the path."""
    line = line.strip()
    if not line or line.startswith("#"):
        return None
    return line.rsplit(None, 1)

