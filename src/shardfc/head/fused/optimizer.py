"""Fused row-sparse SGD: one kernel gathers the rows to update, applies weight decay, momentum
(Nesterov) in fp32 and writes the weights and the momentum rounded once (to nearest) into their
storage dtype — the update of :class:`shardfc.head.partial_fc.RowSparseSGD`, where its torch
version issues a dozen indexing and elementwise kernels per block of rows.

The gradient comes in one of the forms the optimizer sees: compact rows (``RowGrad``: row ``i`` of
the values belongs to weight row ``idx[i]``), rows of a dense ``.grad`` (at ``idx``), or every row.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from shardfc.head.fused import interpreting, shapes_only
from shardfc.head.fused.device_scalars import DeviceScalars, scalars_on  # noqa: F401  (their home before)
from shardfc.head.fused.traffic import gathered, note, rows_of, span

#: ``(BR, BD)`` of :func:`row_sgd_kernel` on a GPU: 32×64 (32×128 with the three numbers read from
#: ``hyper`` takes 168 registers and spills 8 bytes in the sm_90 build; 32×64 none).
ROW_SGD_TILES = (32, 64)


@triton.jit
def row_sgd_kernel(
    p_ptr, buf_ptr, g_ptr, idx_ptr, gscale_ptr, hyper_ptr, n, D, stride_p, stride_b, stride_g,
    HAS_IDX: tl.constexpr, G_AT_IDX: tl.constexpr, MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr,
    GSCALE: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
):
    """``GSCALE``: the gradient is divided by ``gscale_ptr[0]`` as it is read (torch's fused
    optimizers' ``grad_scale``: here the head's clipping, applied without a pass of its own).
    ``hyper``: fp32 ``[lr, momentum, weight_decay]`` on the device (:class:`DeviceScalars`)."""
    lr = tl.load(hyper_ptr)
    momentum = tl.load(hyper_ptr + 1)
    weight_decay = tl.load(hyper_ptr + 2)
    inv_scale = 1.0
    if GSCALE:
        inv_scale = 1.0 / tl.load(gscale_ptr)
    offs_r = tl.program_id(0) * BR + tl.arange(0, BR)
    r_mask = offs_r < n
    row = offs_r.to(tl.int64)
    if HAS_IDX:
        row = tl.load(idx_ptr + offs_r, mask=r_mask, other=0).to(tl.int64)
    g_row = row if G_AT_IDX else offs_r.to(tl.int64)
    for d0 in range(0, D, BD):
        offs_d = d0 + tl.arange(0, BD)
        mask = r_mask[:, None] & (offs_d < D)[None, :]
        at_p = p_ptr + row[:, None] * stride_p + offs_d[None, :]
        w = tl.load(at_p, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + g_row[:, None] * stride_g + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        if GSCALE:
            g = g * inv_scale
        g = g + weight_decay * w
        if MOMENTUM:
            at_b = buf_ptr + row[:, None] * stride_b + offs_d[None, :]
            b = tl.load(at_b, mask=mask, other=0.0).to(tl.float32) * momentum + g
            tl.store(at_b, b.to(buf_ptr.dtype.element_ty), mask=mask)
            if NESTEROV:
                g = g + momentum * b
            else:
                g = b
        tl.store(at_p, (w - lr * g).to(p_ptr.dtype.element_ty), mask=mask)


def fusable(p: Tensor, rounding: str) -> Optional[str]:
    """Why the fused update cannot serve ``p`` (None when it can)."""
    if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"parameters of {p.dtype} (fp32/bf16/fp16 only)"
    if rounding != "nearest" and p.dtype != torch.float32:
        return f"rounding={rounding!r} (the kernel rounds to nearest)"
    if p.device.type not in ("cuda", "meta") and not (p.device.type == "cpu" and interpreting()):
        return f"parameters on {p.device}, not CUDA"
    return None


def row_sgd_(p: Tensor, buf: Optional[Tensor], grad: Tensor, idx: Optional[Tensor], grad_at_idx: bool,
             lr: float, momentum: float, weight_decay: float, nesterov: bool,
             grad_scale: Optional[Tensor] = None, hyper: Optional[Tensor] = None) -> None:
    """Update rows ``idx`` of ``p`` (every row: ``idx`` None) in place; ``grad`` holds row ``i``'s
    gradient at ``idx[i]`` (``grad_at_idx``) or at ``i``; ``buf``: the momentum buffer (None: none);
    ``grad_scale`` (a one-element tensor on ``p``'s device): the gradient divided by it; ``hyper``:
    ``[lr, momentum, weight_decay]`` as an fp32 tensor on ``p``'s device (the optimizer's
    :class:`DeviceScalars`; None: made from the numbers given)."""
    n = p.shape[0] if idx is None else idx.numel()
    if n and shapes_only(p):  # meta: what it would touch, nothing launched (shardfc plan --bytes)
        state = [gathered(t, idx, 0, n) for t in (p, buf) if t is not None]
        g = gathered(grad, idx, 0, n) if grad_at_idx else span(grad[:n])
        note("row_sgd", state + [g] + rows_of(idx, 0, n), state)
    if n == 0 or shapes_only(p):
        return
    BR, BD = (16, 16) if interpreting() else ROW_SGD_TILES
    if hyper is None:
        hyper = scalars_on((lr, momentum, weight_decay), p.device)
    with torch.cuda.device(p.device) if p.is_cuda else contextlib.nullcontext():
        row_sgd_kernel[(triton.cdiv(n, BR),)](
            p, buf if buf is not None else p, grad, idx if idx is not None else p,
            grad_scale if grad_scale is not None else p, hyper, n, p.shape[1],
            p.stride(0), buf.stride(0) if buf is not None else 0, grad.stride(0),
            HAS_IDX=idx is not None, G_AT_IDX=grad_at_idx, MOMENTUM=buf is not None, NESTEROV=bool(nesterov),
            GSCALE=grad_scale is not None, BR=BR, BD=BD,
        )
    # An in-place update, as torch's optimizers' are: autograd's version counter says so (a head's
    # kept operand for the next step, chunks.NextOperand, is keyed on it).
    torch.autograd.graph.increment_version(p)
