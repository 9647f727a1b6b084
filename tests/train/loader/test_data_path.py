"""The trainer's data path: one loader for the whole run (workers kept, loading across the epoch
boundary), the device prefetcher, and uint8 batches normalised after the loader exactly as the
datasets normalise them."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from shardfc.data import ImageFolderDataset
from shardfc.data.transforms import random_erase_
from shardfc.parallel.context import DistContext
from shardfc.train.config import TrainConfig
from shardfc.train.loader.data import EpochKeys, ShardBatches, erasing_generator, micro_batches, train_dataset
from shardfc.train.loader.prefetch import DevicePrefetcher, to_device
from shardfc.train.state import RunState


def _faces(root: Path, identities: int = 3, per: int = 4) -> Path:
    rng = np.random.default_rng(0)
    for ident in range(identities):
        for k in range(per):
            path = root / f"id{ident}" / f"{k}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (10, 14, 3), dtype=np.uint8)).save(path)
    return root


def test_epoch_keys_run_the_epochs_back_to_back_and_start_where_a_resume_is():
    batches = ShardBatches(10, 3, 0, 1, seed=5, drop_last=False)
    per_epoch = []
    for epoch in range(3):
        batches.set_epoch(epoch)
        per_epoch.append([[(epoch, i, b) for i in batch] for b, batch in enumerate(list(batches))])
    it = iter(EpochKeys(batches))
    got = [next(it) for _ in range(sum(map(len, per_epoch)))]
    assert got == [batch for epoch in per_epoch for batch in epoch]
    assert per_epoch[0] != [[(1, i, b) for _, i, b in batch] for batch in per_epoch[1]]  # the order changes
    resumed = iter(EpochKeys(batches, epoch=1, start=2))
    assert [next(resumed) for _ in range(len(per_epoch[1]) - 2 + 1)] == per_epoch[1][2:] + per_epoch[2][:1]
    # A checkpoint taken after an epoch's last batch (start == its length) goes on with the next epoch.
    done = iter(EpochKeys(batches, epoch=0, start=len(per_epoch[0])))
    assert next(done) == per_epoch[1][0]


class _Logged(torch.utils.data.Dataset):
    """Each sample: its index and the pid that loaded it; every load appended to a file ('epoch index')."""

    def __init__(self, log: Path, n: int = 12) -> None:
        self.log, self.n = log, n

    def __len__(self):
        return self.n

    def load_sample(self, index, epoch):
        with open(self.log, "a") as f:
            f.write(f"{epoch} {index}\n")
        return torch.tensor([index, os.getpid()]), 0, []


def _loaded_epochs(log: Path) -> set:
    return {int(line.split()[0]) for line in log.read_text().splitlines()}


def test_the_workers_live_through_the_run_and_load_the_next_epoch_before_this_one_ends(tmp_path):
    log = tmp_path / "loads.txt"
    cfg = TrainConfig(num_workers=2, seed=0, output_dir=str(tmp_path))
    batches = ShardBatches(12, 4, 0, 1, seed=0, drop_last=False)  # 3 batches an epoch
    state = RunState(batches_per_epoch=len(batches))
    stream = micro_batches(_Logged(log), batches, state, cfg, DistContext())
    pids, seen = set(), []
    for _ in range(3):
        images, _, _ = next(stream)
        pids |= set(images[:, 1].tolist())
        seen.append(images[:, 0].tolist())
    assert (state.epoch, state.batch_in_epoch) == (0, 3)
    deadline = time.time() + 20
    while 1 not in _loaded_epochs(log) and time.time() < deadline:
        time.sleep(0.05)
    # The last batch of epoch 0 is in hand and epoch 1 is already being loaded: no drained queue.
    assert 1 in _loaded_epochs(log), "the loader stopped at the epoch boundary"
    for _ in range(6):  # two more epochs
        images, _, _ = next(stream)
        pids |= set(images[:, 1].tolist())
        seen.append(images[:, 0].tolist())
    assert (state.epoch, state.batch_in_epoch) == (2, 3)
    assert len(pids) == 2 and os.getpid() not in pids  # the same two workers throughout
    for epoch in range(3):
        batches.set_epoch(epoch)
        assert seen[3 * epoch : 3 * epoch + 3] == [list(b) for b in batches]
    stream.close()


def test_the_prefetcher_yields_the_same_items_in_order_with_any_lookahead():
    prepared = []

    def prepare(item):
        prepared.append(item)
        return item * 10

    def source():
        yield from range(7)

    assert list(DevicePrefetcher(source(), torch.device("cpu"), lambda x: x * 10)) == [x * 10 for x in range(7)]
    for ahead in (0, 1, 3, 10):
        prepared.clear()
        it = iter(DevicePrefetcher(source(), "cpu", prepare, ahead=ahead))
        assert next(it) == 0
        assert prepared == list(range(min(ahead + 1, 7)))  # ``ahead`` items in flight behind the one out
        assert [0] + list(it) == [x * 10 for x in range(7)]
    assert DevicePrefetcher(source(), "cpu", prepare).ahead == 0  # nothing to overlap on the CPU
    with pytest.raises(ValueError, match="ahead must be an int >= 0, got -1"):
        DevicePrefetcher(source(), "cpu", prepare, ahead=-1)


def test_uint8_batches_normalised_after_the_loader_equal_the_float_pipeline(tmp_path):
    """The trainer's stream (uint8 from the workers; normalised, erased in the training process)
    gives, bit for bit, what the datasets' own float tensors with the erasing would."""
    root = _faces(tmp_path / "faces")
    cfg = TrainConfig(dataset="folder", data_root=str(root), batch_size=5, random_erasing=0.6, seed=3,
                      output_dir=str(tmp_path / "out"))
    ctx = DistContext()
    dataset = train_dataset(cfg, (12, 8))
    float_set = ImageFolderDataset(root, (12, 8), train=True, seed=3)  # the datasets' own float output
    assert dataset.load_sample(0, 0)[0].dtype == torch.uint8 and float_set.load_sample(0, 0)[0].dtype == torch.float32
    batches = ShardBatches(len(dataset), 5, 0, 1, seed=3, drop_last=False)
    expected = []
    for epoch in range(2):
        batches.set_epoch(epoch)
        for b, batch in enumerate(list(batches)):
            images = torch.stack([float_set.load_sample(i, epoch)[0] for i in batch])
            expected.append(random_erase_(images, 0.6, erasing_generator(3, 0, epoch, b)))
    for workers, ahead in ((0, 0), (2, 2)):
        stream = micro_batches(dataset, batches, RunState(), dataclasses.replace(cfg, num_workers=workers), ctx,
                               ahead=ahead)
        got = [next(stream)[0] for _ in expected]
        stream.close()
        assert all(g.dtype == torch.float32 for g in got)
        assert all(torch.equal(g, e) for g, e in zip(got, expected)), f"num_workers={workers}: batches differ"
    assert any((e == 0).all(0).any() for e in expected)  # the comparison includes erased rectangles


def test_to_device_normalises_uint8_and_sets_the_memory_format():
    x = torch.randint(0, 256, (2, 3, 5, 4), dtype=torch.uint8)
    y = to_device(x, torch.device("cpu"), channels_last=True)
    assert y.dtype == torch.float32 and y.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(y, (x.float() / 255 - 0.5) / 0.5)
    f = torch.randn(2, 3, 5, 4)
    assert to_device(f, torch.device("cpu")) is f  # float images (the synthetic set) pass as they are


@pytest.mark.parametrize("size,batch,world,drop_last", [(10, 3, 1, False), (23, 4, 3, False), (5, 4, 4, False),
                                                         (21, 5, 2, False), (22, 4, 2, True), (9, 4, 1, False)])
def test_shard_batches_are_the_distributed_samplers_order_in_batches(size, batch, world, drop_last):
    """The per-rank indices, computed as one tensor, are torch's DistributedSampler's, batched as before
    (a last batch of one image folded into the one before, a partial one dropped with drop_last)."""
    for rank in range(world):
        for epoch in (0, 3):
            batches = ShardBatches(size, batch, rank, world, seed=7, drop_last=drop_last)
            batches.set_epoch(epoch)
            sampler = torch.utils.data.DistributedSampler(range(size), world, rank, shuffle=True, seed=7)
            sampler.set_epoch(epoch)
            idx = list(sampler)
            expected = [idx[i : i + batch] for i in range(0, len(idx), batch)]
            if drop_last and len(expected[-1]) < batch:
                expected.pop()
            elif len(expected) > 1 and len(expected[-1]) == 1:
                expected[-2].extend(expected.pop())
            assert list(batches) == expected and len(batches) == len(expected)
            batches.set_epoch(epoch, 1)
            assert list(batches) == expected[1:] and len(batches) == len(expected) - 1


def test_on_cuda_each_batch_is_prepared_on_the_side_stream_and_waited_for_by_its_own_event(monkeypatch):
    """The CUDA branch's ordering, with the stream and event API stubbed (no GPU here): batch k+1 is
    launched on the side stream before batch k is handed out, and the training stream waits for
    batch k's event only, not for the side stream (which already holds batch k+1)."""
    import contextlib

    log = []

    class Event:
        count = 0

        def __init__(self):
            self.n = Event.count
            Event.count += 1

        def record(self, stream=None):
            log.append(("record", self.n, stream.name))

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_event(self, event):
            log.append(("wait", event.n, self.name))

    side, main = Stream("side"), Stream("main")
    inside = []

    @contextlib.contextmanager
    def on(stream):
        inside.append(stream.name)
        yield
        inside.pop()

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: side)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)

    def prepare(item):
        log.append(("prepare", item, inside[-1] if inside else "main"))
        return item

    prefetcher = DevicePrefetcher(range(3), torch.device("cuda"), prepare)
    assert prefetcher.ahead == 1
    out = []
    for item in prefetcher:
        log.append(("out", item))
        out.append(item)
    assert out == [0, 1, 2]
    assert log == [
        ("prepare", 0, "side"), ("record", 0, "side"), ("prepare", 1, "side"), ("record", 1, "side"),
        ("wait", 0, "main"), ("out", 0),
        ("prepare", 2, "side"), ("record", 2, "side"), ("wait", 1, "main"), ("out", 1),
        ("wait", 2, "main"), ("out", 2),
    ]


@pytest.mark.parametrize("dataset", ["folder", "synthetic"])
def test_flip_prob_reaches_the_training_images(tmp_path, dataset):
    """--flip-prob 0 (glyphs: a mirrored character is another) never mirrors; the default mirrors
    about half the images, the same ones as before the option existed."""
    root = _faces(tmp_path, identities=2, per=8)
    options = dict(dataset=dataset, data_root=str(root) if dataset == "folder" else "", synthetic_identities=4,
                   synthetic_images_per_identity=4)
    plain = train_dataset(TrainConfig(**options, flip_prob=0.0), (16, 16))

    def flipped(cfg):
        ds = train_dataset(cfg, (16, 16))
        if dataset == "folder":
            return [ds.transform.draw_flip(ds.augmentation_generator(i, 0)) for i in range(len(ds))]
        flips = []
        for i in range(len(ds)):
            x, x0 = ds[i][0], plain[i][0]
            assert torch.equal(x, x0) or torch.equal(x, x0.flip(-1))
            flips.append(not torch.equal(x, x0))
        return flips

    never = flipped(TrainConfig(**options, flip_prob=0.0))
    default = flipped(TrainConfig(**options))
    assert not any(never) and 0 < sum(default) < len(default)
    assert all(flipped(TrainConfig(**options, flip_prob=1.0)))
