"""P x K identity batches for metric losses: each global batch holds P identities with K images each.

A batch-hard triplet loss needs positives in the batch; uniform sampling over a re-ID set (about 17
images per identity) rarely puts two images of one person together. Every global micro-batch here
is P identities x K images, split into contiguous per-rank slices (all K images of an identity are
in one global batch; with ``batch_size % K == 0`` on one rank too). An epoch is built from
``(seed, epoch)`` alone, identically on every rank, and ``start`` skips batches for a mid-epoch resume.

One epoch:

1. each identity's images are shuffled and cut into chunks of K (the ``n mod K`` left over sit this
   epoch out); an identity with fewer than K images gives one chunk: its images plus draws *with
   replacement* from them up to K (as fast-reid and torchreid do; a one-image identity then
   contributes K copies, told apart only by augmentation);
2. chunks are capped so that no identity has more chunks than the epoch has batches, and a few
   random ones dropped so that they fill ``B = chunks // P`` batches exactly;
3. batch after batch takes one chunk from each of the P identities with the most chunks left,
   ties broken at random. Taking the fullest first never strands an identity (with at most
   ``B - t`` chunks each and ``(B - t) * P`` in all before batch t, P identities are always left),
   so an epoch always has exactly B batches: the length is known before training.

Building an epoch costs O(B x identities) (a top-P over all identities per batch), a fraction of a
second for re-ID sets (751 identities and ~180 batches for Market-1501, ~1,000 for MSMT17), but
not meant for face sets with millions of identities, where P x K batching has little to offer.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler

from shardfc.data.labels import dataset_labels
from shardfc.seeding import mix_seed
from shardfc.train.config import ConfigError

__all__ = ["IdentityBatches", "dataset_labels", "pk_epoch"]


def _chunks_per_identity(counts: np.ndarray, k: int, p: int) -> tuple[np.ndarray, int]:
    """Chunks each identity gives (capped at the batch count) and the number of batches."""
    chunks = np.maximum(counts // k, 1)
    while True:
        batches = int(chunks.sum()) // p
        capped = np.minimum(chunks, batches)
        if (capped == chunks).all():
            return chunks, batches
        chunks = capped


def pk_epoch(by_identity: Sequence[np.ndarray], p: int, k: int, seed: int, epoch: int) -> List[List[int]]:
    """The global batches of one epoch (``P * K`` dataset indices each), from ``(seed, epoch)`` alone."""
    g = torch.Generator().manual_seed(mix_seed(seed, epoch, 0x504B))  # 'PK': apart from other streams
    counts = np.array([len(ix) for ix in by_identity], dtype=np.int64)
    chunks, num_batches = _chunks_per_identity(counts, k, p)
    # Drop chunks at random until they fill the batches exactly (fewer than P of them).
    excess = int(chunks.sum()) - num_batches * p
    if excess:
        owners = np.repeat(np.arange(len(chunks)), chunks)
        drop = owners[torch.randperm(len(owners), generator=g)[:excess].numpy()]
        np.subtract.at(chunks, drop, 1)
    pools: Dict[int, List[List[int]]] = {}
    for ident in np.flatnonzero(chunks):
        images = by_identity[ident][torch.randperm(len(by_identity[ident]), generator=g).numpy()]
        if len(images) < k:
            extra = torch.randint(len(images), (k - len(images),), generator=g).numpy()
            images = np.concatenate([images, images[extra]])
        pools[int(ident)] = [images[c * k : (c + 1) * k].tolist() for c in range(int(chunks[ident]))]
    left = torch.from_numpy(chunks.astype(np.float64))
    batches = []
    for _ in range(num_batches):
        # Most chunks left first; the random fraction (< 1) only orders identities that tie.
        pick = torch.topk(left + 0.5 * torch.rand(len(left), generator=g, dtype=torch.float64), p).indices
        left[pick] -= 1
        batches.append([i for ident in pick.tolist() for i in pools[ident].pop()])
    return batches


class IdentityBatches(Sampler):
    """This rank's slices of the P x K global batches of each epoch, resumable mid-epoch.

    Args:
        labels: the class of every dataset index.
        batch_size: images per rank per micro-batch (the loader's batch size).
        k: images per identity in a global batch; ``batch_size * world_size`` must be a multiple.
        rank, world_size: this process's slice of each global batch.
        seed: with the epoch, decides everything.

    Raises:
        ConfigError: the global batch is not a multiple of ``k``, or the data has fewer identities
            than one batch needs.
    """

    def __init__(self, labels: np.ndarray, batch_size: int, k: int, rank: int, world_size: int, seed: int) -> None:
        global_batch = batch_size * world_size
        if global_batch % k:
            raise ConfigError(
                f"sampler='pk' needs the global batch (batch_size={batch_size} x {world_size} rank(s) = {global_batch}) "
                f"to be a multiple of pk_instances={k}"
            )
        self.p, self.k = global_batch // k, k
        self.batch_size, self.rank, self.seed = batch_size, rank, seed
        labels = np.asarray(labels, dtype=np.int64)
        order = np.argsort(labels, kind="stable")
        idents, starts = np.unique(labels[order], return_index=True)
        self.by_identity = np.split(order, starts[1:])
        if len(idents) < self.p:
            raise ConfigError(
                f"sampler='pk' with a global batch of {global_batch} = {self.p} identities x pk_instances={k} needs at "
                f"least {self.p} identities; the dataset has {len(idents)}"
            )
        self.num_batches = _chunks_per_identity(np.array([len(ix) for ix in self.by_identity]), k, self.p)[1]
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __iter__(self):
        lo, hi = self.rank * self.batch_size, (self.rank + 1) * self.batch_size
        for batch in pk_epoch(self.by_identity, self.p, self.k, self.seed, self.epoch)[self.start :]:
            yield batch[lo:hi]

    def __len__(self) -> int:
        return self.num_batches - self.start
