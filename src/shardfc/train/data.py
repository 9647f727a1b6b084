"""The training data of a rank: the dataset, its per-rank resumable batches and the endless micro-batch stream."""

from __future__ import annotations

from typing import List, Tuple

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from shardfc.parallel.context import DistContext
from shardfc.parallel.lifecycle import ignore_stop_signals
from shardfc.train.config import ConfigError, TrainConfig
from shardfc.train.evaluate import synthetic_dataset
from shardfc.train.state import RunState


def train_dataset(cfg: TrainConfig, image_size: Tuple[int, int]) -> Dataset:
    if cfg.dataset == "synthetic":
        return synthetic_dataset(cfg, image_size)
    from shardfc.data import ImageFolderDataset, ListFileDataset
    from shardfc.data.recordio import RecordIODataset

    if cfg.dataset == "folder":
        inner = ImageFolderDataset(cfg.data_root, image_size, train=True)
    elif cfg.dataset == "recordio":
        inner = RecordIODataset(cfg.data_root, image_size, train=True)
    else:
        inner = ListFileDataset(cfg.list_file, cfg.data_root or None, image_size, train=True)
    return CountCorrupt(inner)


class CountCorrupt(Dataset):
    """Adds to each sample how many corrupt images were skipped to produce it.

    The dataset's own counter lives in whichever DataLoader worker decoded the image; passing
    the count along with the batch lets rank 0 report a total over all workers and ranks.
    """

    def __init__(self, inner: Dataset) -> None:
        self.inner = inner
        self.num_classes = inner.num_classes

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int):
        before = self.inner.corrupt_count
        image, label = self.inner[index]
        return image, label, self.inner.corrupt_count - before

    def __repr__(self) -> str:
        return repr(self.inner)


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

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.sampler.set_epoch(epoch)
        self.start = start

    def _all(self) -> List[List[int]]:
        idx = list(self.sampler)
        out = [idx[i : i + self.batch_size] for i in range(0, len(idx), self.batch_size)]
        if self.drop_last and len(out[-1]) < self.batch_size:
            out.pop()
        elif len(out) > 1 and len(out[-1]) == 1:
            out[-2].extend(out.pop())
        return out

    def __iter__(self):
        return iter(self._all()[self.start :])

    def __len__(self) -> int:
        n, b = self.sampler.num_samples, self.batch_size
        full = n // b if self.drop_last else (n // b + (1 if n % b > 1 or n < b else 0))
        return full - self.start


def micro_batches(dataset: Dataset, batches: ShardBatches, state: RunState, cfg: TrainConfig, ctx: DistContext):
    """Endless ``(images, labels, corrupt skips)`` over epochs; advances ``state.epoch``/``batch_in_epoch``."""
    use_workers = cfg.num_workers > 0
    loader = DataLoader(
        dataset,
        batch_sampler=batches,
        num_workers=cfg.num_workers,
        pin_memory=ctx.device.type == "cuda",
        persistent_workers=use_workers,
        worker_init_fn=ignore_stop_signals,  # the trainer decides when to stop; its loader workers must not
        generator=torch.Generator().manual_seed(cfg.seed + ctx.rank),
    )
    counted = isinstance(dataset, CountCorrupt)
    while True:
        batches.set_epoch(state.epoch, state.batch_in_epoch)
        for batch in loader:
            state.batch_in_epoch += 1
            if counted:
                yield batch
            else:
                yield batch[0], batch[1], torch.zeros(1, dtype=torch.int64)
        state.epoch += 1
        state.batch_in_epoch = 0
