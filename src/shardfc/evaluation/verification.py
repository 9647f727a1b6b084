"""Face verification: insightface ``.bin`` pair sets (LFW, CFP-FP, AgeDB-30, ...) and metrics.

Two protocols are reported side by side on the same embeddings:

* insightface's (the headline ``accuracy`` and ``tar@far=...``): squared distances of the
  normalised embeddings, thresholds on a fixed grid, first best threshold, TAR@FAR interpolated
  per fold, exactly as insightface's ``eval/verification.py`` computes them, so the numbers
  compare with its logs; see :mod:`shardfc.evaluation.insightface_protocol`;
* the exact one (keys prefixed ``exact_``): a pair's score is the cosine similarity, predicted
  "same" when ``score > threshold``; accuracy is 10-fold cross-validated over the same contiguous
  folds with the threshold searched over *every* split of the training scores (no grid);
  TAR@FAR uses all pairs at once: the threshold is the smallest one whose false-accept rate over
  the negative pairs is ``<= far``.
"""

from __future__ import annotations

import math
import os
import pickle
import struct
from typing import BinaryIO, Dict, Iterable, Optional, Sequence, Sized, Tuple, Union

import numpy as np
import torch
from torch import nn

from shardfc import files
from shardfc.data.transforms import decode_image, image_to_tensor
from shardfc.evaluation.far import far_measurable, why_undefined
from shardfc.evaluation.finite import check_finite
from shardfc.evaluation.folds import NFOLDS, kfold_indices
from shardfc.evaluation.insightface_protocol import insightface_metrics, normalized_squared_distances
from shardfc.progress import labelled_bar

__all__ = [
    "load_bin",
    "kfold_indices",
    "best_threshold",
    "far_measurable",
    "same_flags",
    "why_undefined",
    "tar_at_far",
    "verification_metrics",
    "embed_batches",
    "embed_images",
    "evaluate_verification",
]

ArrayLike = Union[torch.Tensor, np.ndarray, Sequence[float]]


# --------------------------------------------------------------------- loading
class _BinUnpickler(pickle.Unpickler):
    """Unpickler for ``.bin`` files that only admits the types they contain.

    ``.bin`` files are pickles, and an arbitrary pickle can execute code; the
    real files hold only builtins (lists, bytes, bools) and possibly numpy
    arrays, so every other global is refused.
    """

    _ALLOWED = {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy", "bool_"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy.core.numeric", "_frombuffer"),  # numpy's pickle protocol 5 path
        ("numpy._core.numeric", "_frombuffer"),
        ("builtins", "bytearray"),
        ("__builtin__", "bytearray"),
        ("_codecs", "encode"),  # how Python 3 pickles bytes for protocol <= 2 readers
    }

    def __init__(self, file: BinaryIO, path: str, size: int) -> None:
        super().__init__(file, encoding="bytes")  # .bin files were written by Python 2
        self._path = path
        self._size = size  # the file's length: no constructor may build more bytes than it holds

    def _bounded(self, what: str, nbytes: int) -> None:
        if nbytes > self._size:
            raise pickle.UnpicklingError(
                f"{self._path!r} ({self._size} bytes) asks {what} for {nbytes} bytes, more than the file holds: "
                "a verification .bin only holds its encoded images"
            )

    def _items(self, shape: object, dtype: object) -> int:
        """The bytes of an array of ``shape`` and ``dtype``, before numpy allocates them."""
        dims = shape if isinstance(shape, (tuple, list)) else (shape,)
        if not all(isinstance(d, int) and d >= 0 for d in dims):
            raise pickle.UnpicklingError(f"{self._path!r}: an array shape {shape!r} that is not non-negative ints")
        try:  # (numpy reads a dtype given as bytes, as a Python 2 pickle holds it, itself)
            itemsize = np.dtype(dtype).itemsize
        except (TypeError, ValueError):
            itemsize = 1
        return math.prod(dims) * max(itemsize, 1)

    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(
                f"refusing to unpickle global {module}.{name} from {self._path!r}: "
                "a verification .bin should contain only encoded images and a bool list"
            )
        found = super().find_class(module, name)
        # The constructors that take a size: each checked against the file's length before it runs.
        if name == "bytearray":
            def guarded_bytearray(*args):
                if args and isinstance(args[0], int):
                    self._bounded("bytearray", args[0])
                return found(*args)
            return guarded_bytearray
        if name == "_reconstruct":
            # Its class argument is whatever the pickle named: ndarray is the only array type admitted
            # (as the guard below), so the array is built as one whatever was passed.
            def guarded_reconstruct(cls, shape, dtype):
                self._bounded("an array", self._items(shape, dtype))
                return found(np.ndarray, shape, dtype)
            return guarded_reconstruct
        if name == "ndarray":  # called directly (ndarray(shape, dtype[, buffer...])): REDUCE passes no keywords
            def guarded_ndarray(shape, dtype=float, *args):
                self._bounded("an array", self._items(shape, dtype))
                return np.ndarray(shape, dtype, *args)
            return guarded_ndarray
        return found


class _ReadWithin:
    """A file as :mod:`pickletools` reads it, refusing a read of more bytes than remain: a counted
    opcode (``BINBYTES8``, ``BINUNICODE8``, ...) may declare up to 2^64 bytes in a file of a few,
    and the C unpickler allocates what an opcode declares before it reads."""

    def __init__(self, f: BinaryIO, path: str, size: int) -> None:
        self._f, self._path, self._size = f, path, size

    def read(self, n: int = -1) -> bytes:
        if n is not None and n > self._size - self._f.tell():
            raise pickle.UnpicklingError(
                f"{self._path!r} ({self._size} bytes) declares a value of {n} bytes, more than the file holds")
        return self._f.read(n)

    def readline(self) -> bytes:
        return self._f.readline()


def _check_declared_sizes(f: BinaryIO, path: str, size: int) -> None:
    """Walk the pickle's opcodes (no object is built) and refuse one that declares more bytes than
    the file holds, before the unpickler allocates them; a pickle malformed otherwise is left to it."""
    import pickletools

    try:
        for _ in pickletools.genops(_ReadWithin(f, path, size)):
            pass
    except pickle.UnpicklingError:
        raise
    except Exception:  # malformed: the unpickler's own error names it
        pass
    f.seek(0)


def load_bin(
    path: Union[str, "os.PathLike[str]"],
    image_size: Tuple[int, int] = (112, 112),
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Load an insightface verification ``.bin`` file.

    The file is a pickle of ``(bins, issame_list)``: ``bins`` holds ``2N``
    encoded images (JPEG/PNG ``bytes``, or uint8 numpy arrays), pair ``i``
    being images ``2i`` and ``2i + 1``; ``issame_list`` holds ``N`` booleans.

    Args:
        path: the ``.bin`` file.
        image_size: output ``(height, width)``; images are resized if needed.

    Returns:
        ``images`` float32 ``[2N, 3, H, W]`` in ``[-1, 1]`` and ``issame`` bool ``[N]``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the pickle does not have the expected structure.
        shardfc.data.CorruptImageError: an image does not decode (named ``"<path>[index]"``).
    """
    path = os.fspath(path)
    try:  # the gate: a regular file of at most 4 GiB (SHARDFC_MAX_BIN_BYTES)
        f = files.open_file(path, "bin", "verification .bin")
    except files.FileMissing:
        raise FileNotFoundError(f"verification bin file not found: {path!r}") from None
    with f:
        try:
            size = os.fstat(f.fileno()).st_size
            _check_declared_sizes(f, path, size)
            obj = _BinUnpickler(f, path, size).load()
        # Garbage bytes fail in many ways inside the unpickler, not only as UnpicklingError.
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
                struct.error, MemoryError, RecursionError, OverflowError) as exc:
            raise ValueError(f"{path!r} is not a readable verification .bin pickle: {' '.join(str(exc).split())[:300]}") from None
    if not (isinstance(obj, (tuple, list)) and len(obj) == 2):
        raise ValueError(f"{path!r}: expected a pickled (bins, issame_list) pair, got {type(obj).__name__}")
    bins, issame_list = obj
    issame = torch.as_tensor(np.asarray(issame_list, dtype=bool).reshape(-1))
    if len(bins) != 2 * len(issame):
        raise ValueError(
            f"{path!r}: {len(bins)} images for {len(issame)} pairs; expected exactly 2 images per pair"
        )
    _check_decoded_size(path, bins, image_size, size)
    h, w = image_size
    images = torch.empty(len(bins), 3, h, w, dtype=torch.float32)
    for i, data in enumerate(bins):
        if isinstance(data, str):  # a latin-1 str from a pickle loaded without encoding='bytes'
            data = data.encode("latin-1")
        images[i] = image_to_tensor(decode_image(data, name=f"{path}[{i}]"), image_size)
    return images, issame


#: The decoded images of a ``.bin`` may take at most this many times its size on disk (float32
#: ``[3, H, W]`` each): an insightface set of JPEGs at 112 x 112 takes about 30 times, a crafted one
#: that names one image 200,000 times (a pickle memo reference is a few bytes) would take 60,000.
MAX_DECODED_RATIO = 1024
#: ... or this many bytes, whichever is more (a small set of tiny PNGs).
MIN_DECODED_CAP = 64 << 20


def _check_decoded_size(path: str, bins: Sequence[object], image_size: Tuple[int, int], on_disk: int) -> None:
    """Refuse a ``.bin`` whose images would decode to more than :data:`MAX_DECODED_RATIO` times its size
    (and more than :data:`MIN_DECODED_CAP`), or that holds one image object more than once (real sets
    hold each image once), before decoding."""
    distinct = len({id(b) for b in bins}) if isinstance(bins, (list, tuple)) else len(bins)
    if distinct != len(bins):
        raise ValueError(f"{path!r} refers to the same encoded image more than once ({len(bins)} images, "
                         f"{distinct} distinct): not an insightface verification set")
    h, w = image_size
    decoded = len(bins) * 3 * h * w * 4
    if decoded > max(MAX_DECODED_RATIO * on_disk, MIN_DECODED_CAP):
        raise ValueError(
            f"{path!r} ({on_disk} bytes) holds {len(bins)} images, {decoded / 2**30:.1f} GiB decoded at {h} x {w}: "
            f"more than {MAX_DECODED_RATIO} times its size, which encoded images never are"
        )


# --------------------------------------------------------------------- metrics
def _to_numpy(x: ArrayLike) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        return (x.double() if x.is_floating_point() else x).numpy()
    return np.asarray(x)


def same_flags(issame: ArrayLike, name: str = "issame") -> np.ndarray:
    """``issame`` (a pair list's "same identity?" answers, named ``name`` in errors) as a flat bool
    array: booleans, or 0/1 (a 2 or a 0.5 is no answer to "same?", and ``astype(bool)`` would have
    taken either as True)."""
    same = _to_numpy(issame).reshape(-1)
    if same.dtype != bool:
        odd = same[(same != 0) & (same != 1)]  # a string or None is neither, as numpy compares them
        if len(odd):
            raise ValueError(f"{name} must hold booleans (or 0 and 1), got {odd.tolist()[0]!r} ({same.dtype})")
    return same.astype(bool)


def best_threshold(scores: np.ndarray, issame: np.ndarray) -> Tuple[float, float]:
    """Threshold maximising the accuracy of ``score > threshold`` on these pairs.

    Candidates are the midpoints between consecutive distinct sorted scores,
    plus one just below the minimum (all "same") and one just above the
    maximum (all "different"), so every distinct split of the sorted scores
    is considered exactly once. Ties go to the lowest threshold.

    Returns:
        ``(threshold, accuracy)``.
    """
    order = np.argsort(scores)  # any sort: a split inside a run of equal scores is not considered below
    s = scores[order]
    y = issame[order].astype(np.int64)
    n = len(s)
    # Split k predicts "different" for s[:k] and "same" for s[k:].
    correct = np.concatenate([[0], np.cumsum(1 - y)]) + (y.sum() - np.concatenate([[0], np.cumsum(y)]))
    valid = np.ones(n + 1, dtype=bool)
    valid[1:n] = s[1:] != s[:-1]  # a split inside a run of equal scores is not realisable
    k = int(np.argmax(np.where(valid, correct, -1)))
    if k == 0:
        thr = float(np.nextafter(s[0], -np.inf))
    elif k == n:
        thr = float(np.nextafter(s[-1], np.inf))
    else:
        thr = float((s[k - 1] + s[k]) / 2)
        if thr >= s[k]:  # scores one float step apart: the midpoint rounds up onto s[k]
            thr = float(s[k - 1])  # s[k - 1] is not > itself, s[k] is: the same split
    return thr, float(correct[k]) / n


def far_key(far: float) -> str:
    """``1e-3 -> "1e-3"``, ``5e-4 -> "5e-4"``, ``0.015 -> "1.5e-2"``; a target outside ``(0, 1)`` is
    a ValueError naming it (NaN had no exponent to split)."""
    far = _far_target(far)
    mantissa, exponent = f"{far:e}".split("e")
    mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{int(exponent)}"


def _far_target(far: float) -> float:
    far = float(far)
    if not 0.0 < far < 1.0:
        raise ValueError(f"far target must be in (0, 1), got {far!r}")
    return far


def tar_at_far(scores: np.ndarray, issame: np.ndarray, far: float) -> Tuple[float, float, float]:
    """True-accept rate at false-accept rate ``<= far``, over all pairs.

    With negatives sorted in decreasing order, the threshold is the
    ``floor(far * n_neg)``-th (0-based) largest negative score, so at most
    ``floor(far * n_neg)`` negatives score strictly above it (fewer with ties):
    the smallest such threshold, hence the largest TAR.

    Returns:
        ``(tar, achieved_far, threshold)``; all NaN when ``far * n_neg < 1``,
        i.e. there are too few negative pairs to measure that FAR (the estimate
        would silently become "FAR = 0").
    """
    far = _far_target(far)
    neg = np.sort(scores[~issame])[::-1]
    pos = scores[issame]
    if not far_measurable(len(neg), far) or len(pos) == 0:
        return math.nan, math.nan, math.nan
    thr = float(neg[int(math.floor(far * len(neg)))])
    return float(np.mean(pos > thr)), float(np.mean(neg > thr)), thr


def verification_metrics(
    embeddings_a: ArrayLike,
    embeddings_b: ArrayLike,
    issame: ArrayLike,
    nfolds: int = NFOLDS,
    far_targets: Iterable[float] = (1e-3, 1e-4),
) -> Dict[str, float]:
    """Verification metrics of paired embeddings under both protocols (see the module docstring).

    Args:
        embeddings_a: ``[N, D]`` embeddings of the first side of each pair (need not be
            normalised).
        embeddings_b: ``[N, D]`` embeddings of the second side.
        issame: bool ``[N]``.
        nfolds: cross-validation folds.
        far_targets: FAR values to report TAR at.

    Returns:
        insightface's protocol: ``accuracy`` (mean over folds), ``accuracy_std``,
        ``best_distance_threshold`` (mean over folds, a squared distance), and for each ``far``
        (key written like ``1e-3``) ``tar@far=<far>`` (mean over folds), ``tar_std@far=<far>``
        and ``far@far=<far>`` (the mean held-out FAR reached).
        The exact protocol: ``exact_accuracy``, ``exact_accuracy_std``, ``exact_best_threshold``
        (mean over folds, a cosine similarity), ``exact_tar@far=<far>``,
        ``exact_achieved_far@far=<far>`` and ``exact_threshold@far=<far>`` over all pairs.
        And ``num_pairs``, ``num_negative_pairs``.
        Every ``...@far=<far>`` value of either protocol is NaN when the set has fewer than
        ``1/far`` negative pairs (:func:`far_measurable`; :func:`why_undefined` says so in words):
        500 negatives cannot measure a FAR of 1e-4.
    """
    a = _to_numpy(embeddings_a).astype(np.float64)
    b = _to_numpy(embeddings_b).astype(np.float64)
    same = same_flags(issame)
    if a.ndim != 2 or a.shape != b.shape:
        raise ValueError(
            f"embeddings_a and embeddings_b must both be [N, D] with equal shapes, got {a.shape} and {b.shape}"
        )
    if len(same) != len(a):
        raise ValueError(f"issame has {len(same)} entries for {len(a)} embedding pairs")
    check_finite("embeddings_a", a)
    check_finite("embeddings_b", b)
    if isinstance(far_targets, (str, bytes)):  # "0.1" was read as the targets "0", ".", "1"
        raise ValueError(f"far_targets must be numbers, got the string {far_targets!r}")
    far_targets = [_far_target(f) for f in far_targets]  # all refused before any is computed
    keyed = [(far_key(far), far) for far in far_targets]
    out = insightface_metrics(normalized_squared_distances(a, b), same, nfolds, keyed)

    eps = 1e-12  # zero embeddings get similarity 0 rather than NaN
    a /= np.maximum(np.linalg.norm(a, axis=1, keepdims=True), eps)
    b /= np.maximum(np.linalg.norm(b, axis=1, keepdims=True), eps)
    scores = np.sum(a * b, axis=1)
    accs, thrs = [], []
    for train, test in kfold_indices(len(scores), nfolds):
        thr, _ = best_threshold(scores[train], same[train])
        thrs.append(thr)
        accs.append(float(np.mean((scores[test] > thr) == same[test])))
    out.update({
        "exact_accuracy": float(np.mean(accs)),
        "exact_accuracy_std": float(np.std(accs)),
        "exact_best_threshold": float(np.mean(thrs)),
        "num_pairs": float(len(scores)),
        "num_negative_pairs": float(np.count_nonzero(~same)),
    })
    for key, far in keyed:
        tar, achieved, thr = tar_at_far(scores, same, far)
        out[f"exact_tar@far={key}"] = tar
        out[f"exact_achieved_far@far={key}"] = achieved
        out[f"exact_threshold@far={key}"] = thr
    return out


# ------------------------------------------------------------------ embedding
def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


@torch.no_grad()
def embed_batches(
    model: nn.Module,
    batches: Iterable[torch.Tensor],
    flip: bool = True,
    device: Optional[Union[str, torch.device]] = None,
) -> torch.Tensor:
    """Embed an iterable of image batches ``[B, 3, H, W]`` -> float32 ``[N, D]`` on CPU.

    With ``flip``, each embedding is ``model(x) + model(flip(x))`` (the
    insightface test-time augmentation; normalisation happens in the metric).
    The model runs in eval mode and its previous mode is restored.
    """
    dev = torch.device(device) if device is not None else _model_device(model)
    # Restore each submodule's own mode afterwards (a model may keep e.g.
    # frozen BatchNorm layers in eval mode while training).
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    total = len(batches) if isinstance(batches, Sized) else None
    try:
        out = []
        for x in labelled_bar(batches, total):  # a bar under shardfc eval's label only (shardfc.progress)
            x = x.to(dev, non_blocking=True)
            emb = model(x)
            if flip:
                emb = emb + model(x.flip(-1))
            out.append(emb.float().cpu())
    finally:
        for m, training in modes:
            m.training = training
    if not out:
        raise ValueError("embed_batches got no batches")
    return torch.cat(out)


def embed_images(
    model: nn.Module,
    images: torch.Tensor,
    batch_size: int = 64,
    flip: bool = True,
    device: Optional[Union[str, torch.device]] = None,
) -> torch.Tensor:
    """Embed a tensor of images ``[N, 3, H, W]`` in batches (see :func:`embed_batches`)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
    return embed_batches(model, images.split(batch_size), flip=flip, device=device)


def evaluate_verification(
    model: nn.Module,
    images: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
    issame: ArrayLike,
    batch_size: int = 64,
    flip: bool = True,
    device: Optional[Union[str, torch.device]] = None,
    nfolds: int = NFOLDS,
    far_targets: Iterable[float] = (1e-3, 1e-4),
) -> Dict[str, float]:
    """Embed verification pairs with ``model`` and compute :func:`verification_metrics`.

    Args:
        model: maps ``[B, 3, H, W]`` images to ``[B, D]`` embeddings.
        images: interleaved ``[2N, 3, H, W]`` (pair ``i`` = rows ``2i, 2i+1``,
            as returned by :func:`load_bin`), or a tuple ``(images_a, images_b)``
            of ``[N, 3, H, W]`` (as returned by
            :meth:`shardfc.data.SyntheticIdentities.verification_pairs`).
        issame: bool ``[N]``.
        batch_size: images per forward pass.
        flip: add the embedding of the mirrored image.
        device: where to run; defaults to the model's device.
    """
    if isinstance(images, (tuple, list)):
        images_a, images_b = images
        emb_a = embed_images(model, images_a, batch_size, flip, device)
        emb_b = embed_images(model, images_b, batch_size, flip, device)
    else:
        if images.shape[0] % 2:
            raise ValueError(f"interleaved images must have an even count, got {images.shape[0]}")
        emb = embed_images(model, images, batch_size, flip, device)
        emb_a, emb_b = emb[0::2], emb[1::2]
    return verification_metrics(emb_a, emb_b, issame, nfolds=nfolds, far_targets=far_targets)

