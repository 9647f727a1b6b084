"""``--profile``: a process's peak memory after each phase of a run (build and resume, every save and
evaluation, the training), to see which phase raised it.

The peak resident set size only grows (``ru_maxrss``, the whole life of the process), so the first
phase after which it is higher is the one that reached the new peak; on CUDA the allocator's
``max_memory_allocated`` likewise. Beside them, the bytes of this process's backbone state (its
parameters, buffers and optimizer state: under the pipeline strategy its stage's share) are the
floor that a phase's peak is measured against.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from shardfc.train.observe.profile import peak_rss_bytes
from shardfc.train.state import Parts

__all__ = ["MemoryPhases", "backbone_state_bytes"]


def backbone_state_bytes(parts: Parts) -> int:
    """Bytes of this process's backbone parameters, buffers and backbone optimizer state."""
    tensors = list(parts.module.state_dict().values())
    for state in parts.opt_backbone.state_dict()["state"].values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


class MemoryPhases:
    """Peak memory after each named phase; :meth:`as_dict` is what ``profile/rank<R>.json`` records."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.phases: List[Dict[str, Any]] = []

    def mark(self, phase: str) -> None:
        """Record the peaks at the end of ``phase``."""
        entry: Dict[str, Any] = {"after": phase, "peak_rss_bytes": peak_rss_bytes()}
        if self.device.type == "cuda":
            entry["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
        self.phases.append(entry)

    def as_dict(self, parts: Parts) -> Dict[str, Any]:
        return {"backbone_state_bytes": backbone_state_bytes(parts), "peak_after": self.phases}
