"""Peak memory of one training step above the process's resting state.

Resting state = weights + gradients + optimizer state, measured after warm-up (the bench keeps
gradients allocated between steps with ``zero_grad(set_to_none=False)``); the peak is what the step
adds above it.

Two measures, chosen by device:

* ``"cuda_max_allocated"`` (CUDA): ``torch.cuda.max_memory_allocated()`` after
  ``reset_peak_memory_stats()``, minus ``memory_allocated()`` before the step. Every tensor counts
  from its allocation.
* ``"cpu_rss_hwm"`` (CPU, Linux): the resident set. Before the step the peak is reset by writing
  ``5`` to ``/proc/self/clear_refs`` (which resets ``VmHWM`` to the current ``VmRSS``); after it the
  step's peak is ``VmHWM − VmRSS(before)``, both from ``/proc/self/status``. A CPU tensor counts from
  the first write to its pages (``torch.empty`` that is filled later counts when filled).
  For freed tensors to leave the resident set, glibc must return them to the OS:
  :func:`allocator_env` sets ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``
  (so every allocation of 64 KiB or more is its own ``mmap``, unmapped when freed) — it must run
  before the worker processes start (they read it at start-up) — and :meth:`PeakMemory.start`
  calls ``malloc_trim(0)``. Those settings slow down steps that allocate many MiB-sized blocks
  (each one page-faults in afresh), so the bench measures memory first and then, before timing,
  switches glibc to its default steady state (:func:`use_default_malloc_steady_state`).
* ``"cpu_rss_sampled"``: fallback where ``clear_refs`` is not writable: ``VmRSS`` sampled every
  millisecond by a thread during the step (can miss short peaks).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import threading
from typing import Dict, Iterator, Optional

import torch

#: glibc tunables that make freed large blocks leave the resident set (see module docstring).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


@contextlib.contextmanager
def allocator_env() -> Iterator[Dict[str, str]]:
    """Inside the block, :data:`MALLOC_ENV` is in ``os.environ`` (values already set are kept), so
    processes started there inherit it (glibc reads it at start-up); restored on exit."""
    saved = {key: os.environ.get(key) for key in MALLOC_ENV}
    for key, value in MALLOC_ENV.items():
        os.environ.setdefault(key, value)
    try:
        yield {key: os.environ[key] for key in MALLOC_ENV}
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _read_status() -> Dict[str, int]:
    out: Dict[str, int] = {}
    with open(_STATUS) as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _clear_refs_works() -> bool:
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
        return "VmHWM" in _read_status()
    except OSError:
        return False


_LIBC = None


def malloc_trim() -> None:
    """Ask glibc to give free heap memory back to the OS (no-op elsewhere)."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim  # noqa: B018 - raises AttributeError off glibc
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


#: glibc ``mallopt`` parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: glibc's largest dynamic mmap threshold on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``)
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024


def use_default_malloc_steady_state() -> bool:
    """Switch glibc back to what an untuned process converges to, for timing.

    Under :data:`MALLOC_ENV` every block of 64 KiB or more is a fresh ``mmap``: its pages fault in
    on every allocation, which would charge the chunked loop (MiB-sized blocks, many per step)
    with page faults a normal process does not pay. glibc's default raises its mmap threshold to
    the size of freed blocks, up to 32 MiB, so those blocks are reused from the heap; this sets
    that state (threshold 32 MiB, trim threshold 64 MiB). Blocks above 32 MiB stay mmapped, as by
    default. Returns False off glibc.
    """
    malloc_trim()
    if not _LIBC:
        return False
    ok = _LIBC.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
    return ok and _LIBC.mallopt(_M_TRIM_THRESHOLD, 2 * _MMAP_THRESHOLD_MAX) == 1


class PeakMemory:
    """``start()`` before a step, ``stop()`` after it: bytes of the step's peak above the start."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        if self.device.type == "cuda":
            self.measure = "cuda_max_allocated"
        elif os.path.exists(_STATUS) and _clear_refs_works():
            self.measure = "cpu_rss_hwm"
        elif os.path.exists(_STATUS):
            self.measure = "cpu_rss_sampled"
        else:
            raise RuntimeError("no memory measure on this platform (needs CUDA or Linux /proc)")
        self._base = 0
        self._sampler: Optional[threading.Thread] = None
        self._stop_sampling = threading.Event()
        self._sampled_peak = 0

    def start(self) -> None:
        gc.collect()
        if self.measure == "cuda_max_allocated":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return
        malloc_trim()
        self._base = _read_status()["VmRSS"]
        if self.measure == "cpu_rss_hwm":
            with open(_CLEAR_REFS, "w") as f:
                f.write("5")
        else:
            self._sampled_peak = self._base
            self._stop_sampling.clear()
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()

    def _sample(self) -> None:
        while not self._stop_sampling.wait(0.001):
            self._sampled_peak = max(self._sampled_peak, _read_status()["VmRSS"])

    def stop(self) -> int:
        if self.measure == "cuda_max_allocated":
            torch.cuda.synchronize(self.device)
            return max(0, torch.cuda.max_memory_allocated(self.device) - self._base)
        if self.measure == "cpu_rss_hwm":
            return max(0, _read_status()["VmHWM"] - self._base)
        self._stop_sampling.set()
        if self._sampler is not None:
            self._sampler.join()
        peak = max(self._sampled_peak, _read_status()["VmRSS"])
        return max(0, peak - self._base)


__all__ = ["MALLOC_ENV", "PeakMemory", "allocator_env", "malloc_trim", "use_default_malloc_steady_state"]
