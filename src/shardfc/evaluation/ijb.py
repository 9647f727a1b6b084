"""IJB-B / IJB-C 1:1 template verification, the protocol of insightface's ``eval_ijbc.py``.

Release layout (``ROOT`` as insightface distributes it; ``t`` is ``ijbb`` or ``ijbc``)::

    ROOT/meta/t_face_tid_mid.txt          "image_name template_id media_id", one line per face
    ROOT/meta/t_name_5pts_score.txt       "image_name x1 y1 ... x5 y5 detector_score", same order
    ROOT/meta/t_template_pair_label.txt   "template_id_1 template_id_2 label" (1: same identity)
    ROOT/loose_crop/<image_name>          the loose face crops the landmarks refer to

Each face is aligned to the ArcFace template by its 5 landmarks and embedded (plus its mirror
image, added: insightface's "F2"); its feature is kept unnormalised (the feature norm acts as a
quality weight, "N1") and multiplied by the detector score ("D1"). A template's feature is the
mean of its faces within each media (a video's frames count as one), summed over its media and
L2-normalised; a pair's score is the cosine of its two template features. The ROC is sklearn's
``roc_curve`` (collinear points dropped), and TAR at FAR = x is the TPR of the ROC point whose FPR
is nearest to x (the largest TPR among equally near ones), as insightface's table reports it.
Either protocol's TAR at FAR = x is NaN when there are fewer than ``1/x`` impostor pairs
(:func:`shardfc.evaluation.far.far_measurable`): the nearest ROC point would be FPR 0 and the
figure would measure nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset

from shardfc import files
from shardfc.data.transforms import decode_image, image_to_tensor, pil_to_tensor
from shardfc.evaluation.alignment import align_face
from shardfc.evaluation.far import far_measurable
from shardfc.evaluation.finite import check_finite
from shardfc.evaluation.verification import embed_batches, far_key, same_flags, tar_at_far
from shardfc.outputs import write_atomically

__all__ = [
    "IJB_TARGETS",
    "IJB_FARS",
    "IJBMeta",
    "read_ijb_meta",
    "template_features",
    "template_pair_scores",
    "roc_curve",
    "tar_at_nearest_far",
    "ijb_metrics",
    "AlignedFaces",
    "embed_ijb_faces",
    "evaluate_ijb",
    "write_ijb_report",
]

IJB_TARGETS = ("IJBB", "IJBC")
IJB_FARS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)


@dataclass
class IJBMeta:
    """The meta files of an IJB release, one row per face (``names``, ``templates``, ``medias``,
    ``landmarks`` ``[F, 5, 2]``, ``scores``) and one per template pair (``pairs`` ``[P, 2]``,
    ``labels``)."""

    root: Path
    target: str
    names: List[str]
    templates: np.ndarray
    medias: np.ndarray
    landmarks: np.ndarray
    scores: np.ndarray
    pairs: np.ndarray
    labels: np.ndarray


def _rows(path: Path, fields: int) -> Iterator[Tuple[int, List[str]]]:
    if not os.path.lexists(path):
        raise FileNotFoundError(f"IJB meta file not found: {str(path)!r}")
    # The gate: a regular file inside the release, UTF-8, each line at most files.MAX_LINE_BYTES.
    for number, line in files.iter_lines(path, "meta", "IJB meta file", root=path.parent.parent):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != fields:
            raise ValueError(f"{path}:{number}: expected {fields} fields, got {len(parts)}: {line.strip()[:200]!r}")
        yield number, parts


def _numbers(path: Path, number: int, texts: Sequence[str], kind=float) -> List:
    try:
        return [kind(t) for t in texts]
    except ValueError:
        raise ValueError(f"{path}:{number}: not a {kind.__name__}: {' '.join(texts)!r}") from None


def read_ijb_meta(root: Union[str, "os.PathLike[str]"], target: str = "IJBC") -> IJBMeta:
    """Read and cross-check the three meta files of ``root`` (see the module docstring).

    Raises:
        ValueError: an unknown ``target``, a malformed line (file and line named), the face
            lists of the two per-face files disagreeing, or a pair naming an unknown template.
        FileNotFoundError: a meta file is missing.
    """
    if target not in IJB_TARGETS:
        raise ValueError(f"target (shardfc eval --ijb-target) must be one of {', '.join(IJB_TARGETS)}, got {target!r}")
    root = Path(root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"root (shardfc eval --ijb) {str(root)!r} is not a folder")
    t = target.lower()
    meta = root / "meta"
    tid_mid = meta / f"{t}_face_tid_mid.txt"
    names, templates, medias = [], [], []
    for number, (name, tid, mid) in _rows(tid_mid, 3):
        if os.path.isabs(name) or ".." in Path(name).parts:  # faces are files of loose_crop/, nowhere else
            raise ValueError(f"{tid_mid}:{number}: face {name[:200]!r} is not a file name inside loose_crop/")
        names.append(name)
        tid_i, mid_i = _numbers(tid_mid, number, (tid, mid), int)
        templates.append(tid_i)
        medias.append(mid_i)
    lmk_file = meta / f"{t}_name_5pts_score.txt"
    landmarks, scores = [], []
    for number, parts in _rows(lmk_file, 12):
        i = len(scores)
        if i >= len(names) or parts[0] != names[i]:
            expected = names[i] if i < len(names) else "(no such face)"
            raise ValueError(
                f"{lmk_file}:{number}: face {parts[0]!r} but line {i + 1} of {tid_mid.name} is {expected!r}; "
                "the two files must list the same faces in the same order"
            )
        values = _numbers(lmk_file, number, parts[1:])
        landmarks.append(values[:10])
        scores.append(values[10])
    if len(scores) != len(names):
        raise ValueError(f"{lmk_file} lists {len(scores)} faces, {tid_mid} lists {len(names)}")
    pair_file = meta / f"{t}_template_pair_label.txt"
    pairs, labels = [], []
    for number, parts in _rows(pair_file, 3):
        t1, t2, label = _numbers(pair_file, number, parts, int)
        if label not in (0, 1):
            raise ValueError(f"{pair_file}:{number}: label must be 0 or 1, got {label}")
        pairs.append((t1, t2))
        labels.append(label)
    if not pairs:
        raise ValueError(f"{pair_file} holds no template pairs")
    templates_arr = np.asarray(templates, dtype=np.int64)
    pairs_arr = np.asarray(pairs, dtype=np.int64)
    unknown = np.setdiff1d(pairs_arr, templates_arr)
    if unknown.size:
        raise ValueError(f"{pair_file} names templates without faces in {tid_mid.name}: {unknown[:10].tolist()}")
    return IJBMeta(
        root, target, names, templates_arr, np.asarray(medias, dtype=np.int64),
        np.asarray(landmarks, dtype=np.float64).reshape(-1, 5, 2), np.asarray(scores, dtype=np.float64),
        pairs_arr, np.asarray(labels, dtype=np.int64),
    )


# --------------------------------------------------------------------- templates and scores
def template_features(
    face_features: np.ndarray, templates: np.ndarray, medias: np.ndarray
) -> Tuple[np.ndarray, np.ndarray]:
    """``(features [T, D] L2-normalised, template ids [T] ascending)``: per template, the mean
    of its faces in each media, summed over its media."""
    feats = np.asarray(face_features)  # summed into float64 below, whatever its dtype
    ids, template_of_face = np.unique(templates, return_inverse=True)
    # One group per (template, media): its mean; then the groups of a template are summed.
    keys = np.stack([template_of_face, np.asarray(medias)], axis=1)
    groups, group_of_face, counts = np.unique(keys, axis=0, return_inverse=True, return_counts=True)
    group_of_face = group_of_face.reshape(-1)
    group_sums = np.zeros((len(groups), feats.shape[1]))
    np.add.at(group_sums, group_of_face, feats)
    out = np.zeros((len(ids), feats.shape[1]))
    np.add.at(out, groups[:, 0], group_sums / counts[:, None])
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    return out / np.where(norms == 0, 1.0, norms), ids


def template_pair_scores(features: np.ndarray, ids: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """Cosine similarity of each template pair ``[P, 2]`` (features already normalised)."""
    row = np.searchsorted(ids, pairs)
    return np.sum(features[row[:, 0]] * features[row[:, 1]], axis=1)


def roc_curve(labels: np.ndarray, scores: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(fpr, tpr, thresholds)`` over decreasing score thresholds, starting at ``(0, 0, inf)``;
    points in the middle of a straight run of the curve are dropped (sklearn's default)."""
    scores, labels = _scored_pairs(scores, labels)
    return _roc(labels, scores)


def _roc(labels: np.ndarray, scores: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`roc_curve` of pairs :func:`_scored_pairs` has checked (bool labels, float64 scores)."""
    if labels.all() or not labels.any():
        raise ValueError("the template pairs need both genuine (label 1) and impostor (label 0) pairs for a ROC")
    order = np.argsort(-scores)  # any sort: only each run of equal scores' last position is read
    s, y = scores[order], labels[order]
    last_of_value = np.r_[np.nonzero(np.diff(s))[0], len(s) - 1]
    tps = np.cumsum(y)[last_of_value].astype(np.float64)
    fps = (1 + last_of_value) - tps
    thresholds = s[last_of_value]
    if len(fps) > 2:
        keep = np.r_[True, np.logical_or(np.diff(fps, 2), np.diff(tps, 2)), True]
        fps, tps, thresholds = fps[keep], tps[keep], thresholds[keep]
    fps, tps, thresholds = np.r_[0.0, fps], np.r_[0.0, tps], np.r_[np.inf, thresholds]
    return fps / fps[-1], tps / tps[-1], thresholds


def _scored_pairs(scores, labels) -> Tuple[np.ndarray, np.ndarray]:
    """``(scores as float64, labels as bool)``, one each a pair: finite scores (a NaN sorts anywhere:
    the ROC of a broken model read as a coin's), labels booleans or 0/1 (a 2 was a genuine pair)."""
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    labels = same_flags(labels, "labels")
    if len(scores) != len(labels):
        raise ValueError(f"scores ({len(scores)}) and labels ({len(labels)}) must have one entry a pair")
    bad = np.flatnonzero(~np.isfinite(scores))
    if len(bad):
        raise ValueError(f"scores holds NaN or inf at {len(bad)} of {len(scores)} pairs (the first: pair {bad[0]}): "
                         "the model's outputs overflowed or diverged, and no ROC of them means anything")
    return scores, labels


def tar_at_nearest_far(fpr: np.ndarray, tpr: np.ndarray, far: float) -> float:
    """TPR of the ROC point whose FPR is nearest ``far``; among equally near points the last
    (largest TPR), as insightface's table picks it."""
    gap = np.abs(fpr - far)
    return float(tpr[len(gap) - 1 - int(np.argmin(gap[::-1]))])


def ijb_metrics(scores: np.ndarray, labels: np.ndarray, fars: Sequence[float] = IJB_FARS) -> Dict[str, float]:
    """``tar@far=<far>`` (insightface's nearest ROC point), ``exact_tar@far=<far>`` (largest TAR
    with FAR <= far over all pairs), both NaN with fewer than ``1/far`` impostor pairs; ``auc``,
    ``num_pairs``, ``num_negative_pairs``."""
    if isinstance(fars, (str, bytes)):  # "1e-4" would be iterated into "1", "e", ...
        raise ValueError(f"fars must be numbers, got the string {fars!r}")
    keys = [far_key(far) for far in fars]  # each target checked before the work
    scores, same = _scored_pairs(scores, labels)
    fpr, tpr, _ = _roc(same, scores)  # checked once, above
    trapezoid = getattr(np, "trapezoid", None) or np.trapz  # numpy < 2 names it trapz
    out: Dict[str, float] = {"auc": float(trapezoid(tpr, fpr)), "num_pairs": float(len(scores))}
    negatives = int(np.count_nonzero(~same))
    out["num_negative_pairs"] = float(negatives)
    for far, key in zip(fars, keys):
        out[f"tar@far={key}"] = tar_at_nearest_far(fpr, tpr, far) if far_measurable(negatives, far) else float("nan")
        out[f"exact_tar@far={key}"] = tar_at_far(scores, same, far)[0]
    return out


# --------------------------------------------------------------------- embedding
class AlignedFaces(Dataset):
    """The faces of an IJB release, aligned and normalised: item ``i`` is a float tensor
    ``[3, H, W]`` in ``[-1, 1]`` (the aligned 112x112 crop, resized to ``image_size`` if that differs)."""

    def __init__(self, meta: IJBMeta, image_size: Tuple[int, int] = (112, 112)) -> None:
        self.meta = meta
        self.image_size = (int(image_size[0]), int(image_size[1]))

    def __len__(self) -> int:
        return len(self.meta.names)

    def __getitem__(self, i: int) -> torch.Tensor:
        folder = self.meta.root / "loose_crop"
        path = folder / self.meta.names[i]  # a name that is absolute or climbs out is refused below
        if not os.path.lexists(path):
            raise FileNotFoundError(f"IJB face image not found: {str(path)!r}")
        face = align_face(pil_to_tensor(decode_image(str(path), root=folder)), self.meta.landmarks[i])
        return image_to_tensor(Image.fromarray(face.permute(1, 2, 0).numpy()), self.image_size)


def _one_thread(_: int) -> None:
    torch.set_num_threads(1)  # workers run many small ops: threads would only contend


@torch.no_grad()
def embed_ijb_faces(
    model: nn.Module,
    meta: IJBMeta,
    batch_size: int = 64,
    flip: bool = True,
    device: Optional[Union[str, torch.device]] = None,
    image_size: Tuple[int, int] = (112, 112),
    workers: int = 0,
) -> np.ndarray:
    """Aligned, embedded faces ``[F, D]`` (float64, unnormalised; with ``flip`` the mirror
    image's embedding added). ``workers`` DataLoader processes decode and align."""
    loader = DataLoader(
        AlignedFaces(meta, image_size), batch_size=batch_size, shuffle=False, num_workers=workers,
        worker_init_fn=_one_thread if workers else None,
    )
    return embed_batches(model, loader, flip=flip, device=device).double().numpy()


def evaluate_ijb(
    model: nn.Module,
    root: Union[str, "os.PathLike[str]"],
    target: str = "IJBC",
    batch_size: int = 64,
    flip: bool = True,
    norm_score: bool = True,
    detector_score: bool = True,
    device: Optional[Union[str, torch.device]] = None,
    meta: Optional[IJBMeta] = None,
    image_size: Tuple[int, int] = (112, 112),
    workers: int = 0,
) -> Tuple[Dict[str, float], np.ndarray, IJBMeta]:
    """Run the protocol on ``root``: ``(metrics, pair scores, meta)``.

    ``norm_score=False`` L2-normalises each face feature before pooling (insightface's "N0"),
    ``detector_score=False`` ignores the detector scores ("D0").
    """
    meta = read_ijb_meta(root, target) if meta is None else meta
    feats = embed_ijb_faces(model, meta, batch_size, flip, device, image_size, workers)
    check_finite(f"{target}'s face features", feats)
    if not norm_score:
        norms = np.linalg.norm(feats, axis=1, keepdims=True)
        feats = feats / np.where(norms == 0, 1.0, norms)
    if detector_score:
        feats = feats * meta.scores[:, None]
    features, ids = template_features(feats, meta.templates, meta.medias)
    scores = template_pair_scores(features, ids, meta.pairs)
    return ijb_metrics(scores, meta.labels), scores, meta


def write_ijb_report(out_dir: Union[str, "os.PathLike[str]"], target: str, scores: np.ndarray, labels: np.ndarray) -> List[Path]:
    """``<t>_scores.npy``, ``<t>_roc.csv`` (fpr, tpr, threshold) and, with matplotlib, ``<t>_roc.png``;
    each written whole through a scratch file beside it, or not at all (a crash never leaves a
    half-written report over the previous one: :func:`shardfc.outputs.write_atomically`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t = target.lower()
    written = [out / f"{t}_scores.npy", out / f"{t}_roc.csv"]

    def save_scores(scratch: Path) -> None:
        with open(scratch, "wb") as f:  # np.save given a name would add ".npy" to the scratch name
            np.save(f, np.asarray(scores), allow_pickle=False)

    write_atomically(written[0], save_scores)
    fpr, tpr, thr = roc_curve(labels, scores)
    write_atomically(written[1], lambda scratch: np.savetxt(
        scratch, np.stack([fpr, tpr, thr], axis=1), delimiter=",", header="fpr,tpr,threshold", comments=""))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.plot(fpr[1:], tpr[1:], lw=1)
    ax.set(xscale="log", xlim=(1e-6, 1e-1), ylim=(0.3, 1.0), xlabel="False accept rate", ylabel="True accept rate",
           title=f"ROC on {target}")
    ax.grid(linestyle="--")
    try:  # the scratch name has no .png: the format is named
        write_atomically(out / f"{t}_roc.png", lambda scratch: fig.savefig(scratch, format="png", dpi=100, bbox_inches="tight"))
    finally:
        plt.close(fig)
    return written + [out / f"{t}_roc.png"]
