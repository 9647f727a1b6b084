"""``--loader dali``: NVIDIA DALI decodes the training images (on the GPU on CUDA), in the trainer's order.

The order is the trainer's, not a DALI reader's. The batches come from the same batch sampler and
:class:`~shardfc.train.loader.data.EpochKeys` as the torch loader's; for each batch this module reads the
encoded images (a RecordIO record by its ``.idx`` offset through the dataset's own reader, or a
folder's file), draws each image's flip from the dataset's per-(seed, epoch, index) generator
(:meth:`~shardfc.data.transforms.ImageTransform.draw_flip`) and hands both to a DALI pipeline
through ``fn.external_source``. DALI decodes (``fn.decoders.image``: device "mixed", nvJPEG on the
GPU, on CUDA; libjpeg-turbo on the CPU otherwise), resizes to the run's size (bilinear, as PIL),
flips and lays the batch out as the step wants it: HWC, which is a channels_last NCHW view once in
torch, or CHW. The uint8 batch is copied once, into a torch tensor on the training device (on the
prefetcher's side stream on CUDA), and normalised there by the same
:func:`~shardfc.train.loader.prefetch.to_device` as the torch loader's batches.

Why not DALI's own ``fn.readers.mxnet``: it counts insightface's header and identity records as
images (its decoder then stops mid-epoch), its shuffle is a buffer rather than a permutation, its
shards are contiguous, and a resume would need its checkpoints. With the order the trainer controls,
only image records ever reach DALI (the dataset's layout detection has already left the header and
identity records out), every rank gets the sampler's equal number of batches, both loaders train
on the same images in the same order with the same flips, and a resume is the sampler's own
(skip to the batch the checkpoint names): bit-identical, as with the torch loader.

Threads: ``num_workers`` (at least 1); queue: 2 batches (DataLoader's default prefetch factor).
Bad input: structural damage or a missing file raises the reader's own error (naming the file and
key) from the batch that needs it; an image DALI cannot decode stops the run with an error naming
the record (found by decoding the pending batches with PIL), where the torch loader would skip and
count it.
"""

from __future__ import annotations

import collections
import importlib.util
from typing import Any, Deque, Iterator, List, Optional, Tuple

import numpy as np
import torch

from shardfc.data.transforms import CorruptImageError, decode_image

__all__ = ["DALI_INSTALL", "DaliBatches", "choose_loader", "dali_missing", "dali_to_torch"]

#: How to get DALI, as the error of ``--loader dali`` without it says.
DALI_INSTALL = "pip install 'shardfc[dali]' (the nvidia-dali-cuda130 wheel)"

#: Batches DALI decodes ahead of the one handed out (DataLoader's default prefetch factor).
QUEUE_DEPTH = 2


def dali_missing() -> Optional[str]:
    """Why DALI cannot be used here (one line naming the extra), or None. Cheap: nothing is imported."""
    try:
        found = importlib.util.find_spec("nvidia.dali") is not None
    except (ImportError, ValueError):  # no 'nvidia' namespace package at all
        found = False
    return None if found else f"NVIDIA DALI is not installed: {DALI_INSTALL}"


def choose_loader(loader: str, dataset: str, device: torch.device) -> str:
    """The loader that runs: ``loader`` ('torch', 'dali') as asked, or for 'auto' DALI when it is
    installed, the dataset is 'recordio' or 'folder' and the run is on CUDA, else torch."""
    if loader != "auto":
        return loader
    if dataset in ("recordio", "folder") and torch.device(device).type == "cuda" and dali_missing() is None:
        return "dali"
    return "torch"


def dali_to_torch(images: Any, device: torch.device, hwc: bool) -> torch.Tensor:
    """A DALI output batch as a uint8 torch tensor ``[N, 3, H, W]`` on ``device`` (one copy; HWC
    output comes out as its channels_last view).

    On CUDA the copy runs on the current stream (the prefetcher's side stream, where ``out`` is
    allocated, so it is ordered after that memory's earlier use) and is waited for on that stream
    alone, never the training stream: DALI may recycle its output buffer at its next run.
    """
    from nvidia.dali.plugin.pytorch import feed_ndarray

    dense = images.as_tensor()
    out = torch.empty(dense.shape(), dtype=torch.uint8, device=device)
    if out.is_cuda:
        stream = torch.cuda.current_stream(device)
        feed_ndarray(dense, out, cuda_stream=stream)
        stream.synchronize()
    else:
        feed_ndarray(dense, out)
    return out.permute(0, 3, 1, 2) if hwc else out


class DaliBatches:
    """Endless ``(images, labels, skipped, (epoch, batch_in_epoch))`` of ``keys`` decoded by DALI.

    ``images`` is DALI's output batch (turn it into a tensor with :meth:`to_torch` where the copy
    should run: the prefetcher's side stream); ``skipped`` is always empty (see the module docstring).

    Args:
        dataset: a 'recordio' or 'folder' training dataset (``read_image_bytes``, ``label_of``,
            ``augmentation_generator``, ``transform``, ``image_size``).
        keys: the batches, as :class:`~shardfc.train.loader.data.EpochKeys` yields them.
        device: the training device: CUDA decodes on the GPU, anything else on the CPU.
        threads: DALI's CPU threads (``num_workers``; at least 1).
        max_batch: the largest batch ``keys`` yields.
        channels_last: hand out HWC batches (a channels_last view) instead of CHW.
    """

    def __init__(self, dataset, keys, device: torch.device, threads: int, max_batch: int,
                 channels_last: bool = False) -> None:
        self.dataset, self.keys, self.device = dataset, keys, torch.device(device)
        self.threads, self.max_batch, self.hwc = max(1, int(threads)), int(max_batch), bool(channels_last)
        self.cuda = self.device.type == "cuda"
        # What DALI has been fed but not handed out yet, oldest first: (labels, where, names, encoded).
        self._pending: Deque[Tuple[torch.Tensor, Tuple[int, int], List[str], List[np.ndarray]]] = collections.deque()

    def describe(self) -> str:
        """One line for the log: where the images are decoded, by how many threads."""
        where = f"on the GPU ({self.device}, nvJPEG)" if self.cuda else "on the CPU"
        return f"NVIDIA DALI, decoding {where} with {self.threads} thread(s), {QUEUE_DEPTH} batches queued"

    def to_torch(self, images: Any) -> torch.Tensor:
        """:func:`dali_to_torch` of one of this loader's output batches."""
        return dali_to_torch(images, self.device, self.hwc)

    def _source(self) -> Iterator[Tuple[List[np.ndarray], List[np.ndarray]]]:
        ds = self.dataset
        for batch in self.keys:
            encoded, flips, labels, names = [], [], [], []
            for epoch, index, _ in batch:
                encoded.append(np.frombuffer(ds.read_image_bytes(index), dtype=np.uint8))
                flips.append(np.array(ds.transform.draw_flip(ds.augmentation_generator(index, epoch)), dtype=np.int32))
                labels.append(ds.label_of(index))
                names.append(ds.sample_name(index))
            self._pending.append((torch.tensor(labels, dtype=torch.int64), (batch[0][0], batch[0][2]), names, encoded))
            yield encoded, flips

    def _pipeline(self):
        from nvidia.dali import Pipeline, fn, types

        device_id = (self.device.index if self.device.index is not None else torch.cuda.current_device()) if self.cuda else None
        h, w = self.dataset.image_size
        pipe = Pipeline(batch_size=self.max_batch, num_threads=self.threads, device_id=device_id,
                        prefetch_queue_depth=QUEUE_DEPTH)
        with pipe:
            encoded, flips = fn.external_source(source=self._source(), num_outputs=2, batch=True,
                                                dtype=[types.UINT8, types.INT32])
            images = fn.decoders.image(encoded, device="mixed" if self.cuda else "cpu", output_type=types.RGB)
            images = fn.resize(images, resize_x=w, resize_y=h, interp_type=types.INTERP_LINEAR, antialias=True)
            images = fn.flip(images, horizontal=flips)
            if not self.hwc:
                images = fn.transpose(images, perm=[2, 0, 1])
            pipe.set_outputs(images)
        pipe.build()
        return pipe

    def _undecodable(self, err: Exception) -> Exception:
        """The error to raise for a failed DALI run: the pending record PIL cannot decode either, when
        there is one (DALI's message does not say which image it was), else DALI's own message."""
        for _, (epoch, b), names, encoded in self._pending:
            for name, data in zip(names, encoded):
                try:
                    decode_image(data, name=name)
                except CorruptImageError as bad:
                    return CorruptImageError(
                        name, f"{bad.reason} (epoch {epoch}, batch {b}); the DALI loader stops on an image it "
                        "cannot decode: remove the record, or train with --loader torch, which skips and counts it"
                    )
        first = self._pending[0] if self._pending else None
        where = f" (epoch {first[1][0]}, batch {first[1][1]}: {', '.join(first[2][:4])}...)" if first else ""
        return RuntimeError(f"the DALI loader failed{where}: {err}")

    def __iter__(self):
        pipe = self._pipeline()
        try:
            while True:
                try:
                    (images,) = pipe.run()
                except (ValueError, FileNotFoundError, KeyError, OSError):
                    raise  # the reader's own errors, raised in _source: they name the file and key
                except Exception as err:  # DALI's: its decoder's message does not name the record
                    raise self._undecodable(err) from err
                labels, where, _, _ = self._pending.popleft()
                yield images, labels, [], where
        finally:
            del pipe  # DALI's threads end with the pipeline
