"""Count what would make a GPU's host wait for the device, on any device (the CPU included).

On a GPU the host queues work and runs ahead; an operation whose *result on the host* depends on
the device's values (``.item()``, ``bool(t)``, ``.tolist()``, a boolean mask, ``nonzero``,
``unique``, ...) makes it wait until the device has caught up, and the device then idles until the
host queues more. ``torch.cuda.set_sync_debug_mode`` catches those on a GPU; :class:`HostSyncCounter`
catches them where there is none, so a CPU test can hold a step to zero::

    with HostSyncCounter() as syncs:
        head(x, y).backward()
    assert syncs.count == 0, syncs.sites

It is a :class:`~torch.utils._python_dispatch.TorchDispatchMode` that records every operator whose
output is read by the host or whose output *shape* depends on the values (listed in
:data:`SYNC_OPS`, plus indexing with a boolean mask, which runs ``nonzero``, and a copy from a
non-CPU device to the CPU that is not ``non_blocking``), and a patch of ``Tensor.tolist``, which
reads a CPU tensor without any operator. Each site is kept with the first line outside torch that
caused it. A host array read of a CPU tensor (``.numpy()``) is not counted: that is how a value
copied to the host without blocking (``copy_(non_blocking=True)`` into pinned memory, then an
event) is read, and it costs a GPU nothing.
"""

from __future__ import annotations

import traceback
from typing import Any, Dict, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


def _ops(*names: str) -> frozenset:
    found = []
    for name in names:
        packet = getattr(aten, name, None)
        if packet is not None:
            found += [getattr(packet, o) for o in packet.overloads()]
    return frozenset(found)


#: Operators that hand a value to the host (``_local_scalar_dense``: ``item``, ``bool``, ``int``,
#: ``float``; ``equal``, ``is_nonzero``, ``allclose``) or whose output shape depends on the values.
SYNC_OPS = _ops(
    "_local_scalar_dense", "is_nonzero", "equal", "allclose",
    "nonzero", "argwhere", "masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive",
    "unique_dim_consecutive", "bincount", "histc", "histogram",
)
#: ``repeat_interleave`` with a tensor of repeats: its output size is their sum, unless given.
_REPEAT_INTERLEAVE = frozenset(f for f in _ops("repeat_interleave") if f._overloadname in ("Tensor", "self_Tensor"))
_INDEXING = _ops("index", "index_put", "index_put_", "_index_put_impl_")
_COPIES = _ops("_to_copy", "copy_")


def _is_mask(i) -> bool:
    return isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)


def _reason(func, args, kwargs) -> Optional[str]:
    """Why ``func(*args, **kwargs)`` makes the host wait, or None."""
    if func in SYNC_OPS:
        return str(func)
    if func in _REPEAT_INTERLEAVE and kwargs.get("output_size") is None:
        return f"{func} without output_size"
    if func in _INDEXING and len(args) > 1 and any(_is_mask(i) for i in (args[1] or ())):
        return f"{func} with a boolean mask (nonzero)"
    if func in _COPIES:  # a blocking copy from a device to the host
        in_place = func._opname == "copy_"
        src = args[1] if in_place else args[0]
        dst = args[0].device if in_place else kwargs.get("device")
        non_blocking = (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)) if in_place \
            else kwargs.get("non_blocking", False)
        if (isinstance(src, torch.Tensor) and src.device.type not in ("cpu", "meta") and dst is not None
                and torch.device(dst).type == "cpu" and not non_blocking):
            return f"{func} from {src.device} to the CPU"
    return None


def _site() -> str:
    """The innermost frame outside torch and this module: the line that asked."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        name = frame.filename.replace("\\", "/")
        if "/torch/" not in name and not name.endswith("/host_syncs.py"):
            return f"{name}:{frame.lineno} ({frame.name})"
    return "?"


class HostSyncCounter(TorchDispatchMode):
    """Counts the operations that would make a GPU's host wait (see the module docstring).

    ``count``: how many; ``sites``: ``{"file:line (function): operator": times}``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.sites: Dict[str, int] = {}
        self._tolist: Any = None

    @property
    def count(self) -> int:
        return sum(self.sites.values())

    def _note(self, what: str) -> None:
        key = f"{_site()}: {what}"
        self.sites[key] = self.sites.get(key, 0) + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = _reason(func, args, kwargs)
        if why is not None:
            self._note(why)
        return func(*args, **kwargs)

    def __enter__(self):
        real = torch.Tensor.tolist
        counter = self

        def tolist(t, *a, **k):
            counter._note("Tensor.tolist")
            return real(t, *a, **k)

        self._tolist = real
        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def report(self) -> str:
        return "\n".join(f"  x{n} {site}" for site, n in self.sites.items()) or "  none"


__all__ = ["HostSyncCounter", "SYNC_OPS"]
