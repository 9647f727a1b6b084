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
        ("-001_c2s1_000267_00.png", (-1, 2)),  # junk's id written zero-padded, as %04d writes -1
        ("0000_c6s4_002227_00.jpg", (0, 6)),
        ("/data/Market/query/1501_c6s4_001877_00.jpg", (1501, 6)),
        ("0001_c2_f0046182.jpg", (1, 2)),  # DukeMTMC-reID
    ],
)
def test_parse_market1501_name(name, expected):
    assert parse_market1501_name(name) == expected


@pytest.mark.parametrize("name", ["Thumbs.db", "-5_c1s1_000451_03.jpg", "-10_c1.jpg", "--1_c1.jpg", "-0005_c1.jpg",
                                  "\u0663_c1s1.jpg", "0002_c\u0661s1.jpg", "0002_s1.jpg", "_c1.jpg"])
def test_parse_rejects_other_names(name):
    # -5 was a person (only -1, junk, is negative); another script's digits read as ASCII ones
    with pytest.raises(ValueError) as e:
        parse_market1501_name(name)
    assert str(e.value) == (f"cannot parse person/camera id from {name!r}: expected a Market-1501 name like "
                            "'0002_c1s1_000451_03.jpg'")


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
    with pytest.raises(ValueError, match=r"^image_size must be a \(height, width\) pair of positive ints, got \(0, 8\)$"):
        ReIDFolder(tmp_path / "nope", image_size=(0, 8))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no usable images"):
        ReIDFolder(tmp_path / "empty")


def test_evaluate_reid_colour_model(market):
    model = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())  # mean colour = identity
    m = evaluate_reid(model, market, image_size=(16, 8), batch_size=2)
    assert m["rank1"] == 1.0 and m["mAP"] == 1.0 and m["num_valid_queries"] == 2


# ------------------------------------------------------------------- each message, each pass-through


def _refused(*args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        reid_metrics(*args, **kwargs)
    return str(info.value)


def test_each_input_is_named_when_wrong():
    f, p, c = torch.randn(2, 3), [1, 2], [1, 2]
    assert _refused(torch.tensor(1.0), p, c, f, p, c) == "query_feats must be an array, got a scalar"
    assert _refused(f, p, c, torch.tensor(1.0), p, c) == "gallery_feats must be an array, got a scalar"
    for i, name in enumerate(("query_pids", "query_cams")):
        args = [f, p, c, f, p, c]
        args[1 + i] = 7
        assert _refused(*args) == f"{name} must be an array, got a scalar"
    for i, name in enumerate(("gallery_pids", "gallery_cams")):
        args = [f, p, c, f, p, c]
        args[4 + i] = 7
        assert _refused(*args) == f"{name} must be an array, got a scalar"
    assert _refused(torch.randn(3), p, c, f, p, c) == (
        "query_feats and gallery_feats must be [Q, D] and [G, D] with equal D, got (3,) and (2, 3)")
    assert _refused(f, p, c, torch.randn(3), p, c) == (
        "query_feats and gallery_feats must be [Q, D] and [G, D] with equal D, got (2, 3) and (3,)")
    assert _refused(f, [1], c, f, p, c) == "query_pids (1) and query_cams (2) must match query_feats (2)"
    assert _refused(f, p, c, f, p, [1, 2, 3]) == "gallery_pids (2) and gallery_cams (3) must match gallery_feats (2)"
    for ranks in ((1, 0), (1, 1.5), (True,), "15", (1, "5")):  # (1, 1.5) gave two rank1 columns
        assert _refused(f, p, c, f, p, c, ranks=ranks) == f"ranks must be positive ints, got {ranks!r}"
    for size in (0, 1.5, True):
        assert _refused(f, p, c, f, p, c, chunk_size=size) == f"chunk_size must be an int >= 1, got {size!r}"
    assert set(reid_metrics(f, p, c, f, [1, 1], [1, 2], ranks=(np.int64(2),))) == {
        "rank2", "mAP", "num_valid_queries", "num_skipped_queries"}


def test_ids_of_any_integer_type_and_float_features():
    qf, qp, qc, gf, gp, gc = _hand_example()
    expected = reid_metrics(qf, qp, qc, gf, gp, gc)
    got = reid_metrics(qf.double(), qp.int(), qc.short(), gf.half().float(), gp.numpy().astype(np.int32),
                       gc.numpy().astype(np.uint8))
    assert got == pytest.approx(expected)


def test_ids_given_as_whole_floats_count_and_any_other_value_is_refused():
    qf, qp, qc, gf, gp, gc = _hand_example()
    expected = reid_metrics(qf, qp, qc, gf, gp, gc)
    assert reid_metrics(qf, qp.double(), qc.numpy().astype(np.float32), gf, gp.tolist(), gc) == pytest.approx(expected)
    # 1.5 was truncated into id 1's, silently; strings were torch's TypeError, naming no input
    for bad, name, shown in [(qp.double() + 0.5, "query_pids", "must hold whole numbers (ids), got 1.5"),
                             (np.full(len(qc), np.nan), "query_cams", "must hold whole numbers (ids), got nan"),
                             ([str(p) for p in gp.tolist()], "gallery_pids", f"must hold numbers, got <U2 values such as "
                                                                               f"{str(gp.tolist()[0])!r}")]:  # ('-1')
        args = dict(query_pids=qp, query_cams=qc, gallery_pids=gp, gallery_cams=gc)
        args[name] = bad
        with pytest.raises(ValueError) as err:
            reid_metrics(qf, args["query_pids"], args["query_cams"], gf, args["gallery_pids"], args["gallery_cams"])
        assert str(err.value) == f"{name} {shown}"
    with pytest.raises(ValueError, match=r"^query_pids must hold numbers, got <U1 values such as None$"):
        reid_metrics(qf[:0], np.array([], dtype="<U1"), [], gf, gp, gc)  # none to show


def test_skipped_queries_are_counted_over_every_chunk(caplog):
    """One query skipped in each of two chunks, a valid query after a skipped one in a chunk."""
    qf, qp, qc, gf, gp, gc = _hand_example()
    order = [2, 0, 2, 1]  # q3 (skipped), q1, q3 again, q2
    with caplog.at_level(logging.WARNING, logger="shardfc.evaluation"):
        m = reid_metrics(qf[order], qp[order], qc[order], gf, gp, gc, chunk_size=2)
    assert (m["num_valid_queries"], m["num_skipped_queries"]) == (2, 2)
    assert m["mAP"] == pytest.approx((5 / 6 + 1 / 2) / 2)
    assert [r.getMessage() for r in caplog.records] == [
        "reid_metrics: skipped 2 of 4 queries without a valid gallery match"]
    order = [2, 2, 0, 1]  # a first chunk of skipped queries only: the next chunks still count
    m = reid_metrics(qf[order], qp[order], qc[order], gf, gp, gc, chunk_size=2)
    assert (m["num_valid_queries"], m["num_skipped_queries"]) == (2, 2)


def test_features_that_require_grad_are_read_detached():
    qf, qp, qc, gf, gp, gc = _hand_example()
    expected = reid_metrics(qf, qp, qc, gf, gp, gc)
    assert reid_metrics(qf.requires_grad_(), qp, qc, gf.requires_grad_(), gp, gc) == pytest.approx(expected)


def test_the_default_chunk_is_256_queries(monkeypatch):
    seen = []
    real_sort = torch.sort
    monkeypatch.setattr(torch, "sort", lambda x, **kw: seen.append(x.shape[0]) or real_sort(x, **kw))
    qf = torch.randn(300, 4)
    reid_metrics(qf, torch.ones(300), torch.ones(300), qf, torch.ones(300), torch.full((300,), 2))
    assert seen == [256, 44]


def test_ties_keep_the_gallerys_order():
    """Equal scores rank in gallery order (a stable sort): a wrong match listed first is ranked first."""
    g = 4000  # long enough that an unstable sort reorders ties
    gf = torch.ones(g, 2)
    gp = torch.full((g,), 5)
    gp[-1] = 1  # the only match, last of thousands of equal scores
    m = reid_metrics(torch.ones(1, 2), [1], [1], gf, gp, torch.full((g,), 2), ranks=(1, g))
    assert m["rank1"] == 0.0 and m[f"rank{g}"] == 1.0 and m["mAP"] == pytest.approx(1 / g)


def test_a_query_image_linked_out_of_its_folder_is_refused(market, tmp_path):
    outside = tmp_path / "outside.jpg"
    _img(outside, 1)
    (market / "query" / "0003_c1s1_000009_00.jpg").symlink_to(outside)
    query = ReIDFolder(market / "query", image_size=(16, 8))
    from shardfc.data import CorruptImageError

    with pytest.raises(CorruptImageError, match="outside"):
        query[2]


def test_a_folder_skips_hidden_and_foreign_files_and_reads_on(tmp_path):
    root = tmp_path / "q"
    root.mkdir()
    _img(root / "0001_c1s1_000001_00.jpg", 1)
    _img(root / ".0002_c1s1_000001_00.jpg", 2)  # hidden: skipped
    (root / "0002_c1.txt").write_text("x")  # not an image: skipped, and the next one still read
    _img(root / "0003_c1s1_000001_00.jpg", 3)
    folder = ReIDFolder(root, image_size=(4, 2))
    assert folder.pids.tolist() == [1, 3] and folder.pids.dtype == folder.cams.dtype == torch.int64
    assert repr(folder) == f"ReIDFolder(root={str(root)!r}, images=2)"


class _Recorder(nn.Module):
    """Mean colour as the embedding; records each batch's shape."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def forward(self, x):
        self.shapes.append(tuple(x.shape))
        return x.mean(dim=(2, 3))


def test_evaluate_reid_passes_its_options_on(market):
    model = _Recorder()
    m = evaluate_reid(model, market)  # defaults: 256x128, batch 64, flipped too
    assert model.shapes == [(2, 3, 256, 128)] * 2 + [(5, 3, 256, 128)] * 2
    assert set(m) == {"rank1", "rank5", "rank10", "mAP", "num_valid_queries", "num_skipped_queries"}
    model = _Recorder()
    m = evaluate_reid(model, market, image_size=(16, 8), batch_size=3, flip=False, device="cpu", ranks=(2,))
    assert model.shapes == [(2, 3, 16, 8), (3, 3, 16, 8), (2, 3, 16, 8)]
    assert set(m) == {"rank2", "mAP", "num_valid_queries", "num_skipped_queries"}
    query, gallery = load_reid_split(market)
    assert query[0][0].shape == gallery[0][0].shape == (3, 256, 128)


def test_evaluate_reid_decodes_64_images_a_batch_in_its_own_process_by_default(tmp_path, monkeypatch):
    root = tmp_path / "m"
    (root / "query").mkdir(parents=True)
    (root / "bounding_box_test").mkdir()
    _img(root / "query" / "0001_c1s1_000001_00.jpg", 1)
    for i in range(65):
        _img(root / "bounding_box_test" / f"0001_c2s1_{i:06d}_00.jpg", 1)
    real = ReIDFolder.__getitem__
    in_worker = {"expected": False}

    def checked(self, index):
        assert (torch.utils.data.get_worker_info() is not None) == in_worker["expected"], "decoded in the wrong process"
        return real(self, index)

    monkeypatch.setattr(ReIDFolder, "__getitem__", checked)
    model = _Recorder()
    evaluate_reid(model, root, image_size=(8, 4), flip=False)
    assert model.shapes == [(1, 3, 8, 4), (64, 3, 8, 4), (1, 3, 8, 4)]
    in_worker["expected"] = True  # and in a DataLoader worker when asked
    evaluate_reid(_Recorder(), root, image_size=(8, 4), flip=False, num_workers=1)


def test_under_a_label_the_query_and_the_gallery_each_show_a_bar_of_their_batches(market, bars):
    from shardfc import progress

    with progress.labelled("reid"):
        evaluate_reid(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten()), market, image_size=(16, 8), batch_size=2)
    assert [(kw["desc"], kw["total"]) for kw in bars] == [("reid", 1), ("reid", 3)]  # 2 query, 5 gallery images
