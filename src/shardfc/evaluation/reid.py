"""Person re-identification evaluation: Market-1501 style folders, CMC and mAP.

Protocol (Market-1501, as in its official code and in open-reid / torchreid):

* features are L2-normalised and the gallery is ranked by cosine similarity
  per query (equivalent to Euclidean distance on normalised features); ties
  keep gallery order;
* for each query, gallery images with the query's person id *and* camera are
  excluded (same view, trivially easy), as are junk images (person id -1);
  distractors (id 0, "background") stay in the gallery as wrong matches;
* CMC rank-k is the fraction of queries whose first correct match is among
  the top k of the remaining gallery; AP is the mean of the precision at each
  correct match's position (the non-interpolated average precision used by
  open-reid / torchreid, not Market's trapezoidal MATLAB variant);
* queries left with no correct match are skipped, counted and logged.
"""

from __future__ import annotations

import logging
import numbers
import os
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from shardfc.data.folder import IMG_EXTENSIONS
from shardfc.data.market1501 import JUNK_PID, parse_market1501_name
from shardfc.data.transforms import check_size, decode_image, image_to_tensor
from shardfc.evaluation.finite import check_finite
from shardfc.evaluation.verification import embed_batches

__all__ = [
    "JUNK_PID",
    "parse_market1501_name",
    "reid_metrics",
    "ReIDFolder",
    "load_reid_split",
    "evaluate_reid",
]

logger = logging.getLogger("shardfc.evaluation")

ArrayLike = Union[torch.Tensor, np.ndarray, Sequence[float]]


def _as_tensor(x: ArrayLike, name: str, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu()
    else:
        values = np.asarray(x)
        if not (np.issubdtype(values.dtype, np.number) or values.dtype == bool):  # torch's TypeError named no input
            first = next(iter(values.reshape(-1).tolist()), None)
            raise ValueError(f"{name} must hold numbers, got {values.dtype} values such as {first!r}")
        t = torch.as_tensor(values)
    if t.ndim == 0:
        raise ValueError(f"{name} must be an array, got a scalar")
    if not dtype.is_floating_point and t.is_floating_point():  # ids: 1.5 would be truncated into id 1's
        fraction = t[t != t.trunc()]  # (NaN and inf are not whole either)
        if fraction.numel():
            raise ValueError(f"{name} must hold whole numbers (ids), got {fraction[0].item()!r}")
    return t.to(dtype)


def reid_metrics(
    query_feats: ArrayLike,
    query_pids: ArrayLike,
    query_cams: ArrayLike,
    gallery_feats: ArrayLike,
    gallery_pids: ArrayLike,
    gallery_cams: ArrayLike,
    ranks: Sequence[int] = (1, 5, 10),
    chunk_size: int = 256,
) -> Dict[str, float]:
    """CMC and mAP of a query set against a gallery (see the module docstring).

    Args:
        query_feats: ``[Q, D]`` query features (need not be normalised).
        query_pids: ``[Q]`` person ids.
        query_cams: ``[Q]`` camera ids.
        gallery_feats: ``[G, D]``.
        gallery_pids: ``[G]`` person ids.
        gallery_cams: ``[G]`` camera ids.
        ranks: CMC ranks to report.
        chunk_size: queries ranked at once (bounds memory at ``chunk_size * G``).

    Returns:
        ``rank<k>`` for each ``k`` in ``ranks`` and ``mAP``, each in ``[0, 1]``
        and averaged over valid queries; ``num_valid_queries`` and
        ``num_skipped_queries``.

    Raises:
        ValueError: mismatched shapes, bad ``ranks``, or no query has a valid match.
    """
    qf = _as_tensor(query_feats, "query_feats", torch.float32)
    gf = _as_tensor(gallery_feats, "gallery_feats", torch.float32)
    qp = _as_tensor(query_pids, "query_pids", torch.int64).reshape(-1)
    qc = _as_tensor(query_cams, "query_cams", torch.int64).reshape(-1)
    gp = _as_tensor(gallery_pids, "gallery_pids", torch.int64).reshape(-1)
    gc = _as_tensor(gallery_cams, "gallery_cams", torch.int64).reshape(-1)
    if qf.ndim != 2 or gf.ndim != 2 or qf.shape[1] != gf.shape[1]:
        raise ValueError(
            "query_feats and gallery_feats must be [Q, D] and [G, D] with equal D, "
            f"got {tuple(qf.shape)} and {tuple(gf.shape)}"
        )
    if not len(qp) == len(qc) == len(qf):
        raise ValueError(f"query_pids ({len(qp)}) and query_cams ({len(qc)}) must match query_feats ({len(qf)})")
    if not len(gp) == len(gc) == len(gf):
        raise ValueError(f"gallery_pids ({len(gp)}) and gallery_cams ({len(gc)}) must match gallery_feats ({len(gf)})")
    check_finite("query_feats", qf)
    check_finite("gallery_feats", gf)
    if isinstance(ranks, (str, bytes)) or not all(
            not isinstance(k, bool) and isinstance(k, numbers.Integral) and k >= 1 for k in ranks):
        # int(1.5) made a rank1 column of a rank 1.5 asked for
        raise ValueError(f"ranks must be positive ints, got {ranks!r}")
    ranks = tuple(int(k) for k in ranks)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")

    qf = F.normalize(qf, dim=1)
    gf = F.normalize(gf, dim=1)
    num_gallery = len(gf)
    first_hit: List[torch.Tensor] = []
    aps: List[torch.Tensor] = []
    skipped = 0
    for start in range(0, len(qf), chunk_size):
        sim = qf[start : start + chunk_size] @ gf.t()  # [c, G]
        order = torch.sort(sim, dim=1, descending=True, stable=True).indices
        g_pid, g_cam = gp[order], gc[order]
        q_pid = qp[start : start + chunk_size, None]
        q_cam = qc[start : start + chunk_size, None]
        same_pid = g_pid == q_pid
        valid = (g_pid != JUNK_PID) & ~(same_pid & (g_cam == q_cam))
        match = same_pid & valid
        num_match = match.sum(1)
        ok = num_match > 0
        skipped += int((~ok).sum())
        if not ok.any():
            continue
        valid, match, num_match = valid[ok], match[ok], num_match[ok]
        position = valid.cumsum(1) - 1  # rank among the non-excluded gallery entries
        first_hit.append(torch.where(match, position, num_gallery).min(1).values)
        # Precision at every entry; only read at matches, where position >= 0
        # (the clamp just avoids 0/0 before the first non-excluded entry).
        precision = match.cumsum(1).double() / (position + 1).clamp(min=1).double()
        aps.append(torch.where(match, precision, 0.0).sum(1) / num_match.double())

    if not aps:
        raise ValueError(
            f"none of the {len(qf)} queries has a valid gallery match (same person, other camera, not junk)"
        )
    if skipped:
        logger.warning("reid_metrics: skipped %d of %d queries without a valid gallery match", skipped, len(qf))
    first = torch.cat(first_hit)
    out = {f"rank{k}": float((first < k).double().mean()) for k in ranks}
    out["mAP"] = float(torch.cat(aps).mean())
    out["num_valid_queries"] = float(len(first))
    out["num_skipped_queries"] = float(skipped)
    return out


class ReIDFolder(Dataset):
    """A flat folder of Market-1501 style images: ``dataset[i] -> (image, pid, camera)``.

    Images are found by extension, sorted by name, and resized to
    ``image_size`` (no augmentation; evaluation adds flips itself). Unlike the
    training datasets, a corrupt image raises
    :class:`~shardfc.data.CorruptImageError`: silently substituting another
    image would corrupt the metrics.

    Args:
        root: the folder (e.g. ``Market-1501/query``).
        image_size: ``(height, width)``, ``(256, 128)`` by re-ID convention.
        drop_junk: leave out junk images (pid -1), which no metric uses.

    Attributes:
        samples: ``(path, pid, camera)`` triples.
        pids, cams: int64 tensors of the person / camera ids.

    Raises:
        FileNotFoundError: ``root`` is not a directory.
        ValueError: no images, or a file name that does not parse.
    """

    def __init__(
        self,
        root: Union[str, "os.PathLike[str]"],
        image_size: Tuple[int, int] = (256, 128),
        drop_junk: bool = True,
    ) -> None:
        self.root = os.fspath(root)
        self.image_size = check_size(image_size)
        if not os.path.isdir(self.root):
            raise FileNotFoundError(f"ReIDFolder root {self.root!r} does not exist or is not a directory")
        self.samples: List[Tuple[str, int, int]] = []
        for name in sorted(os.listdir(self.root)):
            if name.startswith(".") or os.path.splitext(name)[1].lower() not in IMG_EXTENSIONS:
                continue
            pid, cam = parse_market1501_name(name)
            if drop_junk and pid == JUNK_PID:
                continue
            self.samples.append((os.path.join(self.root, name), pid, cam))
        if not self.samples:
            raise ValueError(f"ReIDFolder root {self.root!r} contains no usable images")
        self.pids = torch.tensor([s[1] for s in self.samples], dtype=torch.int64)
        self.cams = torch.tensor([s[2] for s in self.samples], dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, int, int]:
        path, pid, cam = self.samples[index]
        return image_to_tensor(decode_image(path, root=self.root), self.image_size), pid, cam

    def __repr__(self) -> str:
        return f"{type(self).__name__}(root={self.root!r}, images={len(self.samples)})"


def load_reid_split(
    root: Union[str, "os.PathLike[str]"],
    query_dir: str = "query",
    gallery_dir: str = "bounding_box_test",
    image_size: Tuple[int, int] = (256, 128),
) -> Tuple[ReIDFolder, ReIDFolder]:
    """``(query, gallery)`` :class:`ReIDFolder` s under a Market-1501 style ``root``."""
    return (
        ReIDFolder(os.path.join(os.fspath(root), query_dir), image_size),
        ReIDFolder(os.path.join(os.fspath(root), gallery_dir), image_size),
    )


def _embed_folder(
    model: nn.Module,
    folder: ReIDFolder,
    batch_size: int,
    flip: bool,
    device: Optional[Union[str, torch.device]],
    num_workers: int,
) -> torch.Tensor:
    loader = DataLoader(folder, batch_size=batch_size, shuffle=False, num_workers=num_workers)
    return embed_batches(model, _Images(loader), flip=flip, device=device)


class _Images:
    """The images of a loader's ``(images, pids, cams)`` batches, with the loader's length (a bar's end)."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        return (images for images, _, _ in self.loader)


def evaluate_reid(
    model: nn.Module,
    root: Union[str, "os.PathLike[str]"],
    query_dir: str = "query",
    gallery_dir: str = "bounding_box_test",
    image_size: Tuple[int, int] = (256, 128),
    batch_size: int = 64,
    flip: bool = True,
    device: Optional[Union[str, torch.device]] = None,
    num_workers: int = 0,
    ranks: Sequence[int] = (1, 5, 10),
) -> Dict[str, float]:
    """Embed a Market-1501 style split with ``model`` and compute :func:`reid_metrics`.

    Args:
        model: maps ``[B, 3, H, W]`` images to ``[B, D]`` features.
        root: folder holding ``query_dir`` and ``gallery_dir``.
        image_size: input ``(height, width)``.
        batch_size: images per forward pass.
        flip: add the features of the mirrored image.
        device: where to run; defaults to the model's device.
        num_workers: DataLoader workers for decoding.
        ranks: CMC ranks to report.
    """
    query, gallery = load_reid_split(root, query_dir, gallery_dir, image_size)
    qf = _embed_folder(model, query, batch_size, flip, device, num_workers)
    gf = _embed_folder(model, gallery, batch_size, flip, device, num_workers)
    return reid_metrics(qf, query.pids, query.cams, gf, gallery.pids, gallery.cams, ranks=ranks)
