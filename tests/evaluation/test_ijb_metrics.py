"""IJB's arithmetic at its edges: template pooling, the ROC, the nearest-FAR pick, the metrics dict,
what ``evaluate_ijb`` hands the embedding and does with its features, and the report it writes.

``test_ijb.py`` holds the protocol end to end against plain loops over a synthetic release; here the
pieces, each against a value worked by hand.
"""

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import shardfc.evaluation.ijb as ijb
from shardfc.evaluation.ijb import (
    IJBMeta,
    evaluate_ijb,
    ijb_metrics,
    roc_curve,
    tar_at_nearest_far,
    template_features,
    template_pair_scores,
    write_ijb_report,
)


def test_template_features_in_float64_and_a_cancelling_template_stays_zero():
    rng = np.random.default_rng(0)
    feats = rng.normal(size=(6, 3)).astype(np.float32)
    templates, medias = np.array([5, 5, 9, 9, 2, 2]), np.array([1, 2, 1, 1, 3, 3])
    got, ids = template_features(feats, templates, medias)
    want, _ = template_features(feats.astype(np.float64), templates, medias)
    assert got.dtype == np.float64 and np.array_equal(got, want) and ids.tolist() == [2, 5, 9]
    # template 9's two faces of one media cancel: its feature is zero, not NaN; the others are unit
    feats = np.array([[1.0, 2.0], [3.0, -1.0], [1.0, 1.0], [-1.0, -1.0], [0.6, 0.8], [0.6, 0.8]])
    got, _ = template_features(feats, templates, medias)
    assert got[2].tolist() == [0.0, 0.0]
    assert np.allclose(np.linalg.norm(got[:2], axis=1), 1.0) and np.allclose(got[0], [0.6, 0.8])
    assert template_pair_scores(got, ids, np.array([[9, 5], [2, 2]])).tolist() == [0.0, pytest.approx(1.0)]


def test_roc_drops_the_middle_of_a_straight_run_of_three():
    # Sorted: 0.9 P | 0.8 P, 0.8 N | 0.7 P, 0.7 N: (fp, tp) = (0, 1), (1, 2), (2, 3), one straight run.
    fpr, tpr, thr = roc_curve(np.array([1, 1, 0, 1, 0]), np.array([0.9, 0.8, 0.8, 0.7, 0.7], dtype=np.float32))
    assert fpr.tolist() == [0.0, 0.0, 1.0] and tpr.tolist() == [0.0, 1 / 3, 1.0]
    assert thr.dtype == np.float64 and thr[0] == np.inf and thr[1:].tolist() == pytest.approx([0.9, 0.7])


@pytest.mark.parametrize("labels", [[1, 1, 1], [0, 0, 0]])
def test_roc_needs_both_kinds_of_pairs(labels):
    with pytest.raises(ValueError, match=r"^the template pairs need both genuine \(label 1\) and impostor "
                                         r"\(label 0\) pairs for a ROC$"):
        roc_curve(np.array(labels), np.array([0.1, 0.2, 0.3]))


def test_nearest_far_picks_the_last_of_equally_near_points():
    fpr = np.array([0.0, 0.1, 0.2, 0.3, 0.3, 0.3, 0.5, 1.0])
    tpr = np.array([0.0, 0.2, 0.4, 0.5, 0.6, 0.7, 0.9, 1.0])
    assert tar_at_nearest_far(fpr, tpr, 0.31) == 0.7  # fpr 0.3 three times: the last
    assert tar_at_nearest_far(fpr, tpr, 0.12) == 0.2
    assert tar_at_nearest_far(fpr, tpr, 0.9) == 1.0


def test_ijb_metrics_by_hand():
    # Sorted: 0.9 P, 0.8 N, 0.7 P, 0.6 N, 0.5 N: fpr [0, 0, 1/3, 1/3, 1], tpr [0, 1/2, 1/2, 1, 1];
    # area 1/2 * 1/3 + 1 * 2/3.
    m = ijb_metrics(np.array([0.9, 0.8, 0.7, 0.6, 0.5]), np.array([1, 0, 1, 0, 0]), fars=(0.4, 0.1))
    assert list(m) == ["auc", "num_pairs", "num_negative_pairs", "tar@far=4e-1", "exact_tar@far=4e-1",
                       "tar@far=1e-1", "exact_tar@far=1e-1"]
    assert m["auc"] == pytest.approx(1 / 6 + 2 / 3)
    assert (m["num_pairs"], m["num_negative_pairs"], m["tar@far=4e-1"], m["exact_tar@far=4e-1"]) == (5.0, 3.0, 1.0, 1.0)
    assert math.isnan(m["tar@far=1e-1"]) and math.isnan(m["exact_tar@far=1e-1"])


# ------------------------------------------------------------------ evaluate_ijb's own steps
def _meta(root="nowhere", target="IJBC"):
    """Four faces: template 1 holds a and b (one media), template 2 c and d (a media each); the pairs
    are template 1 with itself (genuine) and with template 2 (impostor)."""
    return IJBMeta(
        root=Path(root), target=target, names=["a", "b", "c", "d"],
        templates=np.array([1, 1, 2, 2]), medias=np.array([10, 10, 20, 21]),
        landmarks=np.zeros((4, 5, 2)), scores=np.array([0.5, 1.0, 0.25, 2.0]),
        pairs=np.array([[1, 1], [1, 2]]), labels=np.array([1, 0]),
    )


FEATS = np.array([[3.0, 0.0], [0.0, 1.0], [0.0, 0.0], [1.0, 1.0]])  # face c's feature is zero


@pytest.fixture
def embedded(monkeypatch):
    calls = []

    def embed(model, meta, batch_size, flip, device, image_size, workers):
        calls.append(dict(model=model, meta=meta, batch_size=batch_size, flip=flip, device=device,
                          image_size=image_size, workers=workers))
        return FEATS.copy()

    monkeypatch.setattr(ijb, "embed_ijb_faces", embed)
    monkeypatch.setattr(ijb, "read_ijb_meta", lambda root, target: calls.append(("read", root, target)) or _meta(root, target))
    return calls


def _scores(feats, norm_score, detector_score):
    f = feats / np.maximum(np.linalg.norm(feats, axis=1, keepdims=True), 1e-300) if not norm_score else feats
    f = f * _meta().scores[:, None] if detector_score else f
    t1, t2 = (f[0] + f[1]) / 2, f[2] + f[3]  # a media's mean, summed over media
    return np.array([1.0, t1 @ t2 / np.linalg.norm(t1) / np.linalg.norm(t2)])


def test_evaluate_ijb_defaults_and_what_it_hands_on(embedded):
    model = object()
    metrics, scores, meta = evaluate_ijb(model, "/release")
    assert embedded[0] == ("read", "/release", "IJBC")
    assert embedded[1] == dict(model=model, meta=meta, batch_size=64, flip=True, device=None,
                               image_size=(112, 112), workers=0)
    assert scores == pytest.approx(_scores(FEATS, norm_score=True, detector_score=True))
    assert metrics == pytest.approx(ijb_metrics(scores, meta.labels), nan_ok=True)
    embedded.clear()
    evaluate_ijb(model, "/other", "IJBB", batch_size=3, flip=False, device="meta", image_size=(96, 80), workers=2)
    assert embedded[0] == ("read", "/other", "IJBB")
    assert {k: embedded[1][k] for k in ("batch_size", "flip", "device", "image_size", "workers")} == dict(
        batch_size=3, flip=False, device="meta", image_size=(96, 80), workers=2)


@pytest.mark.parametrize("norm_score, detector_score", [(False, True), (True, False), (False, False)])
def test_evaluate_ijb_normalises_and_weighs_each_face(embedded, norm_score, detector_score):
    given = _meta("/given")
    _, scores, meta = evaluate_ijb(object(), "/unread", meta=given, norm_score=norm_score, detector_score=detector_score)
    assert meta is given and not [call for call in embedded if isinstance(call, tuple)]  # not read again
    assert np.all(np.isfinite(scores))  # face c's zero feature stays zero under N0
    assert scores == pytest.approx(_scores(FEATS, norm_score, detector_score))


# ------------------------------------------------------------------ the report
def test_report_files_and_the_plot(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    closed = []
    monkeypatch.setattr(plt, "close", lambda fig: closed.append(fig))
    monkeypatch.setitem(plt.rcParams, "figure.dpi", 50)  # a user's matplotlibrc: the report still at 100
    labels, scores = np.array([1, 0, 1, 0, 0]), np.array([0.9, 0.8, 0.7, 0.6, 0.5])
    out = tmp_path / "deep" / "er"
    files = write_ijb_report(out, "IJBC", scores, labels)
    assert files == [out / "ijbc_scores.npy", out / "ijbc_roc.csv", out / "ijbc_roc.png"]
    assert (out / "ijbc_roc.csv").read_text().splitlines() == [
        "fpr,tpr,threshold",
        "0.000000000000000000e+00,0.000000000000000000e+00,inf",
        "0.000000000000000000e+00,5.000000000000000000e-01,9.000000000000000222e-01",
        "3.333333333333333148e-01,5.000000000000000000e-01,8.000000000000000444e-01",
        "3.333333333333333148e-01,1.000000000000000000e+00,6.999999999999999556e-01",
        "1.000000000000000000e+00,1.000000000000000000e+00,5.000000000000000000e-01",
    ]
    (fig,) = closed
    ax = fig.axes[0]
    assert tuple(fig.get_size_inches()) == (5.0, 4.0)
    assert (ax.get_xscale(), ax.get_xlim(), ax.get_ylim()) == ("log", (1e-6, 1e-1), (0.3, 1.0))
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) == ("False accept rate", "True accept rate", "ROC on IJBC")
    (line,) = ax.get_lines()
    fpr, tpr, _ = roc_curve(labels, scores)
    assert line.get_xdata().tolist() == fpr[1:].tolist() and line.get_ydata().tolist() == tpr[1:].tolist()
    assert line.get_linewidth() == 1
    from PIL import Image

    with Image.open(out / "ijbc_roc.png") as png:
        assert [round(v) for v in png.info["dpi"]] == [100, 100]
        assert png.size != (500, 400)  # cropped to what is drawn, not the whole 5 x 4 inch canvas
    # written again into the same folder: replaced
    write_ijb_report(out, "IJBC", scores[::-1], labels[::-1])
    assert np.load(out / "ijbc_scores.npy").tolist() == scores[::-1].tolist()


@pytest.mark.parametrize("failing", ["save", "savetxt", "savefig"])
def test_a_report_that_fails_midway_leaves_the_previous_files_whole(tmp_path, monkeypatch, failing):
    import matplotlib.figure

    labels, scores = np.array([1, 0, 1, 0]), np.array([0.9, 0.8, 0.7, 0.6])
    write_ijb_report(tmp_path, "IJBC", scores, labels)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert sorted(before) == ["ijbc_roc.csv", "ijbc_roc.png", "ijbc_scores.npy"]

    def crash(*args, **kwargs):  # a disk filling up after part of the file (or a signal)
        target = args[1] if failing == "savefig" else args[0]
        (target.write(b"partial") if hasattr(target, "write") else open(target, "wb").write(b"partial"))
        raise OSError(28, "No space left on device")

    if failing == "savefig":
        monkeypatch.setattr(matplotlib.figure.Figure, "savefig", crash)
    else:
        monkeypatch.setattr(np, failing, crash)
    with pytest.raises(OSError, match="No space left on device"):
        write_ijb_report(tmp_path, "IJBC", scores[::-1], labels[::-1])
    written = {"save": 0, "savetxt": 1, "savefig": 2}[failing]  # the files before the failing one: the new ones
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert sorted(after) == sorted(before)  # no scratch file left behind
    for name in ["ijbc_scores.npy", "ijbc_roc.csv", "ijbc_roc.png"][written:]:
        assert after[name] == before[name]  # the failing file and those after it: as they were, whole


def test_report_without_matplotlib(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    files = write_ijb_report(tmp_path, "IJBB", np.array([0.2, 0.1]), np.array([1, 0]))
    assert files == [tmp_path / "ijbb_scores.npy", tmp_path / "ijbb_roc.csv"]
    assert not (tmp_path / "ijbb_roc.png").exists()


def test_workers_run_one_thread_each():
    before = torch.get_num_threads()
    try:
        ijb._one_thread(3)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
