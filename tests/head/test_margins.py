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
        (lambda: M.NormSoftmax(0), ValueError, "scale must be > 0, got 0.0"),
        (lambda: M.CosFace(scale=-2), ValueError, "scale must be > 0, got -2.0"),
        (lambda: M.CosFace(margin=-0.1), ValueError, "margin must be >= 0, got -0.1"),
        (lambda: M.Combined(scale=0), ValueError, "scale must be > 0, got 0.0"),
        (lambda: M.Combined(m2="0.5"), TypeError, "m2 must be a real number, got '0.5' (str)"),
        (lambda: M.Combined(m3=float("inf")), ValueError, "m3 must be finite, got inf"),
        (lambda: M.ArcFace(margin=math.pi), ValueError, "margin must be < pi, got 3.14159"),
        (lambda: M.SphereFace(True), TypeError, "margin must be an integer >= 1, got True"),
        (lambda: M.build_margin("arcfase"), ValueError, "did you mean 'arcface'"),
        (lambda: M.build_margin("arcface", s=3), TypeError, "margin 'arcface'"),
        # each logit s·cos θ was inf in fp32: torch's "cannot be converted ... without overflow" in the forward
        *[(lambda cls=cls: cls(scale=1e39), ValueError,
           "scale must be at most 3.403e+38 (float32's largest: the logits are fp32), got 1e+39")
          for cls in (M.ArcFace, M.CosFace, M.Combined, M.NormSoftmax, M.AdaFace, M.MagFace)],
    ],
)
def test_invalid_parameters(make, kind, text):
    with pytest.raises(kind, match=__import__("re").escape(text)):
        make()


def test_an_unknown_name_with_nothing_close_lists_the_names():
    with pytest.raises(ValueError) as e:
        M.build_margin("xyzzy")
    assert str(e.value) == ("margin name 'xyzzy' is not one of ['adaface', 'amsoftmax', 'arcface', 'combined', "
                            "'cosface', 'magface', 'normsoftmax', 'softmax', 'sphereface']")


def test_the_defaults_are_the_papers():
    """What a user gets by name alone: insightface's ArcFace (s = 64, m = 0.5) and CosFace (0.35),
    SphereFace's m = 4 with no annealing, a combined margin that is ArcFace's."""
    assert (M.NormSoftmax().s, M.CosFace().s, M.CosFace().m) == (64.0, 64.0, 0.35)
    arc = M.ArcFace()
    assert (arc.s, arc.m, arc.easy_margin) == (64.0, 0.5, False)
    assert M.ArcFace(easy_margin=True).easy_margin is True
    comb = M.Combined()
    assert (comb.s, comb.m1, comb.m2, comb.m3) == (64.0, 1.0, 0.5, 0.0)
    sphere = M.SphereFace()
    assert (sphere.m, sphere.lambda_) == (4, 0.0)


@pytest.mark.parametrize("make", [lambda: M.ArcFace(64.0, 0.5), lambda: M.ArcFace(64.0, 0.5, easy_margin=True),
                                  lambda: M.Combined(32.0, 0.9, 0.4, 0.15)], ids=["arcface", "easy", "combined"])
def test_cosines_past_one_by_rounding_count_as_one(make):
    """A unit embedding against a unit centre can give a cosine a rounding past ±1: it is ±1."""
    past = torch.tensor([1.0 + 1e-12, -1.0 - 1e-12, 1.5, -1.5], dtype=torch.float64)
    at = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    for got, want in zip(make().target(past)[:2], make().target(at)[:2]):
        assert torch.equal(got, want)


@pytest.mark.parametrize("m", [1, 3, 4])
def test_sphereface_cosines_past_one_count_as_one(m):
    margin = M.SphereFace(m)
    norm = torch.tensor([2.0, 2.0, 3.0, 3.0], dtype=torch.float64)
    past = torch.tensor([1.0 + 1e-12, -1.0 - 1e-12, 1.5, -1.5], dtype=torch.float64) * norm
    at = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64) * norm
    for got, want in zip(margin.target(past, norm), margin.target(at, norm)):
        assert torch.equal(got, want)


def test_sphereface_needs_the_norms():
    with pytest.raises(ValueError) as e:
        M.SphereFace().target(torch.zeros(2))
    assert str(e.value) == "SphereFace.target needs the embedding norms (norm=None given)"


def test_arcface_at_the_edges_of_its_branches():
    """θ = π − m exactly is still ``cos(θ + m)`` (= −1); past it, the fallback. With ``easy_margin``
    a cosine of exactly 0 is kept as it is (the margin starts above 0)."""
    m = 0.5
    arc = M.ArcFace(1.0, m)
    edge = torch.tensor([math.cos(math.pi - m)], dtype=torch.float64)
    assert float(arc.target(edge)[0]) == pytest.approx(-1.0, abs=1e-12)
    past = edge - 1e-9
    assert float(arc.target(past)[0]) == pytest.approx(float(past) - m * math.sin(m), abs=1e-12)
    easy = M.ArcFace(1.0, m, easy_margin=True)
    value, grad, _ = easy.target(torch.tensor([0.0], dtype=torch.float64))
    assert float(value) == 0.0 and float(grad) == 1.0


def test_build_margin_reads_names_loosely():
    """Case, ``-`` and ``_`` do not matter in a margin's name."""
    assert M.build_margin("Arc_Face", scale=30.0) == M.ArcFace(30.0)
    assert M.build_margin("norm-soft_max") == M.NormSoftmax()


def test_build_margin_and_equality():
    assert M.build_margin("AM-Softmax", scale=30.0, margin=0.2) == M.CosFace(30.0, 0.2)
    assert M.build_margin("sphereface", margin=4) == M.SphereFace(4)
    assert M.ArcFace() != M.ArcFace(margin=0.4)
    assert "ArcFace" in repr(M.ArcFace())


def test_repr_and_hash_follow_the_hyper_parameters():
    """A margin reads back as the call that makes it, and hashes as it compares: by type and
    hyper-parameters (a key of ``impl="auto"``'s timings, a set member)."""
    assert repr(M.ArcFace(30.0, 0.4)) == "ArcFace(s=30.0, m=0.4, easy_margin=False)"
    assert repr(M.Softmax()) == "Softmax()"
    assert hash(M.ArcFace(30.0, 0.4)) == hash(M.ArcFace(30.0, 0.4))
    assert hash(M.ArcFace(30.0, 0.4)) != hash(M.ArcFace(30.0, 0.5))
    renamed = type("MyCosFace", (M.CosFace,), {})
    assert hash(renamed(30.0, 0.2)) != hash(M.CosFace(30.0, 0.2)) and renamed(30.0, 0.2) != M.CosFace(30.0, 0.2)
    assert len({M.ArcFace(), M.ArcFace(), M.CosFace(), M.build_margin("amsoftmax")}) == 2


def test_the_largest_scale_is_float32s_largest():
    from shardfc.checks import FLOAT32_MAX

    assert FLOAT32_MAX == float(torch.finfo(torch.float32).max)
    assert M.ArcFace(scale=FLOAT32_MAX).s == M.AdaFace(scale=FLOAT32_MAX).s == FLOAT32_MAX  # at the bound: taken
