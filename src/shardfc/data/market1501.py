"""The training split of a Market-1501 style re-ID folder, read as it is released.

Market-1501 (and DukeMTMC-reID, MSMT17 in its Market-style export) keeps all training crops in one
flat folder, ``bounding_box_train/``, the person and camera in each name: ``0002_c1s1_000451_03.jpg``
is person 2 from camera 1. The person ids are relabelled ``0 .. N-1`` in increasing id order;
junk crops (id ``-1``) and distractors (id ``0``, background) carry no identity and are left out,
as every re-ID codebase does. Query and gallery (``query/``, ``bounding_box_test/``) are read by
:mod:`shardfc.evaluation.reid`; the names are parsed here (:func:`parse_market1501_name`), for both.
"""

from __future__ import annotations

import os
import re
from typing import List, Tuple, Union

from shardfc.data.folder import IMG_EXTENSIONS, FileImageDataset, PathLike

__all__ = ["DISTRACTOR_PID", "JUNK_PID", "Market1501TrainDataset", "parse_market1501_name"]

#: Person id of Market-1501 junk images (excluded from every gallery ranking).
JUNK_PID = -1

_MARKET_NAME = re.compile(r"(-0*1|[0-9]+)_c([0-9]+)")  # ASCII digits; the only negative id is junk's (-1, -001)

#: Person id of Market-1501 distractors (background crops).
DISTRACTOR_PID = 0


def parse_market1501_name(filename: Union[str, "os.PathLike[str]"]) -> Tuple[int, int]:
    """``"0002_c1s1_000451_03.jpg" -> (2, 1)``: person id and camera id.

    Works on a bare name or a path, and on DukeMTMC-reID names
    (``0001_c2_f0046182.jpg``). Person id ``-1`` marks junk images and ``0``
    distractors; camera ids are returned as written (1-based for Market).

    Raises:
        ValueError: the name does not start with ``<pid>_c<camera>`` (a pid of ``-1`` or ``>= 0``: ``-5``
            is no Market-1501 id, and was taken for a person).
    """
    name = os.path.basename(os.fspath(filename))
    m = _MARKET_NAME.match(name)
    if m is None:
        raise ValueError(
            f"cannot parse person/camera id from {name!r}: expected a Market-1501 name like '0002_c1s1_000451_03.jpg'"
        )
    return int(m.group(1)), int(m.group(2))


class Market1501TrainDataset(FileImageDataset):
    """``root/<split>/<pid>_c<camera>...jpg`` -> ``(image, label)`` with labels ``0 .. N-1``.

    Corrupt images are skipped and counted like the other file datasets (:mod:`shardfc.data.folder`).

    Args:
        root: the dataset root (holding ``bounding_box_train/``).
        image_size: output ``(height, width)``.
        train: apply random horizontal flips.
        flip_prob: flip probability when ``train``.
        split: the training folder under ``root``.

    Attributes:
        samples: ``(path, label)`` pairs in file-name order.
        pids: ``pids[label]`` is the person id in the file names.
        cams: the camera of each sample.

    Raises:
        FileNotFoundError: ``root/split`` is not a folder.
        ValueError: no images with a person id, or a name that does not parse.
    """

    def __init__(
        self,
        root: PathLike,
        image_size: Tuple[int, int] = (256, 128),
        train: bool = True,
        flip_prob: float = 0.5,
        split: str = "bounding_box_train",
        seed: int = 0,
    ) -> None:
        super().__init__(image_size, train, flip_prob, seed)
        self.root = os.path.join(os.fspath(root), split)
        if not os.path.isdir(self.root):
            raise FileNotFoundError(
                f"Market-1501 training folder {self.root!r} does not exist: data_root must hold {split}/"
            )
        self.image_root = self.root  # images are files of the split's folder: a link out of it is skipped
        found: List[Tuple[str, int, int]] = []
        for name in sorted(os.listdir(self.root)):
            if name.startswith(".") or os.path.splitext(name)[1].lower() not in IMG_EXTENSIONS:
                continue
            pid, cam = parse_market1501_name(name)
            if pid not in (JUNK_PID, DISTRACTOR_PID):
                found.append((os.path.join(self.root, name), pid, cam))
        if not found:
            raise ValueError(f"Market-1501 training folder {self.root!r} holds no images of a person (id > 0)")
        self.pids = sorted({pid for _, pid, _ in found})
        label_of = {pid: label for label, pid in enumerate(self.pids)}
        self.samples = [(path, label_of[pid]) for path, pid, _ in found]
        self.cams = [cam for _, _, cam in found]
        self.num_classes = len(self.pids)

    @property
    def class_names(self) -> List[str]:
        """The person ids of the file names, as text: ``class_names[label]``."""
        return [str(pid) for pid in self.pids]
