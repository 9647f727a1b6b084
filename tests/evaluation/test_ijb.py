"""IJB-B/C 1:1 verification: alignment, meta files, template pooling, ROC, end to end on a synthetic release."""

import math

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from shardfc.data.transforms import normalize, pil_to_tensor
from shardfc.evaluation.alignment import ARCFACE_TEMPLATE, align_face, estimate_similarity, warp_affine
from shardfc.evaluation.ijb import (
    evaluate_ijb,
    ijb_metrics,
    read_ijb_meta,
    roc_curve,
    tar_at_nearest_far,
    template_features,
    write_ijb_report,
)


def _similarity(angle_deg, scale, tx, ty):
    a = math.radians(angle_deg)
    return np.array([[scale * math.cos(a), -scale * math.sin(a), tx], [scale * math.sin(a), scale * math.cos(a), ty]])


def _apply(m, pts):
    return pts @ m[:, :2].T + m[:, 2]


# ------------------------------------------------------------------- alignment
@pytest.mark.parametrize("params", [(20.0, 1.7, 5.0, -3.0), (-135.0, 0.4, 40.0, 60.0), (0.0, 1.0, 0.0, 0.0)])
def test_similarity_recovers_a_known_transform(params):
    m = _similarity(*params)
    src = np.random.default_rng(0).uniform(0, 100, (5, 2))
    assert np.allclose(estimate_similarity(src, _apply(m, src)), m, atol=1e-10)


def test_similarity_never_reflects_and_rejects_degenerate_landmarks():
    src = ARCFACE_TEMPLATE
    mirrored = src * [-1.0, 1.0]  # no rotation maps src onto its mirror image
    m = estimate_similarity(src, mirrored)
    assert np.linalg.det(m[:, :2]) > 0
    with pytest.raises(ValueError, match="same point"):
        estimate_similarity(np.ones((5, 2)), src)
    with pytest.raises(ValueError, match="5 \\(x, y\\) landmarks"):
        align_face(torch.zeros(3, 8, 8, dtype=torch.uint8), np.zeros((4, 2)))


def test_warp_is_exact_for_pixel_aligned_moves_with_black_border():
    img = torch.arange(2 * 4 * 5, dtype=torch.float32).reshape(2, 4, 5)
    out = warp_affine(img, np.array([[1.0, 0, 1], [0, 1.0, 2]]), (4, 5))  # output (x, y) reads input (x-1, y-2)
    expected = torch.zeros_like(img)
    expected[:, 2:, 1:] = img[:, :2, :4]
    assert torch.allclose(out, expected, atol=1e-9)


def test_align_face_undoes_a_rotated_placement():
    # The aligned face O, rotated by 90 degrees and placed into a larger loose crop; its landmarks
    # are the template's moved the same way. Aligning the crop must give O back, pixel for pixel.
    face = torch.from_numpy(np.random.default_rng(1).integers(0, 256, (3, 112, 112), dtype=np.uint8))
    m = np.array([[0.0, -1.0, 130.0], [1.0, 0.0, 10.0]])  # (x, y) -> (130 - y, 10 + x)
    loose = torch.zeros(3, 150, 140, dtype=torch.uint8)
    ys, xs = np.meshgrid(np.arange(112), np.arange(112), indexing="ij")
    loose[:, 10 + xs, 130 - ys] = face[:, ys, xs]
    aligned = align_face(loose, _apply(m, ARCFACE_TEMPLATE))
    assert torch.equal(aligned, face)


def test_alignment_matches_skimage_when_installed():
    transform = pytest.importorskip("skimage.transform")
    src = np.random.default_rng(2).uniform(20, 90, (5, 2))
    tform = transform.SimilarityTransform()
    tform.estimate(src, ARCFACE_TEMPLATE)
    assert np.allclose(estimate_similarity(src, ARCFACE_TEMPLATE), tform.params[:2], atol=1e-9)


# ------------------------------------------------------------------- pooling and ROC
def test_template_pooling_weights_media_not_faces():
    feats = np.array([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [3.0, 4.0]])
    templates = np.array([7, 7, 7, 7, 2])
    medias = np.array([1, 1, 1, 5, 1])  # template 7: one 3-frame video and one still; same media id in template 2
    out, ids = template_features(feats, templates, medias)
    assert ids.tolist() == [2, 7]
    assert np.allclose(out[1], [1 / math.sqrt(2), 1 / math.sqrt(2)])  # video mean (1,0) + still (0,1)
    assert np.allclose(out[0], [0.6, 0.8])


def test_roc_nearest_far_ties_take_the_largest_tar():
    # Sorted: 0.9 P, 0.8 N, 0.7 P, 0.6 N, 0.5 N. The point at 0.6 lies on the straight run from
    # (1/3, 1) to (1, 1) and is dropped: fpr [0, 0, 1/3, 1/3, 1], tpr [0, .5, .5, 1, 1].
    labels = np.array([1, 0, 1, 0, 0])
    scores = np.array([0.9, 0.8, 0.7, 0.6, 0.5])
    fpr, tpr, thr = roc_curve(labels, scores)
    assert np.allclose(fpr, [0, 0, 1 / 3, 1 / 3, 1]) and np.allclose(tpr, [0, 0.5, 0.5, 1, 1])
    assert thr[0] == np.inf and np.allclose(thr[1:], [0.9, 0.8, 0.7, 0.5])
    assert tar_at_nearest_far(fpr, tpr, 0.1) == 0.5  # fpr 0 twice: the later point (tpr 0.5)
    assert tar_at_nearest_far(fpr, tpr, 0.6) == 1.0  # fpr 1/3 twice: tpr 1
    m = ijb_metrics(scores, labels, fars=(0.1, 0.4))
    # the area under fpr [0, 0, 1/3, 1/3, 1], tpr [0, .5, .5, 1, 1]: 1/3 · 1/2 + 2/3 · 1
    assert m["auc"] == pytest.approx(5 / 6) and (m["num_pairs"], m["num_negative_pairs"]) == (5.0, 3.0)
    assert m["exact_tar@far=4e-1"] == 1.0  # 1 negative of 3 above 0.6 is FAR 1/3 <= 0.4
    assert math.isnan(m["exact_tar@far=1e-1"])  # 3 negatives cannot measure FAR 0.1
    with pytest.raises(ValueError, match="genuine"):
        roc_curve(np.ones(3), scores[:3])


def test_scores_labels_and_targets_the_roc_cannot_read_are_refused():
    """NaN scores gave an AUC near 0.5 (a broken model read as a coin), a label 2 a genuine pair,
    pairs of unequal lengths an IndexError, a NaN target "not enough values to unpack"."""
    labels, scores = np.array([1, 0, 1, 0, 0]), np.array([0.9, 0.8, 0.7, 0.6, 0.5])
    nan = scores.copy()
    nan[[1, 3]] = np.nan
    for call in (lambda: roc_curve(labels, nan), lambda: ijb_metrics(nan, labels, fars=(0.4,))):
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == ("scores holds NaN or inf at 2 of 5 pairs (the first: pair 1): the model's outputs "
                                "overflowed or diverged, and no ROC of them means anything")
    with pytest.raises(ValueError, match=r"^labels must hold booleans \(or 0 and 1\), got 2 \(int64\)$"):
        ijb_metrics(scores, labels * 2, fars=(0.4,))
    with pytest.raises(ValueError, match=r"^scores \(5\) and labels \(3\) must have one entry a pair$"):
        ijb_metrics(scores, labels[:3], fars=(0.4,))
    for far in (float("nan"), 0, 1, -0.1):
        with pytest.raises(ValueError, match=r"^far target must be in \(0, 1\), got "):
            ijb_metrics(scores, labels, fars=(0.4, far))
    with pytest.raises(ValueError, match=r"^fars must be numbers, got the string '0.4'$"):
        ijb_metrics(scores, labels, fars="0.4")
    assert ijb_metrics(scores, labels.astype(bool), fars=(0.4,)) == ijb_metrics(scores, labels, fars=(0.4,))


def test_roc_with_tied_scores():
    """Pairs with equal scores are one threshold, one point (sklearn's answer, worked by hand, so
    this runs without scikit-learn). Sorted: 0.9 P | 0.8 N, 0.8 P | 0.7 P, 0.7 N | 0.2 N: the
    distinct thresholds give (fp, tp) = (0, 1), (1, 2), (2, 3), (3, 3); (1, 2) lies on the straight
    run from (0, 1) to (2, 3) and is dropped."""
    fpr, tpr, thr = roc_curve(np.array([1, 0, 1, 1, 0, 0]), np.array([0.9, 0.8, 0.8, 0.7, 0.7, 0.2]))
    assert np.allclose(fpr, [0, 0, 2 / 3, 1]) and np.allclose(tpr, [0, 1 / 3, 1, 1])
    assert thr[0] == np.inf and np.allclose(thr[1:], [0.9, 0.7, 0.2])


def test_roc_of_three_thresholds_in_a_line_keeps_its_ends():
    """0.9 P | 0.8 N, 0.8 P | 0.7 N, 0.7 P: (fp, tp) = (0, 1), (1, 2), (2, 3), one straight run; its
    middle point goes, as sklearn drops it."""
    fpr, tpr, thr = roc_curve(np.array([1, 0, 1, 0, 1]), np.array([0.9, 0.8, 0.8, 0.7, 0.7]))
    assert np.allclose(fpr, [0, 0, 1]) and np.allclose(tpr, [0, 1 / 3, 1]) and np.allclose(thr[1:], [0.9, 0.7])


def test_roc_matches_sklearn_when_installed():
    metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(3)
    labels = rng.random(300) < 0.3
    scores = np.round(rng.normal(labels * 1.0, 1.0), 1)
    for ours, theirs in zip(roc_curve(labels, scores), metrics.roc_curve(labels.astype(int), scores)):
        assert np.array_equal(ours, theirs)


# ------------------------------------------------------------------- a synthetic release
IDENTITIES = 3


def _write_release(root, target="ijbc"):
    """3 identities x 2 templates, 1-4 faces each over 1-2 media, all 15 template pairs."""
    rng = np.random.default_rng(4)
    # Coarse 8x8-pixel blocks: identity shows at the scale the test model pools to.
    bases = rng.integers(0, 256, (IDENTITIES, 14, 14, 3), dtype=np.uint8).repeat(8, axis=1).repeat(8, axis=2)
    (root / "meta").mkdir(parents=True)
    (root / "loose_crop").mkdir()
    tid_mid, lmk_lines, templates = [], [], []
    face = 0
    for ident in range(IDENTITIES):
        for k in range(2):
            tid = 100 - 10 * ident - k  # ids neither contiguous nor in file order
            templates.append((tid, ident))
            for media in range(1 + (ident + k) % 2):
                for _ in range(1 + (ident + media + k) % 3):
                    noisy = np.clip(bases[ident] + rng.normal(0, 25, bases[ident].shape), 0, 255).astype(np.uint8)
                    m = _similarity(rng.uniform(-20, 20), rng.uniform(0.8, 1.3), rng.uniform(5, 20), rng.uniform(5, 20))
                    # Place the face by m: loose pixel (x, y) shows face pixel m^-1 (x, y).
                    loose = warp_affine(torch.from_numpy(noisy).permute(2, 0, 1).double(), m, (150, 150))
                    name = f"{face}.png"
                    Image.fromarray(loose.round().byte().permute(1, 2, 0).numpy()).save(root / "loose_crop" / name)
                    lmk = _apply(m, ARCFACE_TEMPLATE) + rng.normal(0, 0.5, (5, 2))
                    score = rng.uniform(0.5, 1.0)
                    tid_mid.append(f"{name} {tid} {1000 + 7 * ident + 3 * k + media}")
                    lmk_lines.append(" ".join([name] + [f"{v:.4f}" for v in lmk.reshape(-1)] + [f"{score:.6f}"]))
                    face += 1
    pairs = [f"{a} {b} {int(ia == ib)}" for i, (a, ia) in enumerate(templates) for (b, ib) in templates[i + 1:]]
    (root / "meta" / f"{target}_face_tid_mid.txt").write_text("\n".join(tid_mid) + "\n")
    (root / "meta" / f"{target}_name_5pts_score.txt").write_text("\n".join(lmk_lines) + "\n")
    (root / "meta" / f"{target}_template_pair_label.txt").write_text("\n".join(pairs) + "\n")
    return root


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.AvgPool2d(8), nn.Flatten(), nn.Linear(3 * 14 * 14, 6, bias=False))


def _reference_scores(root, model, flip, norm_score, detector_score):
    """The protocol in plain loops, from the text files."""
    tid_mid = [line.split() for line in (root / "meta/ijbc_face_tid_mid.txt").read_text().splitlines()]
    lmk = [line.split() for line in (root / "meta/ijbc_name_5pts_score.txt").read_text().splitlines()]
    pooled = {}
    for (name, tid, mid), row in zip(tid_mid, lmk):
        img = pil_to_tensor(Image.open(root / "loose_crop" / name).convert("RGB"))
        x = normalize(align_face(img, np.array([float(v) for v in row[1:11]]).reshape(5, 2)))[None]
        with torch.no_grad():
            f = model(x)[0] + (model(x.flip(-1))[0] if flip else 0)
        f = f.double().numpy()
        if not norm_score:
            f = f / np.linalg.norm(f)
        if detector_score:
            f = f * float(row[11])
        pooled.setdefault(int(tid), {}).setdefault(int(mid), []).append(f)
    feats = {}
    for tid, media in pooled.items():
        v = sum(np.mean(fs, axis=0) for fs in media.values())
        feats[tid] = v / np.linalg.norm(v)
    pairs = [line.split() for line in (root / "meta/ijbc_template_pair_label.txt").read_text().splitlines()]
    scores = [float(feats[int(a)] @ feats[int(b)]) for a, b, _ in pairs]
    return np.array(scores), np.array([int(y) for _, _, y in pairs])


@pytest.mark.parametrize(
    "flip,norm_score,detector_score,workers", [(True, True, True, 0), (False, False, False, 0), (True, False, True, 2)]
)
def test_end_to_end_matches_plain_reference(tmp_path, flip, norm_score, detector_score, workers):
    root = _write_release(tmp_path / "IJBC")
    model = _model()
    metrics, scores, meta = evaluate_ijb(
        model, root, "IJBC", batch_size=4, flip=flip, norm_score=norm_score, detector_score=detector_score,
        workers=workers,
    )
    ref_scores, labels = _reference_scores(root, model, flip, norm_score, detector_score)
    assert np.allclose(scores, ref_scores, atol=1e-6)
    assert meta.labels.tolist() == labels.tolist()
    assert metrics == pytest.approx(ijb_metrics(scores, labels), nan_ok=True)
    assert set(k for k in metrics if k.startswith("tar@far=")) == {f"tar@far=1e-{i}" for i in range(1, 7)}
    # Aligned same-identity templates must score above the other pairs on average: alignment works.
    assert ref_scores[labels == 1].mean() > ref_scores[labels == 0].mean() + 0.2
    files = write_ijb_report(tmp_path / "out", "IJBC", scores, labels)
    assert all(f.is_file() for f in files)
    assert np.allclose(np.load(tmp_path / "out" / "ijbc_scores.npy"), scores)


def test_bad_releases_are_named(tmp_path):
    root = _write_release(tmp_path / "r")
    with pytest.raises(ValueError, match=r"^target \(shardfc eval --ijb-target\) must be one of IJBB, IJBC, got 'IJBA'$"):
        read_ijb_meta(root, "IJBA")
    with pytest.raises(FileNotFoundError, match=r"^root \(shardfc eval --ijb\) '.*nowhere' is not a folder$"):
        read_ijb_meta(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="ijbb_face_tid_mid"):
        read_ijb_meta(root, "IJBB")
    lmk = root / "meta" / "ijbc_name_5pts_score.txt"
    good = lmk.read_text()
    lmk.write_text(good.replace("1.png", "9.png", 1))
    with pytest.raises(ValueError, match=r"ijbc_name_5pts_score.txt:2: face '9.png'.*same order"):
        read_ijb_meta(root)
    lmk.write_text(good.replace(" ", "  x ", 1))
    with pytest.raises(ValueError, match=r"ijbc_name_5pts_score.txt:1: expected 12 fields"):
        read_ijb_meta(root)
    lmk.write_text(good)
    pairs = root / "meta" / "ijbc_template_pair_label.txt"
    pairs.write_text(pairs.read_text() + "100 4242 0\n")
    with pytest.raises(ValueError, match="templates without faces.*4242"):
        read_ijb_meta(root)
    pairs.write_text("100 90 2\n")
    with pytest.raises(ValueError, match="label must be 0 or 1"):
        read_ijb_meta(root)
    pairs.write_text("100 90 1\n100 80 0\n")
    (root / "loose_crop" / "3.png").unlink()
    with pytest.raises(FileNotFoundError, match="3.png"):
        evaluate_ijb(_model(), root)


def test_ijb_tar_at_far_needs_one_over_far_impostor_pairs():
    # The nearest ROC point to FAR 1e-2 on 50 impostors is FPR 0: a figure that measures nothing.
    rng = np.random.default_rng(0)
    labels = np.r_[np.ones(30, int), np.zeros(50, int)]
    scores = np.where(labels == 1, rng.normal(0.6, 0.2, 80), rng.normal(0.1, 0.2, 80))
    m = ijb_metrics(scores, labels, fars=(1e-2, 1e-1))
    assert m["num_negative_pairs"] == 50
    assert math.isnan(m["tar@far=1e-2"]) and math.isnan(m["exact_tar@far=1e-2"])
    assert math.isfinite(m["tar@far=1e-1"]) and math.isfinite(m["exact_tar@far=1e-1"])
    fpr, tpr, _ = roc_curve(labels, scores)
    assert m["tar@far=1e-1"] == tar_at_nearest_far(fpr, tpr, 0.1)
