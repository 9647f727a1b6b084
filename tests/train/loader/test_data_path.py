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
from torch.utils.data import DistributedSampler

from shardfc.data import ImageFolderDataset
from shardfc.data.transforms import random_erase_
from shardfc.parallel.context import DistContext
from shardfc.train.config import ConfigError, TrainConfig
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


def test_the_prefetcher_refuses_an_ahead_that_is_not_a_count():
    for bad in (True, 1.5, -1):
        with pytest.raises(ValueError, match=f"ahead must be an int >= 0, got {bad!r}"):
            DevicePrefetcher(range(3), "cpu", lambda x: x, ahead=bad)


def test_the_prefetcher_asks_nothing_more_of_a_source_that_has_ended():
    """A source that would go on after its StopIteration (an iterator restarted underneath) is not
    read past its end: the stream ends with the source's first end."""

    class Restarting:
        def __init__(self):
            self.asked, self.i = 0, 0

        def __iter__(self):
            return self

        def __next__(self):
            self.asked += 1
            assert self.asked <= 3, "the source was read past its end"
            self.i += 1
            if self.i == 3:
                raise StopIteration
            return self.i

    for ahead in (0, 2):
        source = Restarting()
        assert list(DevicePrefetcher(source, "cpu", lambda x: x, ahead=ahead)) == [1, 2]
        assert source.asked == 3


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


def test_to_device_copies_to_the_device_without_blocking_the_host():
    """The copy is asked for with ``non_blocking`` (a pinned batch's copy then overlaps the step on CUDA),
    to the device given (the meta device here: no data, but a device that is not the CPU)."""

    class Recorded(torch.Tensor):
        calls: list = []

        def to(self, *args, **kwargs):
            Recorded.calls.append((args, kwargs))
            return super().to(*args, **kwargs)

    x = torch.Tensor._make_subclass(Recorded, torch.zeros(2, 3, 4, 4, dtype=torch.uint8))
    y = to_device(x, torch.device("meta"))
    assert y.device.type == "meta" and y.dtype == torch.float32
    assert Recorded.calls[0] == ((torch.device("meta"),), {"non_blocking": True})


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


def test_on_cuda_every_cuda_tensor_of_a_batch_is_kept_for_the_stream_that_uses_it(monkeypatch):
    """A batch allocated on the side stream and freed on the training stream is recorded on the
    training stream (else the caching allocator may hand its memory to the next batch while the step
    still reads it): each CUDA tensor of the batch, however nested, and no CPU tensor (a stand-in
    tensor that reports a CUDA device; the stream API stubbed). The streams are the prefetcher's device's."""
    import contextlib

    recorded, devices = [], []

    class OnCuda(torch.Tensor):
        @property
        def device(self):
            return torch.device("cuda", 1)

        def record_stream(self, stream):
            recorded.append((int(self), stream))

    class Stream:
        def __init__(self, device=None):
            devices.append(device)

        def wait_event(self, event):
            pass

    class Event:
        def record(self, stream=None):
            pass

    main = Stream("training stream")
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: devices.append(device) or main)

    def cuda(k):
        return torch.Tensor._make_subclass(OnCuda, torch.tensor(float(k)))

    cpu = torch.zeros(1)  # a CPU tensor's record_stream would fail: it must not be called
    batches = [(cuda(0), [cuda(1), (cuda(2), cpu)], "name"), (cuda(3), cpu)]
    out = list(DevicePrefetcher(batches, torch.device("cuda", 1), lambda item: item))
    assert out == batches
    assert recorded == [(0, main), (1, main), (2, main), (3, main)]
    assert devices == ["training stream"] + [torch.device("cuda", 1)] * 3  # main, the side stream, 2 batches


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


# ------------------------------------------------------------------ the dataset and the batches, at their edges


@pytest.mark.parametrize("kind", ["folder", "recordio", "market1501", "list"])
def test_each_dataset_is_built_for_training_as_configured(tmp_path, kind):
    from shardfc.cli import data as data_cli
    from shardfc.data import ListFileDataset
    from shardfc.data.market1501 import Market1501TrainDataset
    from shardfc.data.recordio import RecordIODataset

    faces = _faces(tmp_path / "faces")
    if kind == "recordio":
        assert data_cli.main(["pack", str(faces), str(tmp_path / "rec")]) == 0
        cfg = TrainConfig(dataset=kind, data_root=str(tmp_path / "rec"))
    elif kind == "market1501":
        train = tmp_path / "market" / "bounding_box_train"
        train.mkdir(parents=True)
        for i, png in enumerate(sorted(faces.rglob("*.png"))):
            (train / f"{i % 3 + 1:04d}_c1s1_{i:06d}_00.jpg").write_bytes(png.read_bytes())
        cfg = TrainConfig(dataset=kind, data_root=str(tmp_path / "market"))
    elif kind == "list":
        listing = tmp_path / "lists" / "train.txt"
        listing.parent.mkdir()
        listing.write_text("".join(f"id{i}/0.png {i}\n" for i in range(3)))  # relative to data_root
        cfg = TrainConfig(dataset=kind, list_file=str(listing), data_root=str(faces))
    else:
        cfg = TrainConfig(dataset=kind, data_root=str(faces))
    cfg = dataclasses.replace(cfg, flip_prob=0.25, seed=7)
    ds = train_dataset(cfg, (6, 4))
    kinds = {"folder": ImageFolderDataset, "recordio": RecordIODataset, "market1501": Market1501TrainDataset,
             "list": ListFileDataset}
    assert type(ds) is kinds[kind]
    assert (ds.image_size, ds.train, ds.seed, ds.transform.flip_prob, ds.transform.random_flip) == ((6, 4), True, 7, 0.25, True)
    assert ds.log_corrupt is False and ds.transform.normalized is False  # uint8 out, named by rank 0
    assert len(ds) == (3 if kind == "list" else 12)
    image, label = ds[0]
    assert image.dtype == torch.uint8 and image.shape == (3, 6, 4)


def test_a_list_without_data_root_reads_beside_itself(tmp_path):
    faces = _faces(tmp_path / "faces", identities=1, per=1)
    listing = faces / "train.txt"
    listing.write_text("id0/0.png 0\n")
    ds = train_dataset(TrainConfig(dataset="list", list_file=str(listing)), (6, 4))
    assert ds.root == str(faces)


def test_keyed_samples_read_a_plain_dataset_by_index():
    from shardfc.train.loader.data import KeyedSamples, collate_keyed

    plain = [(torch.full((2,), float(i)), i) for i in range(3)]
    keyed = KeyedSamples(plain)
    assert not keyed.keyed and len(keyed) == 3
    image, label, skipped, where = keyed[(4, 2, 9)]
    assert torch.equal(image, plain[2][0]) and (label, skipped, where) == (2, [], (4, 9))
    images, labels, all_skipped, first = collate_keyed([(torch.zeros(2), 1, [("a", "x")], (0, 5)),
                                                        (torch.ones(2), 2, [("b", "y")], (0, 6))])
    assert images.shape == (2, 2) and labels.dtype == torch.int64 and labels.tolist() == [1, 2]
    assert all_skipped == [("a", "x"), ("b", "y")] and first == (0, 5)


def test_a_ranks_batches_are_the_distributed_samplers_indices():
    """ShardBatches' own permutation equals torch's DistributedSampler's (shuffled, seeded by seed +
    epoch, padded to equal ranks), for sizes that pad and sizes that do not."""
    for size, world in ((10, 3), (9, 3), (7, 4)):
        for rank in range(world):
            batches = ShardBatches(size, 2, rank, world, seed=3, drop_last=False)
            for epoch in (0, 1):
                batches.set_epoch(epoch)
                reference = DistributedSampler(range(size), num_replicas=world, rank=rank, shuffle=True, seed=3)
                reference.set_epoch(epoch)
                assert sum(list(batches), []) == list(reference), (size, world, rank, epoch)


def test_batch_counts_and_the_folded_last_batch():
    assert [len(b) for b in ShardBatches(7, 3, 0, 1, seed=0, drop_last=False)] == [3, 4]  # 1 left: folded
    assert [len(b) for b in ShardBatches(8, 3, 0, 1, seed=0, drop_last=False)] == [3, 3, 2]
    assert [len(b) for b in ShardBatches(8, 3, 0, 1, seed=0, drop_last=True)] == [3, 3]
    assert len(ShardBatches(2, 3, 0, 1, seed=0, drop_last=False)) == 1  # fewer than a batch: one batch
    assert len(ShardBatches(3, 3, 0, 1, seed=0, drop_last=True)) == 1  # exactly a batch
    fresh = ShardBatches(8, 3, 0, 1, seed=0, drop_last=False)
    assert fresh.start == 0 and len(fresh) == 3 and fresh._all() == [list(b) for b in fresh]
    fresh.set_epoch(0, 2)
    assert len(fresh) == 1 and fresh._all()[2:] == list(fresh)


def test_too_few_images_for_the_ranks_are_refused():
    with pytest.raises(ConfigError) as info:
        ShardBatches(2, 2, 0, 2, seed=0, drop_last=False)
    assert str(info.value) == ("the dataset has 2 images, fewer than 2 per rank for 2 rank(s); BatchNorm needs at "
                               "least 2 images per batch")
    assert len(ShardBatches(3, 2, 0, 2, seed=0, drop_last=False)) == 1  # 2 each, one padded
    with pytest.raises(ConfigError) as info:
        ShardBatches(4, 3, 0, 2, seed=0, drop_last=True)
    assert str(info.value) == "drop_last with batch_size=3 leaves no batch: each of 2 rank(s) gets 2 images per epoch"
    assert len(ShardBatches(6, 3, 0, 2, seed=0, drop_last=True)) == 1  # exactly a batch each


def test_the_sampler_chooses_the_batches():
    from shardfc.train.loader.data import rank_batches
    from shardfc.train.loader.identity_sampler import IdentityBatches

    ctx = DistContext(None, 1, 2, True)
    shard = rank_batches(TrainConfig(seed=4, drop_last=True), list(range(9)), 2, ctx)
    assert type(shard) is ShardBatches and shard.drop_last and shard.sampler.rank == 1 and shard.sampler.seed == 4
    assert rank_batches(TrainConfig(drop_last=True), list(range(9)), 2, ctx, drop_last=False).drop_last is False
    class Labelled(list):
        samples = [("x", label) for label in (0, 0, 1, 1, 2, 2, 3, 3)]

    labelled = Labelled(range(8))
    pk = rank_batches(TrainConfig(sampler="pk", pk_instances=2, seed=6), labelled, 4, ctx)
    assert type(pk) is IdentityBatches
    same = IdentityBatches(np.array([0, 0, 1, 1, 2, 2, 3, 3]), 4, 2, 1, 2, 6)  # rank 1 of 2, seed 6
    for epoch in (0, 1):
        pk.set_epoch(epoch)
        same.set_epoch(epoch)
        assert list(pk) == list(same)


def test_each_micro_batch_erases_from_its_own_stream():
    """The random-erasing stream is a function of (seed, rank, epoch, batch) and of nothing else,
    and not the unsalted mix of those four another stream could draw from."""
    from shardfc.seeding import mix_seed
    from shardfc.train.loader.data import erasing_generator

    base = (1, 2, 3, 4)
    first = erasing_generator(*base).initial_seed()
    assert erasing_generator(*base).initial_seed() == first
    for i in range(4):
        moved = list(base)
        moved[i] += 1
        assert erasing_generator(*moved).initial_seed() != first, i
    assert first != mix_seed(*base)


# ------------------------------------------------------------------ micro_batches' wiring, with stand-ins


class _Pixels(torch.utils.data.Dataset):
    """Image i: uint8 pixels of value i, label i % 3."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        return torch.full((3, 4, 2), i, dtype=torch.uint8), i % 3


class _Clock:
    def __init__(self):
        self.laps = []

    def lap(self, phase):
        self.laps.append(phase)


def test_the_torch_loader_is_set_up_for_the_run(monkeypatch, caplog):
    import logging

    from shardfc.parallel.lifecycle import ignore_stop_signals
    from shardfc.train.loader import data as data_module

    made = []
    real = data_module.DataLoader
    monkeypatch.setattr(data_module, "DataLoader", lambda *a, **kw: made.append(kw) or real(*a, **kw))
    cfg = TrainConfig(seed=5, num_workers=0)
    ctx = DistContext(None, 1, 2, True)
    batches = ShardBatches(6, 2, 1, 2, seed=5, drop_last=False)
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        images, labels, skipped = next(micro_batches(_Pixels(), batches, RunState(), cfg, ctx))
    kw = made[0]
    assert (kw["num_workers"], kw["pin_memory"], kw["persistent_workers"]) == (0, False, False)
    assert kw["worker_init_fn"] is ignore_stop_signals and kw["generator"].initial_seed() == 5 + 1
    assert kw["collate_fn"] is data_module.collate_keyed and kw["batch_sampler"].batches is batches
    assert [r.getMessage() for r in caplog.records if r.name == "shardfc.train"] == []  # rank 1 says nothing
    made.clear()
    clock = _Clock()
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        stream = micro_batches(_Pixels(), ShardBatches(6, 2, 0, 1, seed=5, drop_last=False), RunState(),
                               dataclasses.replace(cfg, num_workers=1), DistContext(), clock=clock)
        next(stream)
    assert made[0]["persistent_workers"] is True
    assert "loader: torch DataLoader, 1 worker process(es) (--loader torch)" in [r.getMessage() for r in caplog.records]
    assert clock.laps[:2] == ["loader wait", "h2d"]
    stream.close()


def test_batches_resume_where_the_state_is_and_come_normalised(monkeypatch):
    batches = ShardBatches(6, 2, 0, 1, seed=3, drop_last=False)
    state = RunState(epoch=1, batch_in_epoch=2)
    batches.set_epoch(1)
    expected = list(batches)[2]
    images, labels, skipped = next(micro_batches(_Pixels(), batches, state, TrainConfig(seed=3), DistContext()))
    assert labels.tolist() == [i % 3 for i in expected] and labels.dtype == torch.int64 and skipped == []
    assert images.dtype == torch.float32 and images.is_contiguous()  # NCHW unless asked
    assert torch.allclose(images[0], to_device(torch.full((3, 4, 2), expected[0], dtype=torch.uint8), torch.device("cpu")))
    assert (state.epoch, state.batch_in_epoch) == (1, 3)
    images, _, _ = next(micro_batches(_Pixels(), batches, RunState(), TrainConfig(), DistContext(), channels_last=True))
    assert images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous()


def test_erasing_draws_from_the_batchs_own_stream():
    batches = ShardBatches(6, 3, 1, 2, seed=4, drop_last=False)
    cfg = TrainConfig(seed=4, random_erasing=1.0)
    state = RunState(epoch=2, batch_in_epoch=0)
    images, _, _ = next(micro_batches(_Pixels(), batches, state, cfg, DistContext(None, 1, 2, True)))
    batches.set_epoch(2)
    indices = list(batches)[0]
    plain = to_device(torch.stack([torch.full((3, 4, 2), i, dtype=torch.uint8) for i in indices]), torch.device("cpu"))
    random_erase_(plain, 1.0, erasing_generator(4, 1, 2, 0))
    assert torch.equal(images, plain)


class _FakeDali:
    """DaliBatches' stand-in: records its arguments, yields the keys' images as numpy arrays."""

    made = []

    def __init__(self, dataset, keys, device, threads, queue, channels_last):
        _FakeDali.made.append((dataset, keys, device, threads, queue, channels_last))
        self.dataset, self.keys = dataset, keys

    def __iter__(self):
        for batch in self.keys:
            epoch, _, b = batch[0]
            images = np.stack([self.dataset[i][0].numpy() for _, i, _ in batch])
            labels = torch.tensor([self.dataset[i][1] for _, i, _ in batch])
            yield images, labels, [("x", "why")], (epoch, b)

    @staticmethod
    def to_torch(images):
        return torch.from_numpy(images)

    def describe(self):
        return "DALI stand-in"


def test_the_dali_path_gets_the_same_keys(monkeypatch, caplog):
    import logging

    from shardfc.train.loader import data as data_module

    asked = []
    monkeypatch.setattr(data_module, "choose_loader", lambda *a: asked.append(a) or "dali")
    monkeypatch.setattr(data_module, "DaliBatches", _FakeDali)
    _FakeDali.made.clear()
    batches = ShardBatches(6, 2, 0, 1, seed=1, drop_last=False)
    cfg = TrainConfig(seed=1, loader="dali", dataset="recordio", data_root="d", num_workers=3)
    dataset = _Pixels()
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        stream = micro_batches(dataset, batches, RunState(epoch=1), cfg, DistContext(), channels_last=True)
        images, labels, skipped = next(stream)
    assert asked == [("dali", "recordio", torch.device("cpu"))]
    made = _FakeDali.made[0]
    assert made[0] is dataset and made[1].epoch == 1 and made[1].batches is batches
    assert made[2:] == (torch.device("cpu"), 3, 3, True)  # threads, a queue of batch_size + 1, the format
    assert "loader: DALI stand-in (--loader dali)" in [r.getMessage() for r in caplog.records]
    batches.set_epoch(1)
    first = list(batches)[0]
    assert labels.tolist() == [i % 3 for i in first] and skipped == [("x", "why")]
    assert images.dtype == torch.float32 and images.is_contiguous(memory_format=torch.channels_last)


def test_ahead_batches_are_prepared_before_the_first_is_used():
    for ahead, prepared in ((None, 1), (0, 1), (2, 3)):  # None: none ahead on the CPU
        clock = _Clock()
        stream = micro_batches(_Pixels(), ShardBatches(6, 2, 0, 1, seed=0, drop_last=False), RunState(), TrainConfig(),
                               DistContext(), ahead=ahead, clock=clock)
        next(stream)
        assert clock.laps == ["loader wait", "h2d"] * prepared, ahead
