"""Image decoding and the tensor transform shared by all datasets.

Every image that enters a model goes through :func:`image_to_tensor`: an RGB
Pillow image becomes a float32 tensor ``[3, H, W]`` normalised to ``[-1, 1]``
with ``(x / 255 - 0.5) / 0.5``, the convention of insightface's arcface_torch
(and of the pretrained face models trained with it).
"""

from __future__ import annotations

import io
import math
import os
import re
import struct
from typing import Optional, Tuple, Union

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from shardfc import files
from shardfc.checks import check_probability

__all__ = [
    "CorruptImageError",
    "as_rgb",
    "ImageSource",
    "decode_image",
    "MAX_IMAGE_PIXELS",
    "max_image_pixels",
    "pil_to_tensor",
    "normalize",
    "image_to_tensor",
    "ImageTransform",
    "random_erase_",
]

#: What :func:`decode_image` accepts: a filesystem path or the encoded bytes.
ImageSource = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, np.ndarray]


class CorruptImageError(ValueError):
    """An image file or buffer that Pillow cannot decode.

    ``path`` names the offending file (or a description such as
    ``"lfw.bin[17]"`` for in-memory buffers) so that it can be found and removed.
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"cannot decode image {path!r}: {reason}")
        self.path = path
        self.reason = reason


def _as_bytes(data: Union[bytes, bytearray, memoryview, np.ndarray]) -> bytes:
    if isinstance(data, np.ndarray):
        # insightface .bin files written via numpy hold the encoded file as a uint8 array.
        if data.dtype != np.uint8 and data.dtype.kind not in ("S", "V"):
            raise TypeError(f"encoded image array must have dtype uint8, got {data.dtype}")
        return data.tobytes()
    return bytes(data)


#: The most pixels an image may declare before it is decoded (width x height): 2048 x 2048. The data
#: sets shardfc reads hold 112 x 112 faces (MS1M, Glint360K, WebFace, the .bin sets), 256 x 128
#: re-ID crops (Market-1501) and IJB's loose crops (a few hundred pixels a side); 4 Mpx is 300 times
#: the largest and decodes in milliseconds, where Pillow's own bomb limit (89 Mpx, 268 MB of RGB)
#: would let one file stall a worker. ``SHARDFC_MAX_IMAGE_PIXELS`` raises it for larger images.
MAX_IMAGE_PIXELS = 2048 * 2048


def max_image_pixels() -> int:
    """:data:`MAX_IMAGE_PIXELS`, or ``SHARDFC_MAX_IMAGE_PIXELS`` when set (read per call, so that
    DataLoader workers see the parent's value)."""
    return files.env_limit("SHARDFC_MAX_IMAGE_PIXELS", MAX_IMAGE_PIXELS)


def as_rgb(img: Image.Image, name: str = "<image>") -> Image.Image:
    """``img`` as an 8-bit RGB image. A 16-bit grayscale image (``I;16``: PNG, TIFF) is scaled to 8
    bits (Pillow's own conversion clips it: any value past 255 became white); 32-bit integer or
    float pixels (``I``, ``F``) have no range that says which value is black or white, so they are
    a :class:`CorruptImageError` naming ``name`` (a data set skips and counts it) rather than a guess."""
    if img.mode.startswith("I;16"):
        wide = np.asarray(img).astype(np.uint32)  # any byte order
        return Image.fromarray(((wide * 255 + 32767) // 65535).astype(np.uint8)).convert("RGB")  # uint8 2-D: "L"
    if img.mode in ("I", "F"):
        kind = "integers" if img.mode == "I" else "floats"
        raise CorruptImageError(name, f"its pixels are 32-bit {kind} (mode {img.mode!r}), whose range does not say "
                                "which value is black or white: save it with 8 or 16 bits a channel")
    return img.convert("RGB")


def decode_image(source: ImageSource, name: Optional[str] = None, *,
                 root: Optional[Union[str, "os.PathLike[str]"]] = None) -> Image.Image:
    """Decode an encoded image (path or bytes) into an RGB Pillow image.

    A path is read through the file gate (:mod:`shardfc.files`: a regular file of at most 64 MiB,
    inside ``root`` when given); its header is read first, and an image declaring more than
    :func:`max_image_pixels` pixels is refused before a pixel is decoded.

    Args:
        source: a path, or the encoded file contents as ``bytes``, ``bytearray``,
            ``memoryview`` or a uint8 numpy array.
        name: how to call the image in error messages; defaults to the path, or
            ``"<bytes>"`` for buffers.
        root: the folder the path was found in (a data set's root): the path must resolve inside it.

    Raises:
        FileNotFoundError: ``source`` is a path that does not exist (a
            configuration error, deliberately not a :class:`CorruptImageError`).
        CorruptImageError: the data is not a decodable image (truncated, unknown format, too many
            pixels, ...) or the path is not a regular file inside ``root``: one bad image is
            skipped and counted by the data sets, not the end of a run.
    """
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        label = name if name is not None else path
        try:
            data = files.read_bytes(path, "image", root=root)
        except files.FileMissing:
            raise FileNotFoundError(f"image file not found: {path!r}") from None
        except files.FileRefused as e:
            raise CorruptImageError(label, str(e)) from None
        opener = io.BytesIO(data)
    else:
        label = name if name is not None else "<bytes>"
        opener = io.BytesIO(_as_bytes(source))
    cap = max_image_pixels()
    try:
        with Image.open(opener) as img:  # reads the header only
            w, h = img.size
            if w * h > cap:
                raise CorruptImageError(label, f"it declares {w}x{h} = {w * h} pixels, more than the {cap} allowed "
                                        "(raise it with SHARDFC_MAX_IMAGE_PIXELS)")
            # load() forces the full decode, so truncated files fail here rather
            # than later inside a DataLoader worker.
            img.load()
            return as_rgb(img, label)
    except CorruptImageError:
        raise
    # DecompressionBombError is not an OSError; Pillow raises it at open past 2x its own limit.
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError, ValueError, EOFError,
            struct.error, IndexError, TypeError, MemoryError) as exc:
        # Pillow names the in-memory file it was handed ("<_io.BytesIO object at 0x7f...>"): the label
        # already says which image, and an address would make each log line unique.
        said = _BUFFER_REPR.sub("", str(exc))
        raise CorruptImageError(label, f"{type(exc).__name__}: {said}") from exc


_BUFFER_REPR = re.compile(r" ?<_io\.BytesIO object at 0x[0-9a-fA-F]+>")


def pil_to_tensor(img: Image.Image) -> torch.Tensor:
    """RGB Pillow image -> uint8 tensor ``[3, H, W]``."""
    arr = np.asarray(img.convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).contiguous()


def normalize(x: torch.Tensor) -> torch.Tensor:
    """uint8-range tensor -> float32 in ``[-1, 1]`` via ``(x / 255 - 0.5) / 0.5``."""
    return (x.to(torch.float32) / 255.0 - 0.5) / 0.5


def check_size(image_size: Tuple[int, int]) -> Tuple[int, int]:
    """``image_size`` as a ``(height, width)`` pair of positive ints, else a ValueError naming it."""
    if (
        not isinstance(image_size, (tuple, list))
        or len(image_size) != 2
        or not all(isinstance(v, int) and v > 0 for v in image_size)
    ):
        raise ValueError(f"image_size must be a (height, width) pair of positive ints, got {image_size!r}")
    return int(image_size[0]), int(image_size[1])


def image_to_tensor(
    img: Image.Image,
    image_size: Optional[Tuple[int, int]] = None,
    flip: bool = False,
    normalized: bool = True,
) -> torch.Tensor:
    """Pillow image -> normalised float tensor ``[3, H, W]``.

    Args:
        img: any-mode Pillow image (converted to RGB).
        image_size: target ``(height, width)``; the image is resized with
            bilinear filtering only if its size differs. ``None`` keeps the size.
        flip: mirror horizontally.
        normalized: ``False`` returns the uint8 pixels instead (resized and flipped alike):
            :func:`normalize` of them is, bit for bit, the normalised tensor. The trainer's loader
            workers ship these (a quarter of the bytes) and normalise on the training device.
    """
    img = as_rgb(img)
    if image_size is not None:
        h, w = check_size(image_size)
        if img.size != (w, h):  # Pillow sizes are (width, height)
            img = img.resize((w, h), Image.BILINEAR)
    x = pil_to_tensor(img)
    if normalized:
        x = normalize(x)
    return x.flip(-1) if flip else x


class ImageTransform:
    """Callable training/eval transform: resize, optional random flip, normalise.

    Args:
        image_size: target ``(height, width)`` or ``None`` to keep the size.
        random_flip: flip horizontally with probability ``flip_prob``.
        flip_prob: probability of the flip when ``random_flip`` is set.
        normalized: ``False``: uint8 ``[3, H, W]`` out, for :func:`normalize` later (see
            :func:`image_to_tensor`); the flip draws are the same either way.

    The flip decision draws from ``generator`` when one is passed to
    :meth:`__call__`, else from torch's global RNG (which DataLoader seeds
    differently in each worker).
    """

    def __init__(
        self,
        image_size: Optional[Tuple[int, int]] = (112, 112),
        random_flip: bool = False,
        flip_prob: float = 0.5,
        normalized: bool = True,
    ) -> None:
        # (True was taken as 1, a string was a TypeError naming nothing)
        flip_prob = check_probability("flip_prob", flip_prob, low_open=False, high_open=False)
        self.normalized = bool(normalized)
        self.image_size = None if image_size is None else check_size(image_size)
        self.random_flip = random_flip
        self.flip_prob = flip_prob

    def draw_flip(self, generator: Optional[torch.Generator] = None) -> bool:
        """Whether this image is mirrored: the one random draw of :meth:`__call__` (the DALI loader
        draws it here too, so both loaders flip the same images)."""
        if not self.random_flip:
            return False
        return bool(torch.rand((), generator=generator).item() < self.flip_prob)

    def __call__(self, img: Image.Image, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        flip = self.draw_flip(generator)
        return image_to_tensor(img, self.image_size, flip=flip, normalized=self.normalized)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(image_size={self.image_size}, "
            f"random_flip={self.random_flip}, flip_prob={self.flip_prob}, normalized={self.normalized})"
        )


def random_erase_(
    images: torch.Tensor,
    prob: float,
    generator: torch.Generator,
    area: Tuple[float, float] = (0.02, 0.4),
    aspect: Tuple[float, float] = (0.3, 1 / 0.3),
) -> torch.Tensor:
    """Random erasing ("Random Erasing Data Augmentation", Zhong et al., 2020), in place on a batch.

    Each image of ``images [N, C, H, W]`` is, with probability ``prob``, given one rectangle of a
    random fraction ``area`` of the image and a random height/width ratio in ``aspect`` (drawn
    uniformly in log space, so tall and wide are alike) at a random place, filled with 0: the
    middle grey of the ``[-1, 1]`` normalisation, which stands for the mean pixel Luo et al. fill
    with. A rectangle that does not fit is drawn again (up to 10 times, then the image is kept).
    Every draw comes from ``generator``, so a seeded generator makes the augmentation reproducible.
    Returns ``images``.
    """
    if not 0.0 <= prob <= 1.0:
        raise ValueError(f"prob must be in [0, 1], got {prob!r}")
    if images.ndim != 4:
        raise ValueError(f"images must be [N, C, H, W], got shape {tuple(images.shape)}")
    h, w = images.shape[-2:]
    log_lo, log_hi = math.log(aspect[0]), math.log(aspect[1])
    for i in range(images.shape[0]):
        if float(torch.rand((), generator=generator)) >= prob:
            continue
        for _ in range(10):
            frac, log_ratio, y, x = torch.rand(4, generator=generator, dtype=torch.float64).tolist()
            target = (area[0] + frac * (area[1] - area[0])) * h * w
            ratio = math.exp(log_lo + log_ratio * (log_hi - log_lo))
            eh, ew = int(round(math.sqrt(target * ratio))), int(round(math.sqrt(target / ratio)))
            if 0 < eh < h and 0 < ew < w:
                top, left = int(y * (h - eh + 1)), int(x * (w - ew + 1))
                images[i, :, top : top + eh, left : left + ew] = 0
                break
    return images
