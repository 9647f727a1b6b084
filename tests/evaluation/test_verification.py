import io
import math
import os
import pickle

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from shardfc.data import CorruptImageError
from shardfc.evaluation import (
    embed_images,
    evaluate_verification,
    kfold_indices,
    load_bin,
    verification_metrics,
)


# ------------------------------------------------------------------ load_bin
def _png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def _normalised(arr: np.ndarray) -> torch.Tensor:
    return (torch.from_numpy(arr).permute(2, 0, 1).float() / 255 - 0.5) / 0.5


@pytest.fixture
def bin_fixture(tmp_path):
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, size=(8, 6, 3), dtype=np.uint8) for _ in range(6)]
    # Mix the encodings found in the wild: bytes and uint8 numpy arrays.
    bins = [_png(a) if i % 2 == 0 else np.frombuffer(_png(a), dtype=np.uint8) for i, a in enumerate(arrays)]
    issame = [True, False, True]
    path = tmp_path / "tiny.bin"
    with open(path, "wb") as f:
        pickle.dump((bins, issame), f, protocol=pickle.HIGHEST_PROTOCOL)
    return path, arrays, issame


def test_load_bin_round_trip(bin_fixture):
    path, arrays, issame = bin_fixture
    images, same = load_bin(path, image_size=(8, 6))
    assert images.shape == (6, 3, 8, 6) and images.dtype == torch.float32
    assert same.dtype == torch.bool and same.tolist() == issame
    for img, arr in zip(images, arrays):
        torch.testing.assert_close(img, _normalised(arr))


def test_load_bin_resizes(bin_fixture):
    path, _, _ = bin_fixture
    images, _ = load_bin(path, image_size=(16, 12))
    assert images.shape == (6, 3, 16, 12)


def test_load_bin_python2_style_pickle(tmp_path):
    arr = np.zeros((4, 4, 3), dtype=np.uint8)
    path = tmp_path / "p2.bin"
    with open(path, "wb") as f:
        pickle.dump(([_png(arr), _png(arr)], [np.bool_(True)]), f, protocol=2)
    images, same = load_bin(path, image_size=(4, 4))
    assert images.shape == (2, 3, 4, 4) and same.tolist() == [True]


class _Evil:
    def __reduce__(self):
        return (os.getcwd, ())


def test_load_bin_refuses_arbitrary_globals(tmp_path):
    path = tmp_path / "evil.bin"
    with open(path, "wb") as f:
        pickle.dump(([_Evil(), b""], [True]), f)
    with pytest.raises(ValueError, match="refusing to unpickle global .*getcwd"):
        load_bin(path)


def test_load_bin_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.bin"):
        load_bin(tmp_path / "missing.bin")
    bad = tmp_path / "bad.bin"
    bad.write_bytes(pickle.dumps([b"only", b"three", b"things"]))
    with pytest.raises(ValueError, match="bins, issame_list"):
        load_bin(bad)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(pickle.dumps(([_png(np.zeros((2, 2, 3), np.uint8))] * 3, [True])))
    with pytest.raises(ValueError, match="3 images for 1 pairs"):
        load_bin(odd)
    corrupt = tmp_path / "corrupt.bin"
    corrupt.write_bytes(pickle.dumps(([_png(np.zeros((2, 2, 3), np.uint8)), b"junk"], [True])))
    with pytest.raises(CorruptImageError, match=r"corrupt\.bin\[1\]"):
        load_bin(corrupt, image_size=(2, 2))


# ------------------------------------------------------------------- metrics
def _pairs_with_scores(scores) -> tuple:
    """2-D unit embeddings whose pair cosine similarities are exactly ``scores``."""
    s = torch.tensor(scores, dtype=torch.float64)
    a = torch.stack([torch.ones_like(s), torch.zeros_like(s)], dim=1) * 3.0  # norm must not matter
    b = torch.stack([s, torch.sqrt(1 - s**2)], dim=1)
    return a, b


def test_kfold_matches_sklearn_layout():
    folds = kfold_indices(23, 10)
    assert [len(test) for _, test in folds] == [3, 3, 3, 2, 2, 2, 2, 2, 2, 2]
    assert np.array_equal(np.concatenate([test for _, test in folds]), np.arange(23))
    for train, test in folds:
        assert sorted(np.concatenate([train, test]).tolist()) == list(range(23))
    with pytest.raises(ValueError, match="nfolds"):
        kfold_indices(5, 10)


def test_hand_computed_accuracy():
    # 20 alternating pairs; positives score 0.8, negatives 0.2, except pair 0
    # (a positive) scoring 0.1. Every fold's training split picks threshold 0.5
    # (midpoint of 0.2 and 0.8: 17/18 or 18/18 correct on train). Fold 0 then
    # gets pair 0 wrong (1/2), the nine other folds are perfect:
    # accuracy = (0.5 + 9) / 10 = 0.95, population std = 0.15.
    issame = [i % 2 == 0 for i in range(20)]
    scores = [0.8 if s else 0.2 for s in issame]
    scores[0] = 0.1
    a, b = _pairs_with_scores(scores)
    m = verification_metrics(a, b, issame, nfolds=10, far_targets=(0.1,))
    assert m["exact_accuracy"] == pytest.approx(0.95)
    assert m["exact_accuracy_std"] == pytest.approx(0.15)
    assert m["exact_best_threshold"] == pytest.approx(0.5)
    assert m["num_pairs"] == 20


def test_hand_computed_tar_at_far():
    # 10 negatives with distinct scores 0.05..0.50, positives as listed.
    neg = [0.05 * (i + 1) for i in range(10)]
    pos = [0.9, 0.47, 0.42, 0.3, 0.6]
    scores = pos + neg
    issame = [True] * 5 + [False] * 10
    a, b = _pairs_with_scores(scores)
    m = verification_metrics(a, b, issame, nfolds=3, far_targets=(0.1, 0.25, 1e-3))
    # FAR <= 0.1 allows 1 of 10 negatives above the threshold: threshold =
    # second-largest negative 0.45 -> positives above: 0.9, 0.47, 0.6.
    assert m["exact_threshold@far=1e-1"] == pytest.approx(0.45)
    assert m["exact_tar@far=1e-1"] == pytest.approx(3 / 5)
    assert m["exact_achieved_far@far=1e-1"] == pytest.approx(0.1)
    # FAR <= 0.25 allows 2 negatives: threshold = third-largest negative 0.40.
    assert m["exact_tar@far=2.5e-1"] == pytest.approx(4 / 5)
    # 10 negatives cannot measure FAR = 1e-3.
    assert math.isnan(m["exact_tar@far=1e-3"]) and math.isnan(m["exact_threshold@far=1e-3"])


def test_separable_scores_are_perfect():
    rng = np.random.default_rng(1)
    issame = np.arange(40) % 2 == 0
    scores = np.where(issame, rng.uniform(0.5, 0.9, 40), rng.uniform(-0.5, 0.3, 40))
    a, b = _pairs_with_scores(scores.tolist())
    m = verification_metrics(a, b, issame)
    assert m["exact_accuracy"] == 1.0 and m["exact_accuracy_std"] == 0.0
    assert 0.3 < m["exact_best_threshold"] < 0.5


def _brute_force_accuracy(scores, issame, nfolds):
    """Independent slow reference: loop over every candidate threshold."""
    n = len(scores)
    sizes = [n // nfolds + (1 if k < n % nfolds else 0) for k in range(nfolds)]
    accs, start = [], 0
    for size in sizes:
        test = list(range(start, start + size))
        train = [i for i in range(n) if i < start or i >= start + size]
        start += size
        uniq = sorted(set(scores[i] for i in train))
        cands = [np.nextafter(uniq[0], -np.inf)]
        cands += [(lo + hi) / 2 for lo, hi in zip(uniq, uniq[1:])]
        cands += [np.nextafter(uniq[-1], np.inf)]
        best_t, best_acc = None, -1.0
        for t in cands:  # ascending, strict '>' keeps the lowest on ties
            acc = sum((scores[i] > t) == issame[i] for i in train) / len(train)
            if acc > best_acc:
                best_t, best_acc = t, acc
        accs.append(sum((scores[i] > best_t) == issame[i] for i in test) / len(test))
    return float(np.mean(accs))


def _brute_force_tar(scores, issame, far):
    pos = [s for s, y in zip(scores, issame) if y]
    neg = [s for s, y in zip(scores, issame) if not y]
    best = 0.0
    for t in sorted(set(scores)) + [np.inf]:
        if sum(s > t for s in neg) / len(neg) <= far:
            best = max(best, sum(s > t for s in pos) / len(pos))
    return best


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = 53  # uneven folds
    issame = rng.random(n) < 0.5
    # Quantised scores create ties; overlapping classes make thresholds matter.
    scores = np.round(np.where(issame, rng.normal(0.4, 0.25, n), rng.normal(0.1, 0.25, n)), 1).clip(-0.99, 0.99)
    a, b = _pairs_with_scores(scores.tolist())
    sims = (torch.nn.functional.normalize(a, dim=1) * b).sum(1).numpy()  # exactly what the metric sees
    m = verification_metrics(a, b, issame, nfolds=10, far_targets=(0.05, 0.2))
    assert m["exact_accuracy"] == pytest.approx(_brute_force_accuracy(sims.tolist(), issame.tolist(), 10))
    for far, key in ((0.05, "5e-2"), (0.2, "2e-1")):
        assert m[f"exact_tar@far={key}"] == pytest.approx(_brute_force_tar(sims.tolist(), issame.tolist(), far))


def test_metric_input_validation():
    a = torch.randn(20, 4)
    with pytest.raises(ValueError, match="equal shapes"):
        verification_metrics(a, torch.randn(20, 5), [True] * 20)
    with pytest.raises(ValueError, match="issame has 19"):
        verification_metrics(a, a, [True] * 19)


# ----------------------------------------------------------------- embedding
class _Probe(nn.Module):
    """Linear embedding that records the modes and batch sizes it saw."""

    def __init__(self, dim_in: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim_in, 8)
        self.seen = []

    def forward(self, x):
        self.seen.append((self.training, x.shape[0]))
        return self.fc(x.flatten(1))


def test_embed_images_flip_sum_and_mode_restore():
    torch.manual_seed(0)
    images = torch.randn(10, 3, 4, 5)
    model = _Probe(60)
    model.train()
    emb = embed_images(model, images, batch_size=4, flip=True)
    assert model.training  # restored
    assert all(not training for training, _ in model.seen)
    assert [bs for _, bs in model.seen] == [4, 4, 4, 4, 2, 2]
    with torch.no_grad():
        expected = model.fc(images.flatten(1)) + model.fc(images.flip(-1).flatten(1))
    torch.testing.assert_close(emb, expected)
    torch.testing.assert_close(embed_images(model, images, flip=False), model.fc(images.flatten(1)).detach())


def test_embed_restores_per_submodule_modes():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model.train()
    model[1].eval()  # e.g. frozen BatchNorm during fine-tuning
    embed_images(model, torch.randn(6, 4), flip=False)
    assert model.training and model[0].training and not model[1].training


def test_evaluate_verification_interleaved_and_tuple_agree():
    torch.manual_seed(0)
    a = torch.randn(20, 3, 4, 4)
    b = a + 0.5 * torch.randn(20, 3, 4, 4)
    b[1::2] = torch.randn(10, 3, 4, 4)  # negatives: unrelated images
    issame = torch.arange(20) % 2 == 0
    model = nn.Flatten()
    interleaved = torch.stack([a, b], dim=1).reshape(40, 3, 4, 4)
    m1 = evaluate_verification(model, interleaved, issame, batch_size=7, flip=False)
    m2 = evaluate_verification(model, (a, b), issame, flip=False)
    assert m1 == pytest.approx(m2, nan_ok=True)
    direct = verification_metrics(a.flatten(1), b.flatten(1), issame)
    assert m1["accuracy"] == pytest.approx(direct["accuracy"])
    assert m1["accuracy"] > 0.9
    with pytest.raises(ValueError, match="even"):
        evaluate_verification(model, interleaved[:39], issame)


def test_load_bin_of_garbage_names_the_file(tmp_path):
    import pytest as _pytest

    from shardfc.evaluation import load_bin

    for i, payload in enumerate((b"I123\nxx garbage", bytes(range(256)) * 3)):
        path = tmp_path / f"garbage{i}.bin"
        path.write_bytes(payload)
        with _pytest.raises(ValueError, match="is not a readable verification .bin pickle"):
            load_bin(path)
