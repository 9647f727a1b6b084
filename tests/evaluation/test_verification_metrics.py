"""The exact verification protocol at its edges, and what the embedding functions hand on.

``test_verification.py`` holds the metrics to hand-computed and brute-force values on unit-norm
pairs; here: :func:`best_threshold` against a brute force over every split (all-same and
all-different sets, ties, scores one float step apart), embeddings of any norm and dtype, the
strict ``score > threshold`` rule, the FAR target's bounds, and that :func:`embed_images` and
:func:`evaluate_verification` pass their batch size, flip, device, folds and FAR targets on.
"""


import numpy as np
import pytest
import torch
from torch import nn

from shardfc.evaluation import embed_images, evaluate_verification, verification_metrics
from shardfc.evaluation.verification import best_threshold, tar_at_far


def _split_brute_force(scores, issame):
    """Every realisable split of the sorted scores, lowest threshold first, strict '>' keeps the first
    best: the candidates are just below the minimum, the midpoints of consecutive distinct scores
    (or the lower score where the midpoint rounds onto the upper one) and just above the maximum."""
    uniq = sorted(set(scores.tolist()))
    cands = [float(np.nextafter(uniq[0], -np.inf))]
    for lo, hi in zip(uniq, uniq[1:]):
        mid = (lo + hi) / 2
        cands.append(lo if mid >= hi else mid)
    cands.append(float(np.nextafter(uniq[-1], np.inf)))
    best_t, best_correct = None, -1
    for t in cands:
        correct = int(np.sum((scores > t) == issame))
        if correct > best_correct:
            best_t, best_correct = t, correct
    return best_t, best_correct / len(scores)


def _cases():
    rng = np.random.default_rng(7)
    yield np.array([0.3, 0.1, 0.2]), np.array([True, True, True])  # all same: below the minimum
    yield np.array([0.3, 0.1, 0.2]), np.array([False, False, False])  # all different: above the maximum
    yield np.array([0.1, 0.5, 0.9]), np.array([False, True, True])  # the first midpoint
    yield np.array([0.5]), np.array([True])
    step = np.nextafter(0.5, 1.0)  # one float step apart: the midpoint rounds onto the upper score
    yield np.array([0.5, step, 0.5, step]), np.array([False, True, False, True])
    for n in (2, 5, 9, 16):
        for _ in range(25):
            scores = np.round(rng.uniform(-1, 1, n), 1)  # ties
            yield scores, rng.random(n) < rng.uniform(0, 1)


def test_best_threshold_is_the_brute_force_split():
    for scores, issame in _cases():
        thr, acc = best_threshold(scores, issame)
        want_thr, want_acc = _split_brute_force(scores, issame)
        assert (thr, acc) == (want_thr, want_acc), (scores.tolist(), issame.tolist())
        assert acc == np.mean((scores > thr) == issame)  # the reported accuracy is the threshold's


def _random_pairs(n, seed, norms=True):
    rng = np.random.default_rng(seed)
    issame = rng.random(n) < 0.5
    a = rng.normal(size=(n, 6))
    b = np.where(issame[:, None], a + rng.normal(scale=0.8, size=(n, 6)), rng.normal(size=(n, 6)))
    if norms:  # each row scaled by its own factor, far below and above 1
        a *= 10.0 ** rng.uniform(-6, 4, (n, 1))
        b *= 10.0 ** rng.uniform(-6, 4, (n, 1))
    return a, b, issame


def _exact(m):
    return {k: v for k, v in m.items() if k.startswith("exact_")}


def test_exact_metrics_do_not_depend_on_the_embeddings_norms():
    a, b, issame = _random_pairs(60, 0)
    unit_a = a / np.linalg.norm(a, axis=1, keepdims=True)
    unit_b = b / np.linalg.norm(b, axis=1, keepdims=True)
    got = verification_metrics(a, b, issame, nfolds=5, far_targets=(0.05, 0.2))
    want = verification_metrics(unit_a, unit_b, issame, nfolds=5, far_targets=(0.05, 0.2))
    assert _exact(got) == pytest.approx(_exact(want), nan_ok=True)
    # and the thresholds are cosine similarities: those of the brute force on the cosines
    cos = np.sum(unit_a * unit_b, axis=1)
    assert got["exact_threshold@far=2e-1"] == pytest.approx(tar_at_far(cos, issame, 0.2)[2])
    folds = np.array_split(np.arange(60), 5)
    thrs = [_split_brute_force(np.delete(cos, f), np.delete(issame, f))[0] for f in folds]
    assert got["exact_best_threshold"] == pytest.approx(np.mean(thrs))


def test_a_zero_embedding_scores_zero():
    a, b, issame = _random_pairs(20, 1, norms=False)
    a[3] = 0.0
    got = verification_metrics(a, b, issame, nfolds=2, far_targets=(0.2,))  # 8 negatives
    cos = np.sum(a * b, axis=1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-300)
    assert cos[3] == 0.0 and np.all(np.isfinite(list(_exact(got).values())))
    # the same as unit pairs with these cosines, pair 3's being 0
    unit_a, unit_b = np.tile([1.0, 0.0], (20, 1)), np.stack([cos, np.sqrt(1 - cos**2)], axis=1)
    want = verification_metrics(unit_a, unit_b, issame, nfolds=2, far_targets=(0.2,))
    assert _exact(got) == pytest.approx(_exact(want))


def test_bfloat16_embeddings_and_a_column_of_labels():
    a, b, issame = _random_pairs(40, 2, norms=False)
    a16, b16 = torch.tensor(a).bfloat16(), torch.tensor(b).bfloat16()
    got = verification_metrics(a16, b16, torch.tensor(issame)[:, None], nfolds=4, far_targets=(0.1,))
    want = verification_metrics(a16.double(), b16.double(), issame, nfolds=4, far_targets=(0.1,))
    assert got == pytest.approx(want, nan_ok=True)


def test_same_only_when_the_score_is_above_the_threshold():
    # Cosines 0.5, 0, 1, 0 exactly (b = (1, 1, 1, 1) has norm 2). Fold 0 trains on pairs 2, 3
    # (1 same, 0 different): threshold 0.5, and its held-out positive at exactly 0.5 is "different".
    # Fold 1 trains on pairs 0, 1 (threshold 0.25) and gets both right: (1/2 + 2/2) / 2.
    a = np.tile([1.0, 0.0, 0.0, 0.0], (4, 1))
    b = np.array([[1.0, 1, 1, 1], [0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0]])
    m = verification_metrics(a, b, [True, False, True, False], nfolds=2, far_targets=())
    assert m["exact_accuracy"] == 0.75
    assert m["exact_best_threshold"] == (0.5 + 0.25) / 2


@pytest.mark.parametrize("issame, shown", [
    (np.array([0, 2]), "2 (int64)"), (np.array([0.0, 0.5]), "0.5 (float64)"), (np.array([1.0, np.nan]), "nan (float64)"),
    (np.array(["y", "n"]), "'y' (<U1)"), (torch.tensor([-1, 1]), "-1 (int64)"),
])
def test_issame_is_booleans_or_0_and_1(issame, shown):
    # astype(bool) took 2, 0.5, NaN, -1 and any string as "same", silently
    with pytest.raises(ValueError) as err:
        verification_metrics(np.eye(2), np.eye(2), issame, nfolds=2, far_targets=())
    assert str(err.value) == f"issame must hold booleans (or 0 and 1), got {shown}"
    ones = verification_metrics(np.eye(2), np.eye(2), np.array([1, 0]), nfolds=2, far_targets=())
    three = verification_metrics(np.eye(3), np.eye(3), np.array([1, 1, 0]), nfolds=2, far_targets=())
    assert (three["num_pairs"], three["num_negative_pairs"]) == (3.0, 1.0)
    assert ones == verification_metrics(np.eye(2), np.eye(2), [True, False], nfolds=2, far_targets=())
    assert ones == verification_metrics(np.eye(2), np.eye(2), torch.tensor([1.0, 0.0]), nfolds=2, far_targets=())


@pytest.mark.parametrize("far", [0.0, 1.0, 1.5, -0.1])
def test_a_far_target_outside_0_1_is_refused(far):
    scores, issame = np.array([0.1, 0.9]), np.array([False, True])
    with pytest.raises(ValueError, match=rf"^far target must be in \(0, 1\), got {far!r}$"):
        tar_at_far(scores, issame, far)
    with pytest.raises(ValueError, match=rf"^far target must be in \(0, 1\), got {far!r}$"):
        verification_metrics(np.eye(2), np.eye(2), [True, False], nfolds=2, far_targets=(0.5, far))


@pytest.mark.parametrize("a, b, issame, message", [
    (np.ones(4), np.ones(4), [True, False] * 2,  # equal shapes, but no [N, D]
     "embeddings_a and embeddings_b must both be [N, D] with equal shapes, got (4,) and (4,)"),
    (np.ones((4, 3)), np.ones((4, 2)), [True, False] * 2,
     "embeddings_a and embeddings_b must both be [N, D] with equal shapes, got (4, 3) and (4, 2)"),
    (np.ones((4, 3)), np.ones((4, 3)), [True, False, True], "issame has 3 entries for 4 embedding pairs"),
])
def test_pairs_of_the_wrong_shape_are_named(a, b, issame, message):
    with pytest.raises(ValueError) as e:
        verification_metrics(a, b, issame, nfolds=2)
    assert str(e.value) == message


def test_far_targets_given_as_a_string_are_refused():
    # "0.1" was iterated into "0", ".", "1": an error about a target 0.0 nobody asked for
    with pytest.raises(ValueError, match=r"^far_targets must be numbers, got the string '0.1'$"):
        verification_metrics(np.eye(2), np.eye(2), [True, False], nfolds=2, far_targets="0.1")


def test_one_positive_pair_has_a_tar():
    scores = np.array([0.9] + [0.1 * i for i in range(10)])
    issame = np.array([True] + [False] * 10)
    assert tar_at_far(scores, issame, 0.1) == (1.0, 0.1, pytest.approx(0.8))
    scores[0] = 0.05  # below every accepted negative's threshold
    assert tar_at_far(scores, issame, 0.1)[0] == 0.0


# ----------------------------------------------------------------- what the embedding passes on
class _Spy(nn.Module):
    """Records each batch's size and device and whether it is the mirror image; embeds a row by its
    first pixel values, on the CPU whatever the input's device (so a meta device can be seen)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append((x.shape[0], x.device.type))
        if x.device.type == "meta":
            return torch.ones(x.shape[0], 2)
        return x.flatten(1)[:, :4].float()


def test_embed_images_defaults_and_what_it_passes_on():
    images = torch.randn(65, 1, 2, 2)
    spy = _Spy()
    emb = embed_images(spy, images)
    assert [n for n, _ in spy.seen] == [64, 64, 1, 1]  # batches of 64, each with its mirror image
    torch.testing.assert_close(emb, images.flatten(1) + images.flip(-1).flatten(1))
    spy.seen.clear()
    embed_images(spy, images[:3], batch_size=1, flip=False, device="meta")
    assert spy.seen == [(1, "meta")] * 3
    for bad in (0, -2):
        with pytest.raises(ValueError, match=rf"^batch_size must be >= 1, got {bad}$"):
            embed_images(spy, images, batch_size=bad)


@pytest.mark.parametrize("layout", ["tuple", "interleaved"])
def test_evaluate_verification_passes_its_arguments_on(layout):
    n = 66
    a, b, issame = _random_pairs(n, 3, norms=False)
    imgs_a = torch.tensor(a, dtype=torch.float32).reshape(n, 1, 2, 3)
    imgs_b = torch.tensor(b, dtype=torch.float32).reshape(n, 1, 2, 3)
    images = (imgs_a, imgs_b) if layout == "tuple" else torch.stack([imgs_a, imgs_b], 1).reshape(2 * n, 1, 2, 3)
    spy = _Spy()
    m = evaluate_verification(spy, images, issame, batch_size=5, flip=False, nfolds=3, far_targets=(0.25,))
    sizes = [5] * 13 + [1] if layout == "tuple" else [5] * 26 + [2]
    assert spy.seen == [(size, "cpu") for size in sizes * (2 if layout == "tuple" else 1)]
    emb_a, emb_b = imgs_a.flatten(1)[:, :4], imgs_b.flatten(1)[:, :4]
    assert m == pytest.approx(verification_metrics(emb_a, emb_b, issame, nfolds=3, far_targets=(0.25,)), nan_ok=True)
    spy.seen.clear()
    defaults = evaluate_verification(spy, images, issame)  # batches of 64 with the mirror image, 10 folds
    mirrored = [64, 64, 2, 2] * 2 if layout == "tuple" else [64, 64, 64, 64, 4, 4]
    assert [size for size, _ in spy.seen] == mirrored
    assert "tar@far=1e-3" in defaults and defaults["num_pairs"] == n
    flipped_a = emb_a + imgs_a.flip(-1).flatten(1)[:, :4]
    flipped_b = emb_b + imgs_b.flip(-1).flatten(1)[:, :4]
    assert defaults == pytest.approx(verification_metrics(flipped_a, flipped_b, issame), nan_ok=True)
    spy.seen.clear()
    evaluate_verification(spy, images, issame, batch_size=100, flip=False, device="meta", nfolds=2)
    assert {device for _, device in spy.seen} == {"meta"}


def test_interleaved_images_of_an_odd_count_are_refused():
    with pytest.raises(ValueError, match=r"^interleaved images must have an even count, got 3$"):
        evaluate_verification(_Spy(), torch.zeros(3, 1, 2, 2), [True])
