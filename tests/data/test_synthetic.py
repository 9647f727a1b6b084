import pytest
import torch
from torch.utils.data import DataLoader

from shardfc.data import SyntheticIdentities, SyntheticPool, normalize
from shardfc.data.labels import dataset_labels
from shardfc.evaluation import verification_metrics


@pytest.fixture(scope="module")
def ds() -> SyntheticIdentities:
    return SyntheticIdentities(num_identities=50, images_per_identity=8, image_size=(32, 32), seed=0)


def test_basic_shape_and_labels(ds):
    assert len(ds) == 400 and ds.num_classes == 50
    x, y = ds[17]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32
    assert y == 17 // 8
    assert x.min() >= -1 and x.max() <= 1
    assert ds[-1][1] == 49
    with pytest.raises(IndexError):
        ds[400]


def test_non_square_size():
    d = SyntheticIdentities(num_identities=3, images_per_identity=2, image_size=(24, 16))
    assert d[0][0].shape == (3, 24, 16)


def test_deterministic(ds):
    x1, _ = ds[123]
    x2, _ = ds[123]
    assert torch.equal(x1, x2)
    again = SyntheticIdentities(num_identities=50, images_per_identity=8, image_size=(32, 32), seed=0)
    assert torch.equal(again[123][0], x1)
    # Global RNG state must not matter.
    torch.manual_seed(999)
    torch.rand(10)
    assert torch.equal(ds[123][0], x1)


def test_seeds_and_indices_differ(ds):
    other = SyntheticIdentities(num_identities=50, images_per_identity=8, image_size=(32, 32), seed=1)
    assert not torch.equal(other[5][0], ds[5][0])
    assert not torch.equal(ds[5][0], ds[6][0])  # same identity, another draw


def test_independent_of_worker_layout(ds):
    direct = torch.stack([ds[i][0] for i in range(40)])
    loader = DataLoader(ds, batch_size=8, num_workers=2)
    batches = [x for i, (x, _) in enumerate(loader) if i < 5]
    assert torch.equal(torch.cat(batches), direct)


def test_intra_identity_closer_than_inter(ds):
    x = torch.stack([ds[i][0] for i in range(len(ds))]).flatten(1)
    y = torch.tensor([ds[i][1] for i in range(len(ds))])
    d = torch.cdist(x, x)
    same = y[:, None] == y[None, :]
    off_diag = ~torch.eye(len(x), dtype=torch.bool)
    intra = d[same & off_diag].mean()
    inter = d[~same].mean()
    assert intra < inter
    # ...but not trivially: the nuisance keeps the gap moderate.
    assert intra > 0.7 * inter


def test_verification_pairs(ds):
    a, b, same = ds.verification_pairs(num_pairs=21, seed=3)
    assert a.shape == b.shape == (21, 3, 32, 32)
    assert same.dtype == torch.bool and same.tolist() == [i % 2 == 0 for i in range(21)]
    a2, b2, same2 = ds.verification_pairs(num_pairs=21, seed=3)
    assert torch.equal(a, a2) and torch.equal(b, b2) and torch.equal(same, same2)
    a3, _, _ = ds.verification_pairs(num_pairs=21, seed=4)
    assert not torch.equal(a, a3)
    # Held out: no pair image equals any training image.
    train = torch.stack([ds[i][0] for i in range(len(ds))]).flatten(1)
    pair_imgs = torch.cat([a, b]).flatten(1)
    assert torch.cdist(pair_imgs, train).min() > 1.0
    # Positive pairs are two different images.
    assert all(not torch.equal(a[i], b[i]) for i in range(0, 21, 2))


def test_unseen_identity_pairs(ds):
    a, b, same = ds.verification_pairs(num_pairs=10, seed=0, unseen_identities=True)
    seen, _, _ = ds.verification_pairs(num_pairs=10, seed=0)
    assert a.shape == (10, 3, 32, 32) and not torch.equal(a, seen)


def test_raw_pixels_verify_weakly():
    """Raw-pixel cosine is above chance but far from solved (tuned to ~60%)."""
    d = SyntheticIdentities(num_identities=100, images_per_identity=4, seed=0)
    a, b, same = d.verification_pairs(num_pairs=400, seed=1)
    acc = verification_metrics(a.flatten(1), b.flatten(1), same)["accuracy"]
    assert 0.52 < acc < 0.75


def test_argument_validation():
    with pytest.raises(ValueError, match="num_identities"):
        SyntheticIdentities(num_identities=0)
    with pytest.raises(ValueError, match="image_size"):
        SyntheticIdentities(image_size=(32,))
    with pytest.raises(ValueError, match="num_pairs"):
        SyntheticIdentities(num_identities=2, images_per_identity=1).verification_pairs(num_pairs=0)


# ------------------------------------------------------------------ the pre-rendered pool
def test_pool_serves_the_sets_labels_and_its_own_renders_in_uint8():
    data = SyntheticIdentities(num_identities=6, images_per_identity=4, image_size=(12, 8), seed=3)
    pool = SyntheticPool(data, 10)
    assert (len(pool), pool.num_classes, pool.class_names, pool.image_size) == (24, 6, data.class_names, (12, 8))
    assert pool.size == 10 and pool.images.shape == (10, 3, 12, 8) and pool.nbytes == 10 * 3 * 12 * 8
    assert pool.images.is_shared()  # one copy for every loader worker, whatever their start method
    assert [pool[i][1] for i in range(24)] == [data[i][1] for i in range(24)]
    assert dataset_labels(pool).tolist() == dataset_labels(data).tolist()  # what the P x K sampler reads
    slots = [k * 24 // 10 for k in range(10)]  # spread over the set: every identity has pixels in it
    for i in range(24):
        image, _ = pool[i]
        assert image.dtype == torch.uint8 and image.shape == (3, 12, 8)
        nearest = max(s for s in slots if s <= i)  # the pooled sample at or before i
        assert torch.equal(image, pool.images[slots.index(nearest)])
    for k, s in enumerate(slots):  # normalised on the device, a pooled image is the render to 1/255
        assert (normalize(pool.images[k]) - data[s][0]).abs().max() <= 0.5 / 127.5 + 1e-6
    assert torch.equal(pool[-1][0], pool[23][0])
    with pytest.raises(IndexError):
        pool[24]


def test_pool_size_is_at_most_the_set_and_its_render_does_not_depend_on_the_workers():
    data = SyntheticIdentities(num_identities=3, images_per_identity=2, image_size=(8, 8))
    whole = SyntheticPool(data, 100)
    assert whole.size == 6 and all(torch.equal(normalize(whole[i][0]), normalize(whole.images[i])) for i in range(6))
    by_a_worker = SyntheticPool(data, 6, num_workers=1)
    assert torch.equal(by_a_worker.images, whole.images) and (by_a_worker.num_workers, whole.num_workers) == (1, 0)


@pytest.mark.parametrize("size", [0, -3, 2.5, True, "8"])
def test_pool_names_a_bad_size(size):
    data = SyntheticIdentities(num_identities=2, images_per_identity=2, image_size=(8, 8))
    with pytest.raises(ValueError, match=f"size must be an int >= 1, got {size!r}"):
        SyntheticPool(data, size)
