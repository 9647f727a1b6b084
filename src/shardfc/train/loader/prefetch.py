"""Batches handed to the training device ahead of the step that needs them.

:class:`DevicePrefetcher` pulls items from a loader and passes each through ``prepare`` (the copy to
the device, the float conversion and normalisation of uint8 images, random erasing) ``ahead``
items before it is yielded. On CUDA ``prepare`` runs on a side stream: the host-to-device copies
of pinned batches (``non_blocking``) and the conversion overlap the step that trains on the batch
before, and the training stream waits for that batch's event only (never for the whole side
stream, which may already hold the next batch). On the CPU there is nothing to overlap: ``ahead``
defaults to 0 and ``prepare`` runs when the batch is asked for, in the training process. The
lookahead logic is the same on both (the CPU tests run it with ``ahead`` > 0): the same items come
out in the same order whatever ``ahead`` is.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Deque, Iterable, Iterator, Optional, Tuple

import torch

from shardfc.data.transforms import normalize

__all__ = ["DevicePrefetcher", "to_device"]


def to_device(images: torch.Tensor, device: torch.device, channels_last: bool = False) -> torch.Tensor:
    """``images`` on ``device`` as the model takes them: uint8 pixels become float32 in ``[-1, 1]``
    there (:func:`~shardfc.data.transforms.normalize`, the datasets' own formula, so the result is the
    tensor the dataset would have produced in float); 4-D images optionally in ``channels_last``."""
    images = images.to(device, non_blocking=True)
    if images.dtype == torch.uint8:
        images = normalize(images)
    if channels_last and images.dim() == 4:
        images = images.contiguous(memory_format=torch.channels_last)
    return images


def _tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o)


class DevicePrefetcher:
    """Iterate ``source``, yielding ``prepare(item)`` with up to ``ahead`` later items already prepared.

    Args:
        source: the loader (any iterable; endless is fine).
        device: where ``prepare`` puts the tensors; a CUDA device gets a side stream.
        prepare: item -> prepared item (runs on the side stream on CUDA).
        ahead: items prepared before the one yielded; default 1 on CUDA (the next batch in flight
            while this one trains), 0 on the CPU.
    """

    def __init__(
        self, source: Iterable, device: torch.device, prepare: Callable[[Any], Any], ahead: Optional[int] = None
    ) -> None:
        device = torch.device(device)
        self.cuda = device.type == "cuda"
        if ahead is None:
            ahead = 1 if self.cuda else 0
        if not isinstance(ahead, int) or isinstance(ahead, bool) or ahead < 0:
            raise ValueError(f"ahead must be an int >= 0, got {ahead!r}")
        self.source, self.device, self.prepare, self.ahead = source, device, prepare, ahead
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def _launch(self, item: Any) -> Tuple[Any, Optional["torch.cuda.Event"]]:
        if self.stream is None:
            return self.prepare(item), None
        with torch.cuda.stream(self.stream):
            out = self.prepare(item)
            done = torch.cuda.Event()
            done.record(self.stream)
        return out, done

    def _ready(self, out: Any, done: Optional["torch.cuda.Event"]) -> Any:
        if done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)
            for t in _tensors(out):
                if t.device.type == "cuda":
                    t.record_stream(current)  # allocated on the side stream, used and freed on this one
        return out

    def __iter__(self) -> Iterator[Any]:
        source = iter(self.source)
        pending: Deque[Tuple[Any, Any]] = collections.deque()
        exhausted = False
        while True:
            while not exhausted and len(pending) <= self.ahead:
                try:
                    item = next(source)
                except StopIteration:
                    exhausted = True
                    break
                pending.append(self._launch(item))
            if not pending:
                return
            yield self._ready(*pending.popleft())
