"""Peak memory of one training step above the process's resting state.

Resting state = weights + gradients + optimizer state (the bench keeps gradients allocated between
steps with ``zero_grad(set_to_none=False)``) and the step's inputs: everything alive when the
measure starts. The peak is what the step adds above it.

Two measures, chosen by device:

* ``"cuda_max_allocated"`` (CUDA): ``torch.cuda.max_memory_allocated()`` after
  ``reset_peak_memory_stats()``, minus ``memory_allocated()`` before the step.
* ``"cpu_live_tensors"`` (CPU): :class:`LiveTensorBytes`, a dispatch mode that counts the bytes of
  every tensor storage an operator creates during the step, from the operator's return until the
  storage is freed, and keeps their peak. It is what ``max_memory_allocated`` counts on CUDA, minus
  the caching allocator's rounding and an operator's internal scratch buffers, which no dispatch
  mode sees. It needs nothing from the platform, but it slows every operator down by some
  microseconds, so the bench measures memory in steps of its own, never in the timed ones.

``shardfc plan`` replays the head's step under the same mode (on the ``meta`` device).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Set

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def tensors_in(x) -> Iterator[torch.Tensor]:
    """The tensors in an operator's arguments or results (tuples, lists, dicts of them)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from tensors_in(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from tensors_in(v)


_ALIASING: Dict[Any, bool] = {}


def _may_alias(func) -> bool:
    """Whether a result of ``func`` may share an argument's storage (a view, in place, ``out=``),
    by its schema's alias annotations."""
    found = _ALIASING.get(func)
    if found is None:
        found = func.namespace == "c10d" or any(r.alias_info is not None for r in func._schema.returns)
        _ALIASING[func] = found
    return found


class LiveTensorBytes(TorchDispatchMode):
    """Live and peak bytes of the tensor storages created while the mode is active.

    A storage counts from the operator that returns it (whatever the device, ``meta`` included)
    until it is freed, which a finalizer on the storage reports (torch keeps one Python object per
    live storage). Storages that existed before the mode (weights, gradients, inputs) never count,
    nor do views of them or in-place writes into them.

    After the ``with`` block: :attr:`peak` (bytes), :attr:`peak_live` (serial -> bytes of each
    storage alive at the peak, the first time it was reached), :attr:`communication` (serials of the
    storages a collective read or wrote) and :meth:`serial_of` (the serial of a tracked tensor's
    storage, or None while active).
    """

    def __init__(self) -> None:
        super().__init__()
        #: record nothing while False (a subclass may run operators before and after the measure)
        self.tracking = True
        self.live: Dict[int, int] = {}  # serial -> bytes
        self.peak = 0
        self.peak_live: Dict[int, int] = {}
        self.communication: Set[int] = set()
        self._current = 0
        self._serials: Dict[int, int] = {}  # storage key (address of the StorageImpl) -> serial
        self._next = 0
        self._finalizers: Dict[int, weakref.finalize] = {}  # serial -> the finalizer of a live storage
        self._busy = False  # a finalizer that runs while the books are being updated waits
        self._pending: List[tuple] = []

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = self.call(func, args, kwargs)
        if self.tracking:
            self._busy = True
            try:
                self._record(func, (args, kwargs), out)
            finally:
                self._busy = False
                while self._pending:
                    self._free(*self._pending.pop())
        return out

    def call(self, func, args, kwargs) -> Any:
        """Run the operator (a subclass may run it differently)."""
        return func(*args, **kwargs)

    def _record(self, func, inputs, out) -> None:
        # An operator whose schema says no result aliases an argument returns new storages only.
        arg_keys = {_storage_key(t) for t in tensors_in(inputs)} if _may_alias(func) else ()
        for t in tensors_in(out):
            storage = t.untyped_storage()
            key = storage._cdata
            serial = self._serials.get(key)
            if serial is not None:  # out= or in place: the storage may have been resized
                self._resize(serial, storage.nbytes())
            elif key not in arg_keys:  # a new storage
                self._track(key, storage)
        if func.namespace == "c10d":
            for t in tensors_in((inputs, out)):
                serial = self._serials.get(_storage_key(t))
                if serial is not None:
                    self.communication.add(serial)

    def _track(self, key: int, storage) -> None:
        self._next += 1
        serial = self._next
        self._serials[key] = serial
        self.live[serial] = 0
        self._finalizers[serial] = weakref.finalize(storage, self._free, key, serial)
        self._resize(serial, storage.nbytes())

    def _resize(self, serial: int, nbytes: int) -> None:
        self._current += nbytes - self.live[serial]
        self.live[serial] = nbytes
        if self._current > self.peak:
            self.peak = self._current
            self.peak_live = dict(self.live)

    def _free(self, key: int, serial: int) -> None:
        if self._busy:  # a garbage collection inside _record: settle it after
            self._pending.append((key, serial))
            return
        if self._serials.get(key) == serial:
            del self._serials[key]
        self._finalizers.pop(serial, None)
        self._current -= self.live.pop(serial, 0)

    # ------------------------------------------------------------------ queries
    @property
    def current(self) -> int:
        """Bytes of the tracked storages alive now."""
        return self._current

    def serial_of(self, t: torch.Tensor) -> Optional[int]:
        """The serial of ``t``'s storage if the mode tracks it (created while active, still alive)."""
        return self._serials.get(_storage_key(t))

    def peak_by(self, category: Callable[[int], str]) -> Dict[str, int]:
        """Bytes alive at the peak, summed by ``category(serial)``."""
        parts: Dict[str, int] = {}
        for serial, nbytes in self.peak_live.items():
            name = category(serial)
            parts[name] = parts.get(name, 0) + nbytes
        return parts

    def __exit__(self, *exc):
        for f in self._finalizers.values():  # storages still alive are no longer followed
            f.detach()
        self._finalizers.clear()
        self._serials.clear()
        return super().__exit__(*exc)


class PeakMemory:
    """``start()`` before a step, ``stop()`` after it: bytes of the step's peak above the start."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.measure = "cuda_max_allocated" if self.device.type == "cuda" else "cpu_live_tensors"
        self._base = 0
        self._mode: Optional[LiveTensorBytes] = None

    def start(self) -> None:
        if self.measure == "cuda_max_allocated":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return
        self._mode = LiveTensorBytes()
        self._mode.__enter__()

    def stop(self) -> int:
        if self.measure == "cuda_max_allocated":
            torch.cuda.synchronize(self.device)
            return max(0, torch.cuda.max_memory_allocated(self.device) - self._base)
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        return mode.peak


__all__ = ["LiveTensorBytes", "PeakMemory", "tensors_in"]
