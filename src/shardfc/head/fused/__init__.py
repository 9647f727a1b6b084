"""Fused Triton kernels for one shard of the head: logits never materialised, at any class count.

Files by kernel role: :mod:`.tiles` (the tile of logits every kernel recomputes), :mod:`.forward`
(online log-sum-exp), :mod:`.backward` (weight and embedding gradients), :mod:`.autotune` (block
sizes), :mod:`.shard` (the launchers, drop-in for :mod:`shardfc.head.kernels`'s functions).

Importing this package does not import Triton; :func:`resolve_impl` decides, per forward, which
implementation runs, and the kernel modules are loaded the first time the Triton one does. Under
``TRITON_INTERPRET=1`` (set before the first use) the kernels run on CPU tensors with Triton's
interpreter — slowly, for tests. On the ``meta`` device (tensors with shapes and no data) the
launchers allocate what they would and launch nothing: that is how ``shardfc plan`` replays a
fused step.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch

#: ``"triton"``: the fused online-LSE forward kernel; ``"gemm"``: the forward as cuBLAS GEMMs over class
#: chunks with a Triton epilogue; both share the backward (cuBLAS GEMMs over class chunks, Triton
#: epilogues). ``"torch"``: the reference. ``"auto"``: timed once per workload on the user's GPU.
IMPLS = ("auto", "triton", "gemm", "torch")
#: The implementations ``"auto"`` chooses between, in the order they are tried.
CANDIDATES = ("triton", "gemm", "torch")
#: Largest embedding width of the fused kernels (their backward holds a ``[tile, D]`` accumulator).
MAX_DIM = 1024
_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_impl(impl) -> str:
    """``impl`` validated: one of :data:`IMPLS`."""
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


def interpreting() -> bool:
    """Triton's CPU interpreter is on (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_unavailable(device: torch.device, compute_dtype: torch.dtype, stats_dtype: torch.dtype, dim: int) -> Optional[str]:
    """Why the fused kernels cannot run this step (None when they can)."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install 'shardfc[gpu]')"
    if device.type not in ("cuda", "meta") and not (device.type == "cpu" and interpreting()):
        return (
            f"the head's tensors are on {device}, not a CUDA device (TRITON_INTERPRET=1 runs the kernels "
            "on CPU tensors with Triton's interpreter, for tests)"
        )
    if stats_dtype != torch.float32:
        return f"the kernels keep fp32 statistics; inputs of {stats_dtype} need impl='torch'"
    if compute_dtype not in _COMPUTE_DTYPES:
        return f"compute dtype {compute_dtype} is not one of fp32, bf16, fp16"
    if dim > MAX_DIM:
        return f"embedding_dim={dim} is above the kernels' limit of {MAX_DIM}"
    return None


def shapes_only(t: torch.Tensor) -> bool:
    """``t`` is a meta tensor: a launcher allocates its outputs and launches nothing."""
    return t.device.type == "meta"


def resolve_impl(impl: str, device: torch.device, compute_dtype: torch.dtype, stats_dtype: torch.dtype, dim: int) -> str:
    """``"triton"`` or ``"torch"`` for one forward. ``"auto"``: Triton on CUDA when it can run there,
    else torch. ``"triton"``: Triton, or a ValueError that says why it cannot run."""
    if impl == "torch":
        return "torch"
    reason = triton_unavailable(device, compute_dtype, stats_dtype, dim)
    if impl == "triton":
        if reason is not None:
            raise ValueError(f"impl='triton' cannot run: {reason}")
        return "triton"
    return "triton" if reason is None and device.type == "cuda" else "torch"


__all__ = ["IMPLS", "MAX_DIM", "check_impl", "interpreting", "resolve_impl", "shapes_only", "triton_unavailable"]
