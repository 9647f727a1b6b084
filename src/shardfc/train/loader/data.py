"""The training data of a rank: the dataset, its per-rank resumable batches and the endless micro-batch stream."""

from __future__ import annotations

import logging
from typing import List, Optional, Tuple

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from shardfc.data.transforms import random_erase_
from shardfc.parallel.context import DistContext
from shardfc.parallel.lifecycle import ignore_stop_signals
from shardfc.seeding import mix_seed
from shardfc.train.config import ConfigError, TrainConfig
from shardfc.train.loader.dali_loader import DaliBatches, choose_loader
from shardfc.train.loader.prefetch import DevicePrefetcher, to_device
from shardfc.train.observe.evaluate import synthetic_dataset
from shardfc.train.observe.phases import OFF, PhaseClock
from shardfc.train.state import RunState

logger = logging.getLogger("shardfc.train")


def train_dataset(cfg: TrainConfig, image_size: Tuple[int, int]) -> Dataset:
    if cfg.dataset == "synthetic":
        return synthetic_dataset(cfg, image_size)
    from shardfc.data import ImageFolderDataset, ListFileDataset
    from shardfc.data.recordio import RecordIODataset

    if cfg.dataset == "folder":
        dataset = ImageFolderDataset(cfg.data_root, image_size, train=True, flip_prob=cfg.flip_prob, seed=cfg.seed)
    elif cfg.dataset == "recordio":
        dataset = RecordIODataset(cfg.data_root, image_size, train=True, flip_prob=cfg.flip_prob, seed=cfg.seed)
    elif cfg.dataset == "market1501":
        from shardfc.data.market1501 import Market1501TrainDataset

        dataset = Market1501TrainDataset(cfg.data_root, image_size, train=True, flip_prob=cfg.flip_prob, seed=cfg.seed)
    else:
        dataset = ListFileDataset(cfg.list_file, cfg.data_root or None, image_size, train=True, flip_prob=cfg.flip_prob,
                                  seed=cfg.seed)
    dataset.log_corrupt = False  # named by rank 0, once over all workers and ranks (reporting.py)
    # Decode and augment in uint8: the workers ship a quarter of the bytes, and the float conversion
    # and normalisation run on the training device (prefetch.to_device), with the same result.
    dataset.transform.normalized = False
    return dataset


class KeyedSamples(Dataset):
    """The training dataset read by ``(epoch, index, batch_in_epoch)`` keys: ``(image, label, skipped, where)``.

    The epoch travels with each index from the sampler (which runs in the training process), so
    a DataLoader worker, holding its own copy of the dataset, draws sample ``index``'s
    augmentation for the right epoch (:meth:`~shardfc.data.folder.ImageFolderDataset.load_sample`).
    ``skipped`` lists ``(name, reason)`` of the corrupt images passed over: the dataset's own
    counters live in whichever worker decoded the image, so they travel with the batch too, as does
    ``where = (epoch, batch_in_epoch)``, the batch's place in the run (the loader runs ahead of the
    step, across epoch boundaries, so the trainer learns where a batch belongs from the batch).
    Datasets without ``load_sample`` (the synthetic one: every sample a function of the seed and
    its index alone) are read by index.
    """

    def __init__(self, inner: Dataset) -> None:
        self.inner = inner
        self.keyed = hasattr(inner, "load_sample")

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, key: Tuple[int, int, int]):
        epoch, index, batch_in_epoch = key
        if self.keyed:
            image, label, skipped = self.inner.load_sample(index, epoch)
        else:
            (image, label), skipped = self.inner[index], []
        return image, label, skipped, (epoch, batch_in_epoch)


class EpochKeys(Sampler):
    """Every epoch's batches of a batch sampler (:class:`ShardBatches` or the P x K one), one epoch
    after the other without end, each index as ``(epoch, index, batch_in_epoch)`` (for
    :class:`KeyedSamples`).

    Starts at batch ``start`` of ``epoch`` (a resume). One endless pass means one DataLoader
    iterator for the whole run: its workers are started once and keep loading across the epoch
    boundary (the next epoch's first batches load while the last ones of this epoch train), where a
    new iterator per epoch would drain the workers' queue and refill it. The order is the one
    ``batches`` gives for each epoch: a function of the seed and the epoch only.
    """

    def __init__(self, batches: Sampler, epoch: int = 0, start: int = 0) -> None:
        self.batches, self.epoch, self.start = batches, int(epoch), int(start)

    def __iter__(self):
        epoch, start = self.epoch, self.start
        while True:
            self.batches.set_epoch(epoch, start)
            for b, batch in enumerate(self.batches, start):
                yield [(epoch, int(i), b) for i in batch]
            epoch, start = epoch + 1, 0


def collate_keyed(samples):
    """Stack images and labels; the skipped corrupt images of the batch in one list; the batch's place."""
    images, labels, skipped, where = zip(*samples)
    return torch.stack(images), torch.tensor(labels, dtype=torch.int64), [s for per in skipped for s in per], where[0]


class ShardBatches(Sampler):
    """This rank's micro-batches of one epoch, resumable mid-epoch.

    Indices come from a :class:`DistributedSampler` (shuffled per epoch, padded so every rank has
    the same number of batches, which the head's per-step collectives need). A last batch of a
    single image is folded into the one before (BatchNorm cannot train on one sample); with
    ``drop_last`` a partial last batch is dropped. ``start`` skips batches of the current epoch
    without loading them (resume).
    """

    def __init__(self, size: int, batch_size: int, rank: int, world_size: int, seed: int, drop_last: bool) -> None:
        self.sampler = DistributedSampler(
            range(size), num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=False
        )
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.start = 0
        per_rank = self.sampler.num_samples
        if per_rank < 2:
            raise ConfigError(
                f"the dataset has {size} images, fewer than 2 per rank for {world_size} rank(s); "
                "BatchNorm needs at least 2 images per batch"
            )
        if drop_last and per_rank < batch_size:
            raise ConfigError(
                f"drop_last with batch_size={batch_size} leaves no batch: each of {world_size} rank(s) gets "
                f"{per_rank} images per epoch"
            )

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.sampler.set_epoch(epoch)
        self.start = start

    def _indices(self) -> torch.Tensor:
        """This rank's indices of the epoch, exactly the DistributedSampler's (its seed, permutation,
        padding and stride), as one tensor: no Python list of the whole epoch (2M images: 0.4 s)."""
        s = self.sampler
        g = torch.Generator().manual_seed(s.seed + s.epoch)
        perm = torch.randperm(len(s.dataset), generator=g)
        if s.total_size > len(perm):  # padded by repeating the permutation, as the sampler does
            perm = perm.repeat(-(-s.total_size // len(perm)))[: s.total_size]
        return perm[s.rank : s.total_size : s.num_replicas]

    def _bounds(self):
        """``(lo, hi)`` of each batch of the epoch in :meth:`_indices`: full batches, the last one
        partial (or, holding one image, folded into the one before), or dropped with ``drop_last``."""
        n, b = self.sampler.num_samples, self.batch_size
        count = len(self) + self.start
        for i in range(count):
            yield i * b, (n if i == count - 1 and not self.drop_last else (i + 1) * b)

    def _all(self) -> List[List[int]]:
        idx = self._indices()
        return [idx[lo:hi].tolist() for lo, hi in self._bounds()]

    def __iter__(self):
        idx, start = self._indices(), self.start
        for i, (lo, hi) in enumerate(self._bounds()):
            if i >= start:
                yield idx[lo:hi].tolist()

    def __len__(self) -> int:
        n, b = self.sampler.num_samples, self.batch_size
        full = n // b if self.drop_last else (n // b + (1 if n % b > 1 or n < b else 0))
        return full - self.start


def rank_batches(cfg: TrainConfig, dataset: Dataset, batch_size: int, ctx: DistContext,
                 drop_last: Optional[bool] = None) -> Sampler:
    """This rank's resumable batches: a shuffled pass (sampler 'random') or P x K identities ('pk',
    always full batches). ``drop_last`` overrides ``cfg.drop_last``."""
    if cfg.sampler == "pk":
        from shardfc.train.loader.identity_sampler import IdentityBatches, dataset_labels

        return IdentityBatches(dataset_labels(dataset), batch_size, cfg.pk_instances, ctx.rank, ctx.world_size, cfg.seed)
    drop_last = cfg.drop_last if drop_last is None else drop_last
    return ShardBatches(len(dataset), batch_size, ctx.rank, ctx.world_size, cfg.seed, drop_last)


def erasing_generator(seed: int, rank: int, epoch: int, batch_in_epoch: int) -> torch.Generator:
    """The random-erasing stream of one micro-batch: a function of where it is, so a resume repeats it."""
    return torch.Generator().manual_seed(mix_seed(seed, rank, epoch, batch_in_epoch, 0x4552))  # 'ER'


def micro_batches(dataset: Dataset, batches: Sampler, state: RunState, cfg: TrainConfig, ctx: DistContext,
                  channels_last: bool = False, ahead: Optional[int] = None, clock: PhaseClock = OFF):
    """Endless ``(images, labels, skipped corrupt images)`` over epochs, on ``ctx.device``; advances
    ``state.epoch``/``batch_in_epoch``.

    Every random choice of the data is a function of (seed, epoch, index): the order (the
    sampler's seed and epoch), the augmentation (:class:`KeyedSamples`) and random erasing
    (:func:`erasing_generator`), so a resumed run sees exactly the batches the uninterrupted one
    would have, with any number of workers.

    One DataLoader iterator serves the whole run (:class:`EpochKeys`), with persistent workers; or,
    with ``cfg.loader`` 'dali' (or 'auto' on CUDA with DALI installed), one DALI pipeline decodes the
    same keys (:mod:`~shardfc.train.loader.dali_loader`).
    Its batches go through a :class:`~shardfc.train.loader.prefetch.DevicePrefetcher`: pinned, copied to
    the device on a side stream with ``ahead`` batches in flight (CUDA), uint8 images converted and
    normalised there, then erased (the rectangles are drawn on the host from the batch's place).
    ``channels_last``: images in that memory format (a channels_last backbone's input).
    ``clock``: ``prepare`` is the step's ``h2d`` phase (:mod:`~shardfc.train.observe.phases`).
    """
    keys = EpochKeys(batches, state.epoch, state.batch_in_epoch)
    to_tensor = None
    if choose_loader(cfg.loader, cfg.dataset, ctx.device) == "dali":  # the same keys, decoded by DALI
        loader = DaliBatches(dataset, keys, ctx.device, cfg.num_workers, batches.batch_size + 1, channels_last)
        to_tensor, which = loader.to_torch, loader.describe()
    else:
        loader = DataLoader(
            KeyedSamples(dataset),
            batch_sampler=keys,
            num_workers=cfg.num_workers,
            collate_fn=collate_keyed,
            pin_memory=ctx.device.type == "cuda",
            persistent_workers=cfg.num_workers > 0,
            worker_init_fn=ignore_stop_signals,  # the trainer decides when to stop; its loader workers must not
            generator=torch.Generator().manual_seed(cfg.seed + ctx.rank),
        )
        which = f"torch DataLoader, {cfg.num_workers} worker process(es)"
    if ctx.rank == 0:
        logger.info("loader: %s (--loader %s)", which, cfg.loader)
    seed, rank, erasing = cfg.seed, ctx.rank, cfg.random_erasing

    def prepare(batch):
        clock.lap("loader wait")
        images, labels, skipped, (epoch, b) = batch
        if to_tensor is not None:  # DALI's batch: copied into torch here, on the prefetcher's side stream
            images = to_tensor(images)
        images = to_device(images, ctx.device, channels_last)
        if erasing > 0:
            random_erase_(images, erasing, erasing_generator(seed, rank, epoch, b))
        labels = labels.to(ctx.device, non_blocking=True)
        clock.lap("h2d")
        return images, labels, skipped, (epoch, b)

    for images, labels, skipped, (epoch, b) in DevicePrefetcher(loader, ctx.device, prepare, ahead):
        # As a step consumes it: the last batch of an epoch leaves (epoch, its count); the next
        # batch moves the state into the next epoch (a checkpoint at either place resumes alike).
        state.epoch, state.batch_in_epoch = epoch, b + 1
        yield images, labels, skipped
