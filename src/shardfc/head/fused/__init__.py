"""The head's GPU implementations of one shard: no ``[B, C]`` logits at any class count.

Two forwards and one backward, each built so that its speed follows from its structure:

* ``impl="triton"``: the forward is one fused online-LSE kernel (:mod:`.forward`) on 64–128-row
  tiles, which Triton lowers to Hopper's wgmma;
* ``impl="gemm"``: the forward is cuBLAS GEMMs over class chunks with a Triton epilogue
  (:mod:`.chunks`, :mod:`.epilogue`);
* both: the backward is cuBLAS GEMMs over class chunks with Triton epilogues (:mod:`.chunks`):
  the logits recomputed once per chunk, then ``E·Ŵ`` and ``Eᵀ·x`` at the device's matmul rate.

Files by kernel role: :mod:`.tiles` (the tile of logits the kernels share), :mod:`.forward`
(the fused online log-sum-exp), :mod:`.epilogue` (the kernels around the GEMMs), :mod:`.chunks`
(the GEMM loop over class chunks), :mod:`.autotune` (the fused forward's block sizes),
:mod:`.optimizer` (the fused row-sparse SGD), :mod:`.shard` (the launchers, drop-in for
:mod:`shardfc.head.kernels`'s functions), :mod:`.aot` (the sm_90 build and its SASS, from a CPU).

Importing this package does not import Triton; :func:`resolve_impl` decides, per forward, which
implementation can run, and the kernel modules are loaded the first time the Triton one does. Under
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
#: The GPU paths' chunk sizes, as multiples of the L2-sized one (:func:`.chunks.chunk_classes`).
CHUNK_SCALES = (1, 2, 4, 8)
#: What ``impl="auto"`` times and remembers: each GPU implementation at each chunk scale
#: (``"gemm@4"``: ``impl="gemm"`` with chunks four times the L2-sized one), then torch.
TIMED = tuple(f"{impl}@{scale}" for impl in CANDIDATES[:2] for scale in CHUNK_SCALES) + CANDIDATES[2:]
_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_impl(impl) -> str:
    """``impl`` validated: one of :data:`IMPLS`."""
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


def check_chunk_scale(scale, name: str = "chunk_scale", none_ok: bool = False) -> Optional[int]:
    """``scale`` validated: one of :data:`CHUNK_SCALES` (an ``int``, not a bool or a float), or None
    where ``none_ok``; else a ValueError naming ``name`` and the value."""
    if scale is None and none_ok:
        return None
    if type(scale) is not int or scale not in CHUNK_SCALES:
        raise ValueError(f"{name} must be {'None or ' if none_ok else ''}one of {CHUNK_SCALES}, got {scale!r}")
    return scale


def timed_candidates(chunk_scale: Optional[int] = None) -> tuple:
    """The names of :data:`TIMED` ``impl="auto"`` times: every chunk scale, or only ``chunk_scale``."""
    return tuple(n for n in TIMED if chunk_scale is None or "@" not in n or n.endswith(f"@{chunk_scale}"))


def split_timed(name: str, chunk_scale: Optional[int] = None) -> tuple:
    """``(impl, chunk scale)`` of a :data:`TIMED` name (``"gemm@4"`` -> ``("gemm", 4)``); an
    implementation's name alone takes ``chunk_scale`` (None: the GPU paths' default)."""
    impl, _, scale = name.partition("@")
    return impl, int(scale) if scale else chunk_scale


def interpreting() -> bool:
    """Triton's CPU interpreter is on (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_unavailable(device: torch.device, compute_dtype: torch.dtype, stats_dtype: torch.dtype) -> Optional[str]:
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
    return None


def shapes_only(t: torch.Tensor) -> bool:
    """``t`` is a meta tensor: a launcher allocates its outputs and launches nothing."""
    return t.device.type == "meta"


def resolve_impl(impl: str, device: torch.device, compute_dtype: torch.dtype, stats_dtype: torch.dtype) -> str:
    """The implementation one forward runs, or a ValueError that says why the one asked for cannot.

    ``"torch"`` always runs. ``"triton"`` and ``"gemm"`` need Triton and a CUDA device (or the
    interpreter, or the meta device). ``"auto"`` resolves to ``"torch"`` where they cannot run and
    is otherwise returned as is: the head then times the candidates (:mod:`shardfc.head.impl_select`).
    """
    if impl == "torch":
        return "torch"
    reason = triton_unavailable(device, compute_dtype, stats_dtype)
    if impl in ("triton", "gemm"):
        if reason is not None:
            raise ValueError(f"impl={impl!r} cannot run: {reason}")
        return impl
    return "auto" if reason is None and device.type == "cuda" else "torch"


__all__ = ["CANDIDATES", "CHUNK_SCALES", "IMPLS", "TIMED", "check_chunk_scale", "split_timed", "timed_candidates", "check_impl", "interpreting", "resolve_impl", "shapes_only", "triton_unavailable"]
