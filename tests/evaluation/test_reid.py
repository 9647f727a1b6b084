import logging

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from shardfc.evaluation import ReIDFolder, evaluate_reid, load_reid_split, parse_market1501_name, reid_metrics


@pytest.mark.parametrize(
    "name, expected",
    [
        ("0002_c1s1_000451_03.jpg", (2, 1)),
        ("-1_c3s2_012345_01.jpg", (-1, 3)),
        ("0000_c6s4_002227_00.jpg", (0, 6)),
        ("/data/Market/query/1501_c6s4_001877_00.jpg", (1501, 6)),
        ("0001_c2_f0046182.jpg", (1, 2)),  # DukeMTMC-reID
    ],
)
def test_parse_market1501_name(name, expected):
    assert parse_market1501_name(name) == expected


def test_parse_rejects_other_names():
    with pytest.raises(ValueError, match="Thumbs.db"):
        parse_market1501_name("Thumbs.db")


# Gallery (index: pid, camera). Features are one-hot, so a query's similarity
# to gallery entry j is proportional to its j-th coordinate.
GALLERY = [(1, 1), (1, 2), (-1, 2), (2, 1), (0, 3), (1, 3), (2, 2), (3, 1)]


def _query_scores(order):
    """Query feature ranking gallery entries in ``order`` (best first)."""
    f = torch.zeros(len(GALLERY))
    for rank, j in enumerate(order):
        f[j] = len(GALLERY) - rank
    return f


def _hand_example():
    # q1 (pid 1, cam 1): ranking 0 1 2 3 5 4 6 7
    #   0 same pid+cam -> excluded; 1 hit (valid rank 1); 2 junk -> excluded;
    #   3 miss (rank 2); 5 hit (rank 3)  => AP = (1/1 + 2/3) / 2 = 5/6, rank-1 hit.
    # q2 (pid 2, cam 2): ranking 6 2 4 3 0 1 5 7
    #   6 same pid+cam -> excluded; 2 junk -> excluded; 4 distractor miss (rank 1);
    #   3 hit (rank 2)  => AP = 1/2, first hit at rank 2.
    # q3 (pid 3, cam 1): its only gallery image (7) shares its camera -> skipped.
    qf = torch.stack(
        [
            _query_scores([0, 1, 2, 3, 5, 4, 6, 7]),
            _query_scores([6, 2, 4, 3, 0, 1, 5, 7]),
            _query_scores([7, 0, 1, 2, 3, 4, 5, 6]),
        ]
    )
    gf = torch.eye(len(GALLERY)) * 2.0  # scale must not matter
    gp = torch.tensor([p for p, _ in GALLERY])
    gc = torch.tensor([c for _, c in GALLERY])
    return qf, torch.tensor([1, 2, 3]), torch.tensor([1, 2, 1]), gf, gp, gc


def test_hand_computed_cmc_and_map(caplog):
    qf, qp, qc, gf, gp, gc = _hand_example()
    with caplog.at_level(logging.WARNING, logger="shardfc.evaluation"):
        m = reid_metrics(qf, qp, qc, gf, gp, gc, ranks=(1, 2, 5, 10))
    assert m["rank1"] == pytest.approx(0.5)
    assert m["rank2"] == pytest.approx(1.0)
    assert m["rank5"] == pytest.approx(1.0) and m["rank10"] == pytest.approx(1.0)
    assert m["mAP"] == pytest.approx((5 / 6 + 1 / 2) / 2)
    assert m["num_valid_queries"] == 2 and m["num_skipped_queries"] == 1
    assert any("skipped 1 of 3" in r.getMessage() for r in caplog.records)


def test_chunking_and_numpy_inputs_do_not_change_results():
    qf, qp, qc, gf, gp, gc = _hand_example()
    m1 = reid_metrics(qf, qp, qc, gf, gp, gc)
    m2 = reid_metrics(qf.numpy(), qp.numpy(), qc.numpy(), gf.numpy(), gp.tolist(), gc.tolist(), chunk_size=1)
    assert m1 == pytest.approx(m2)


def _brute_force(qf, qp, qc, gf, gp, gc, ranks):
    qf = qf / np.linalg.norm(qf, axis=1, keepdims=True)
    gf = gf / np.linalg.norm(gf, axis=1, keepdims=True)
    cmc_hits, aps = {k: 0 for k in ranks}, []
    for i in range(len(qf)):
        order = sorted(range(len(gf)), key=lambda j: -float(qf[i] @ gf[j]))
        kept = [j for j in order if gp[j] != -1 and not (gp[j] == qp[i] and gc[j] == qc[i])]
        hits = [r for r, j in enumerate(kept) if gp[j] == qp[i]]
        if not hits:
            continue
        for k in ranks:
            cmc_hits[k] += hits[0] < k
        aps.append(np.mean([(n + 1) / (r + 1) for n, r in enumerate(hits)]))
    out = {f"rank{k}": cmc_hits[k] / len(aps) for k in ranks}
    out["mAP"] = float(np.mean(aps))
    return out


def test_against_brute_force():
    rng = np.random.default_rng(0)
    qp, qc = rng.integers(1, 6, 15), rng.integers(1, 4, 15)
    gp, gc = rng.integers(-1, 6, 60), rng.integers(1, 4, 60)
    centres = rng.normal(size=(7, 8))
    qf = centres[qp + 1] + 1.5 * rng.normal(size=(15, 8))
    gf = centres[gp + 1] + 1.5 * rng.normal(size=(60, 8))
    m = reid_metrics(qf, qp, qc, gf, gp, gc, ranks=(1, 3, 5), chunk_size=4)
    expected = _brute_force(qf, qp, qc, gf, gp, gc, (1, 3, 5))
    for key, value in expected.items():
        assert m[key] == pytest.approx(value), key


def test_no_valid_query_raises():
    with pytest.raises(ValueError, match="valid gallery match"):
        reid_metrics(torch.eye(2), [1, 2], [1, 1], torch.eye(2), [1, 2], [1, 1])


def test_shape_validation():
    with pytest.raises(ValueError, match="equal D"):
        reid_metrics(torch.randn(2, 3), [1, 2], [1, 1], torch.randn(2, 4), [1, 2], [2, 2])
    with pytest.raises(ValueError, match="query_pids"):
        reid_metrics(torch.randn(2, 3), [1], [1, 1], torch.randn(2, 3), [1, 2], [2, 2])


# ------------------------------------------------------------------- folders
COLOURS = {1: (255, 0, 0), 2: (0, 255, 0), 3: (0, 0, 255), 0: (128, 128, 128), -1: (255, 0, 0)}


def _img(path, pid):
    Image.fromarray(np.full((12, 6, 3), COLOURS[pid], dtype=np.uint8)).save(path)


@pytest.fixture
def market(tmp_path):
    root = tmp_path / "Market-1501"
    q, g = root / "query", root / "bounding_box_test"
    q.mkdir(parents=True)
    g.mkdir()
    for name, pid in [("0001_c1s1_000001_00.jpg", 1), ("0002_c2s1_000001_00.jpg", 2)]:
        _img(q / name, pid)
    for name, pid in [
        ("0001_c2s1_000002_01.jpg", 1),
        ("0001_c1s1_000003_01.jpg", 1),  # same camera as the query: excluded
        ("0002_c1s1_000004_01.jpg", 2),
        ("0003_c1s1_000005_01.jpg", 3),
        ("0000_c3s1_000006_01.jpg", 0),  # distractor
        ("-1_c1s1_000007_01.jpg", -1),  # junk, identical colour to pid 1
    ]:
        _img(g / name, pid)
    (g / "Thumbs.db").write_bytes(b"x")
    return root


def test_reid_folder_and_split(market):
    query, gallery = load_reid_split(market, image_size=(16, 8))
    assert len(query) == 2 and len(gallery) == 5  # junk dropped, Thumbs.db ignored
    assert query.pids.tolist() == [1, 2] and query.cams.tolist() == [1, 2]
    assert -1 not in gallery.pids.tolist()
    x, pid, cam = gallery[0]
    assert x.shape == (3, 16, 8) and (pid, cam) == (0, 3)
    assert len(ReIDFolder(market / "bounding_box_test", drop_junk=False)) == 6


def test_reid_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        ReIDFolder(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no usable images"):
        ReIDFolder(tmp_path / "empty")


def test_evaluate_reid_colour_model(market):
    model = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())  # mean colour = identity
    m = evaluate_reid(model, market, image_size=(16, 8), batch_size=2)
    assert m["rank1"] == 1.0 and m["mAP"] == 1.0 and m["num_valid_queries"] == 2
