"""The random flip of the image datasets: a function of (seed, epoch, index), whoever loads it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader

from shardfc.data import ImageFolderDataset

EPOCHS, SAMPLES = 4, 12


def _tree(root: Path) -> Path:
    rng = np.random.default_rng(0)
    for k in range(SAMPLES):
        path = root / f"id{k % 3}" / f"{k}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)).save(path)  # no mirror symmetry
    return root


def _flips(ds: ImageFolderDataset, plain: ImageFolderDataset) -> np.ndarray:
    """``[epoch, index]``: was the sample mirrored (it must be the plain image, or its mirror)."""
    out = np.zeros((EPOCHS, SAMPLES), dtype=bool)
    for e in range(EPOCHS):
        for i in range(SAMPLES):
            x, _, _ = ds.load_sample(i, e)
            base = plain[i][0]
            assert torch.equal(x, base) or torch.equal(x, base.flip(-1))
            out[e, i] = torch.equal(x, base.flip(-1))
    return out


def test_flips_differ_across_epochs_and_samples_and_repeat_for_the_same_ones(tmp_path):
    root = _tree(tmp_path / "faces")
    ds = ImageFolderDataset(root, (6, 5), train=True, seed=3)
    plain = ImageFolderDataset(root, (6, 5), train=False)
    flips = _flips(ds, plain)
    assert 0.2 < flips.mean() < 0.8
    assert any(len(set(flips[:, i])) == 2 for i in range(SAMPLES)), "a sample's flip never changes with the epoch"
    assert all(len(set(flips[e])) == 2 for e in range(EPOCHS)), "every sample of an epoch flipped alike"
    # The same (seed, epoch, index) in another dataset object: the same images; another seed: others.
    assert np.array_equal(_flips(ImageFolderDataset(root, (6, 5), train=True, seed=3), plain), flips)
    assert not np.array_equal(_flips(ImageFolderDataset(root, (6, 5), train=True, seed=4), plain), flips)
    ds.set_epoch(2)
    assert all(torch.equal(ds[i][0], ds.load_sample(i, 2)[0]) for i in range(SAMPLES))


class _Keyed(torch.utils.data.Dataset):
    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, key):
        return self.ds.load_sample(key[1], key[0])[0]


def test_dataloader_workers_draw_the_flips_of_the_main_process(tmp_path):
    """Worker RNGs are seeded anew each time they start; the flips must not depend on them."""
    root = _tree(tmp_path / "faces")
    ds = ImageFolderDataset(root, (6, 5), train=True, seed=1)
    keys = [[(e, i)] for e in range(2) for i in range(SAMPLES)]
    loaded = torch.cat(list(DataLoader(_Keyed(ds), batch_sampler=keys, num_workers=2)))
    here = torch.stack([ds.load_sample(i, e)[0] for e in range(2) for i in range(SAMPLES)])
    assert torch.equal(loaded, here)
