"""Per-step numbers on the device: what a kernel (or a captured CUDA graph of a step) reads instead
of taking them from the host — the optimizer's learning rate, momentum, weight decay, the idle
rows' step matrices. Plain torch (no Triton): the torch paths use them too."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from shardfc.head import capture


def scalars_on(values, device: torch.device, out: Optional[Tensor] = None, dtype: torch.dtype = torch.float32) -> Tensor:
    """``values`` (floats) as ``dtype`` (fp32) on ``device`` (into ``out`` when given): on CUDA one
    copy from pinned memory, not waited for (a ``torch.tensor(..., device="cuda")`` waits for the stream)."""
    src = torch.tensor([float(v) for v in values], dtype=dtype)
    if out is None:
        out = torch.empty(src.shape, dtype=dtype, device=device)
    if device.type == "cuda":
        out.copy_(src.pin_memory(), non_blocking=True)  # the caching host allocator keeps it until copied
    else:
        out.copy_(src)
    return out


class DeviceScalars:
    """The per-step numbers a kernel reads (learning rate, momentum, weight decay, ...) as a small
    fp32 tensor on the device, one per key, kept at one address: a kernel reads them through a
    pointer instead of taking them as launch arguments, so a CUDA graph that captured the launch
    replays with whatever the tensor holds at replay, not the numbers of the step it captured.

    :meth:`get` refreshes the tensor when the numbers differ from what it holds (one host-to-device
    copy from pinned memory, no host sync; a step with the same numbers copies nothing). Inside a
    CUDA graph capture it must find them unchanged — a copy captured there would replay from a
    host buffer that is gone — so :meth:`get` them before capturing or replaying (the optimizer's
    ``stage_device_scalars``); a change there is a RuntimeError that says so."""

    def __init__(self) -> None:
        self._held: dict = {}

    def __getstate__(self) -> dict:  # a copy or a pickle of an optimizer makes its tensors again
        return {}

    def __setstate__(self, state: dict) -> None:
        self._held = {}

    def get(self, key, values, device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
        """The tensor of ``key`` on ``device`` holding ``values`` (floats, as ``dtype``: fp32, or
        fp64 for the idle rows' step matrices)."""
        values = tuple(float(v) for v in values)
        slot = (key, str(device), dtype)
        held = self._held.get(slot)
        if held is not None and held[0] == values:
            return held[1]
        if capture.capturing():
            raise RuntimeError(
                f"the optimizer's per-step values {values} changed inside a CUDA graph capture (they were "
                f"{held[0] if held else 'never staged'}): set the learning rate and the other hyper-parameters "
                "before capturing or replaying, not inside the captured step")
        t = scalars_on(values, device, held[1] if held is not None and held[1].numel() == len(values) else None, dtype)
        self._held[slot] = (values, t)
        return t


__all__ = ["DeviceScalars", "scalars_on"]
