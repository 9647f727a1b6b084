"""5-landmark face alignment to the 112x112 ArcFace template, with numpy and torch only.

A similarity transform (rotation, uniform scale, translation) is fitted from the detected
landmarks (left eye, right eye, nose tip, left and right mouth corners) to the template by
least squares (Umeyama, "Least-squares estimation of transformation parameters between two point
patterns", 1991: the closed form ``skimage.transform.SimilarityTransform.estimate`` uses), and
the image is resampled bilinearly through its inverse with a black border, output pixel ``(x, y)``
reading the input at ``M^-1 (x, y)`` in integer pixel coordinates (the convention of OpenCV's
``warpAffine``), then rounded back to 8 bits as an aligned crop written to disk would be.
"""

from __future__ import annotations

from typing import Tuple

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["ARCFACE_TEMPLATE", "estimate_similarity", "warp_affine", "align_face"]

#: Landmark positions of the 112x112 ArcFace crop (the 96x112 template of SphereFace shifted
#: 8 pixels right): left eye, right eye, nose tip, left mouth corner, right mouth corner.
ARCFACE_TEMPLATE = np.array(
    [[38.2946, 51.6963], [73.5318, 51.5014], [56.0252, 71.7366], [41.5493, 92.3655], [70.7299, 92.2041]],
    dtype=np.float64,
)


def estimate_similarity(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """The ``2x3`` similarity transform ``M`` minimising ``sum |M [src_i; 1] - dst_i|^2``.

    Raises:
        ValueError: shapes differ or are not ``[N, 2]`` with ``N >= 2``, or the source points
            are all equal (no transform is determined).
    """
    src = np.asarray(src, dtype=np.float64)
    dst = np.asarray(dst, dtype=np.float64)
    if src.ndim != 2 or src.shape[1] != 2 or src.shape != dst.shape or len(src) < 2:
        raise ValueError(f"landmarks must be two [N, 2] arrays of equal shape, N >= 2; got {src.shape} and {dst.shape}")
    mu_src, mu_dst = src.mean(axis=0), dst.mean(axis=0)
    src_c, dst_c = src - mu_src, dst - mu_dst
    var_src = (src_c**2).sum() / len(src)
    if not var_src > 0:
        raise ValueError(f"landmarks {src.tolist()} are all the same point: no similarity transform fits them")
    cov = dst_c.T @ src_c / len(src)
    u, s, vt = np.linalg.svd(cov)
    # A similarity transform may not reflect: where u @ vt would (det(u)·det(vt) = -1), the second axis
    # is turned around. That is det(cov) < 0, where a reflection would fit better, and half of the
    # collinear landmarks, whose det(cov) is 0 and whose second singular vectors' signs are arbitrary
    # (deciding by det(cov) < 0 alone mirrored 287 of 2,000 lines). skimage's Umeyama decides both alike.
    d = np.array([1.0, 1.0 if np.linalg.det(u) * np.linalg.det(vt) > 0 else -1.0])
    rotation = u @ np.diag(d) @ vt
    scale = float(s @ d) / var_src
    m = np.empty((2, 3))
    m[:, :2] = scale * rotation
    m[:, 2] = mu_dst - scale * rotation @ mu_src
    return m


def warp_affine(image: torch.Tensor, m: np.ndarray, out_size: Tuple[int, int]) -> torch.Tensor:
    """Resample ``image`` ``[C, H, W]`` (float) so that output pixel ``(x, y)`` is the input at
    ``M^-1 (x, y)``: bilinear, zero outside the input. Returns ``[C, out_h, out_w]``."""
    c, h, w = image.shape
    out_h, out_w = out_size
    full = np.vstack([m, [0.0, 0.0, 1.0]])  # float64 (the appended row), whatever m's float type
    inv = np.linalg.inv(full)[:2]
    ys, xs = np.meshgrid(np.arange(out_h), np.arange(out_w), indexing="ij")
    src_x = inv[0, 0] * xs + inv[0, 1] * ys + inv[0, 2]
    src_y = inv[1, 0] * xs + inv[1, 1] * ys + inv[1, 2]
    # grid_sample with align_corners=False puts -1 and 1 on the outer edges of the first and last
    # pixels: pixel centre i is at (2 i + 1) / size - 1, for any size (align_corners=True maps every
    # coordinate of a 1-pixel row onto its one pixel, so nothing beside it would be black).
    gx = (2.0 * src_x + 1.0) / w - 1.0
    gy = (2.0 * src_y + 1.0) / h - 1.0
    grid = torch.from_numpy(np.stack([gx, gy], axis=-1))[None]  # float64, as the image below
    out = F.grid_sample(image[None].to(torch.float64), grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    return out[0].to(image.dtype)


def align_face(
    image: torch.Tensor, landmarks: np.ndarray, out_size: Tuple[int, int] = (112, 112)
) -> torch.Tensor:
    """Align an image ``[3, H, W]`` (uint8 or float in 0..255) by its 5 landmarks ``[5, 2]``
    (``x, y`` in pixels) to the ArcFace template; returns uint8 ``[3, 112, 112]``."""
    if tuple(out_size) != (112, 112):
        raise ValueError(f"the ArcFace template is defined for 112x112 crops, got out_size={tuple(out_size)}")
    lmk = np.asarray(landmarks)  # (estimate_similarity computes in float64)
    if lmk.shape != (5, 2):
        raise ValueError(f"expected 5 (x, y) landmarks, got an array of shape {lmk.shape}")
    m = estimate_similarity(lmk, ARCFACE_TEMPLATE)
    warped = warp_affine(image.to(torch.float64), m, out_size)
    return warped.round().clamp(0, 255).to(torch.uint8)
