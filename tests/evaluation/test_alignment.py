"""Face alignment at its edges: the similarity fit's input checks, small and collinear landmarks,
mirror images, the warp on tiny images and float32 transforms, and the 8-bit rounding.

``test_ijb.py`` holds the fit to known transforms and a rotated face put back pixel for pixel.
"""

import math
import re

import numpy as np
import pytest
import torch

from shardfc.evaluation.alignment import ARCFACE_TEMPLATE, align_face, estimate_similarity, warp_affine


def _rotation(deg, scale=1.0, tx=0.0, ty=0.0):
    a = math.radians(deg)
    return np.array([[scale * math.cos(a), -scale * math.sin(a), tx], [scale * math.sin(a), scale * math.cos(a), ty]])


def _apply(m, pts):
    return pts @ m[:, :2].T + m[:, 2]


def _is_similarity(m):
    (a, b), (c, d) = m[:, :2]
    return math.isclose(a, d, abs_tol=1e-12) and math.isclose(b, -c, abs_tol=1e-12) and a * d - b * c > 0


@pytest.mark.parametrize("src, dst", [
    (np.zeros(10), np.zeros(10)),  # one dimension
    (np.zeros((5, 3)), np.zeros((5, 3))),  # not (x, y)
    (np.zeros((5, 2)), np.zeros((4, 2))),  # shapes differ
    (np.zeros((1, 2)), np.zeros((1, 2))),  # one point
])
def test_landmark_shapes_are_checked(src, dst):
    message = f"landmarks must be two [N, 2] arrays of equal shape, N >= 2; got {src.shape} and {dst.shape}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        estimate_similarity(src, dst)


def test_two_points_fix_a_similarity():
    m = estimate_similarity([[0.0, 0.0], [1.0, 0.0]], [[1.0, 1.0], [1.0, 3.0]])  # scale 2, 90 degrees
    assert np.allclose(m, [[0.0, -2.0, 1.0], [2.0, 0.0, 1.0]], atol=1e-12)


def test_fit_in_float64_whatever_the_input():
    m = _rotation(17.0, 1.3, 4.0, -2.0)
    src = np.random.default_rng(0).uniform(0, 100, (5, 2))
    src32, dst32 = src.astype(np.float32), _apply(m, src).astype(np.float32)
    assert np.array_equal(estimate_similarity(src32, dst32), estimate_similarity(src32.astype(np.float64), dst32.astype(np.float64)))


def test_small_and_collinear_landmarks():
    # Landmarks within a pixel (variance and covariance far below 1) are a transform like any other.
    m = _rotation(30.0, 0.5, 0.1, 0.2)
    small = ARCFACE_TEMPLATE / 200
    assert np.allclose(estimate_similarity(small, _apply(m, small)), m, atol=1e-12)
    # Points on a line (det(cov) exactly 0): rotated, not mirrored, onto the rotated line.
    line = np.array([[0.0, 0.0], [1.0, 0.0], [3.0, 0.0]])
    m = _rotation(90.0, 2.0, 5.0, 5.0)
    got = estimate_similarity(line, _apply(m, line))
    assert _is_similarity(got) and np.allclose(got, m, atol=1e-12)
    with pytest.raises(ValueError, match=r"^landmarks \[\[2\.0, 3\.0\], \[2\.0, 3\.0\]\] are all the same point: "
                                         r"no similarity transform fits them$"):
        estimate_similarity([[2.0, 3.0], [2.0, 3.0]], [[0.0, 0.0], [1.0, 1.0]])


def test_a_mirror_image_gets_the_best_rotation_not_a_reflection():
    src = ARCFACE_TEMPLATE
    dst = src * [-1.0, 1.0] + [112.0, 0.0]
    m = estimate_similarity(src, dst)
    assert _is_similarity(m)
    residual = np.sum((_apply(m, src) - dst) ** 2)
    # no rotation on a fine grid, with its best scale and translation, fits better
    src_c, dst_c = src - src.mean(0), dst - dst.mean(0)
    for deg in np.arange(0, 360, 0.25):
        r = _rotation(deg)[:, :2]
        rotated = src_c @ r.T
        scale = max(np.sum(rotated * dst_c) / np.sum(rotated**2), 0.0)
        assert residual <= np.sum((scale * rotated - dst_c) ** 2) + 1e-9


def test_collinear_landmarks_onto_the_template_are_rotated_never_mirrored():
    """A detection whose five landmarks lie on one line (a degenerate face) against the template:
    ``det(cov)`` is 0, and the signs SVD gives the second singular vectors decide alone whether
    ``u @ vt`` rotates or reflects; 287 of 2,000 such lines here were mirrored. Each is now the best
    rotation (skimage's rank-deficient branch), no better one on a fine grid."""
    rng = np.random.default_rng(0)
    for _ in range(40):
        along, direction, origin = rng.normal(size=5), rng.normal(size=2), rng.normal(size=2) * 50
        src = origin + np.outer(along, direction) * 20
        m = estimate_similarity(src, ARCFACE_TEMPLATE)
        assert _is_similarity(m), m
        residual = np.sum((_apply(m, src) - ARCFACE_TEMPLATE) ** 2)
        src_c, dst_c = src - src.mean(0), ARCFACE_TEMPLATE - ARCFACE_TEMPLATE.mean(0)
        for deg in np.arange(0, 360, 1.0):
            rotated = src_c @ _rotation(deg)[:, :2].T
            scale = max(np.sum(rotated * dst_c) / np.sum(rotated**2), 0.0)
            assert residual <= np.sum((scale * rotated - dst_c) ** 2) + 1e-9


def test_warp_of_a_one_pixel_image_is_black_around_it():
    one = torch.tensor([[[7.0]]])
    assert warp_affine(one, np.array([[1.0, 0.0, 3.0], [0.0, 1.0, 0.0]]), (1, 5)).tolist() == [[[0, 0, 0, 7, 0]]]
    two = torch.tensor([[[1.0, 2.0]]])  # two pixels wide: a half-pixel move blends them, then the border
    out = warp_affine(two, np.array([[1.0, 0.0, 0.5], [0.0, 1.0, 0.0]]), (1, 3))
    assert out.tolist() == [[[0.5, 1.5, 1.0]]]


def test_warp_reads_the_transform_in_float64():
    img = torch.from_numpy(np.random.default_rng(1).uniform(0, 255, (1, 20, 20)))
    m = _rotation(17.0, 1.1, 2.0, -1.0)
    assert torch.equal(warp_affine(img, m.astype(np.float32), (20, 20)), warp_affine(img, m.astype(np.float32).astype(np.float64), (20, 20)))
    assert warp_affine(img.float(), m, (20, 20)).dtype == torch.float32


def test_align_face_rounds_and_clamps_to_8_bits():
    face = torch.full((3, 112, 112), 300.0)
    face[0] = -20.0
    face[1] = 254.6
    out = align_face(face, ARCFACE_TEMPLATE)  # the identity: every output pixel reads one input pixel
    assert out.dtype == torch.uint8
    assert out[0].unique().tolist() == [0] and out[1].unique().tolist() == [255] and out[2].unique().tolist() == [255]
    out = align_face(torch.full((3, 112, 112), 100.4), ARCFACE_TEMPLATE.astype(np.float32))
    assert out.unique().tolist() == [100]


@pytest.mark.parametrize("size", [(96, 112), (112, 96), [128, 128]])
def test_align_face_is_for_112x112(size):
    with pytest.raises(ValueError, match=rf"^the ArcFace template is defined for 112x112 crops, got out_size="
                                         rf"\({size[0]}, {size[1]}\)$"):
        align_face(torch.zeros(3, 8, 8), ARCFACE_TEMPLATE, out_size=size)
