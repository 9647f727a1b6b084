"""Margins: hand-written target derivatives equal autograd's; parameters are validated."""

import math

import pytest
import torch

from shardfc import margins as M

MARGINS = [
    M.Softmax(),
    M.NormSoftmax(30.0),
    M.CosFace(64.0, 0.35),
    M.AMSoftmax(30.0, 0.2),
    M.ArcFace(64.0, 0.5),
    M.ArcFace(64.0, 0.5, easy_margin=True),
    M.ArcFace(64.0, 1.2),  # wide margin: exercises the θ > π − m branch
    M.Combined(64.0, 1.0, 0.3, 0.2),
    M.Combined(32.0, 0.9, 0.4, 0.15),
]


@pytest.mark.parametrize("margin", MARGINS, ids=repr)
def test_target_derivative_matches_autograd(margin):
    c = torch.linspace(-0.999, 0.999, 401, dtype=torch.float64).requires_grad_()
    value, d_raw, d_norm = margin.target(c)
    assert d_norm is None
    (auto,) = torch.autograd.grad(value.sum(), c)
    torch.testing.assert_close(d_raw, auto, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("m,lam", [(1, 0.0), (2, 0.0), (3, 0.5), (4, 0.0), (4, 5.0)])
def test_sphereface_target_and_derivatives(m, lam):
    margin = M.SphereFace(m, lambda_=lam)
    g = torch.Generator().manual_seed(0)
    norm = (torch.rand(300, generator=g, dtype=torch.float64) * 5 + 0.1).requires_grad_()
    cos = torch.rand(300, generator=g, dtype=torch.float64) * 1.998 - 0.999
    raw = (cos * norm).detach().requires_grad_()
    value, d_raw, d_norm = margin.target(raw, norm)
    theta = torch.acos(raw / norm)
    k = torch.floor(m * theta / math.pi)
    psi = (-1.0) ** k * torch.cos(m * theta) - 2 * k
    expected = norm * (lam * raw / norm + psi) / (1 + lam)
    torch.testing.assert_close(value, expected, rtol=1e-9, atol=1e-9)
    g_raw, g_norm = torch.autograd.grad(expected.sum(), (raw, norm))
    torch.testing.assert_close(d_raw, g_raw, rtol=1e-7, atol=1e-7)
    torch.testing.assert_close(d_norm, g_norm, rtol=1e-7, atol=1e-7)


def test_arcface_values():
    m = M.ArcFace(64.0, 0.5)
    c = torch.tensor([0.5, -0.99], dtype=torch.float64)
    value, _, _ = m.target(c)
    assert value[0] == pytest.approx(64 * math.cos(math.acos(0.5) + 0.5))
    assert value[1] == pytest.approx(64 * (-0.99 - 0.5 * math.sin(0.5)))  # θ > π − m branch


@pytest.mark.parametrize(
    "make,kind,text",
    [
        (lambda: M.ArcFace(scale=-1.0), ValueError, "scale must be > 0, got -1.0"),
        (lambda: M.ArcFace(scale=0), ValueError, "scale must be > 0"),
        (lambda: M.ArcFace(margin=-0.1), ValueError, "margin must be >= 0"),
        (lambda: M.ArcFace(margin=4.0), ValueError, "margin must be < pi"),
        (lambda: M.ArcFace(easy_margin="yes"), TypeError, "easy_margin"),
        (lambda: M.CosFace(scale=float("nan")), ValueError, "scale must be finite"),
        (lambda: M.CosFace(scale="64"), TypeError, "scale must be a real number"),
        (lambda: M.SphereFace(margin=2.5), ValueError, "integer >= 1, got 2.5"),
        (lambda: M.SphereFace(margin=0), ValueError, "integer >= 1"),
        (lambda: M.SphereFace(margin=4, lambda_=-1), ValueError, "lambda_ must be >= 0"),
        (lambda: M.Combined(m1=0.0), ValueError, "m1 must be > 0"),
        (lambda: M.NormSoftmax(True), TypeError, "scale"),
        (lambda: M.build_margin("arcfase"), ValueError, "did you mean 'arcface'"),
        (lambda: M.build_margin("arcface", s=3), TypeError, "margin 'arcface'"),
    ],
)
def test_invalid_parameters(make, kind, text):
    with pytest.raises(kind, match=__import__("re").escape(text)):
        make()


def test_build_margin_and_equality():
    assert M.build_margin("AM-Softmax", scale=30.0, margin=0.2) == M.CosFace(30.0, 0.2)
    assert M.build_margin("sphereface", margin=4) == M.SphereFace(4)
    assert M.ArcFace() != M.ArcFace(margin=0.4)
    assert "ArcFace" in repr(M.ArcFace())
