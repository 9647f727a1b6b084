"""One shard's loss as cuBLAS GEMMs over chunks of its classes, with Triton epilogues.

The tensor-core work of a step is three matmul shapes (``x·Wᵀ``, ``dZ·W``, ``dZᵀ·x``) plus one
recomputation of the logits in the backward; here each of them is a ``torch.mm`` (cuBLAS on a
GPU, so it runs at the device's matmul rate, wgmma on Hopper, with no tile choice of ours), and
everything else is one pass of an epilogue kernel (:mod:`.epilogue`). Per chunk of ``c`` classes
(``K·c`` centre rows; :func:`chunk_classes` sizes the chunk so its working set — the ``[B, K·c]``
block of products, its ``K·c`` operand rows and, in the backward, their fp32 ``[K·c, D]`` ``H`` —
fills :data:`CHUNK_L2_SHARE` of the device's L2, so what one kernel writes the next reads from L2):

once per step::

    Ŵ, inv = scored_rows(W)        gather (Partial FC), 1/‖w‖, ·inv, cast: one read of W
                                   (above OPERAND_BYTES: the norms only, each chunk casts its rows)

forward (``impl="gemm"``; ``"triton"`` runs its fused kernel over Ŵ instead)::

    P   = x · Ŵ_cᵀ                 cuBLAS on the operand's slice          [B, K·c]
    stats_c = epilogue(P)          max / Σ exp / Σ z per sample           [B, splits]

backward (``impl="gemm"`` and ``impl="triton"``)::

    P as above                     (the logits recomputed: nothing of [B, C] is kept)
    E   = epilogue(P)  in place    unit·(softmax − ε/C), 0 at the target
    gx += E · Ŵ_c                  cuBLAS, fp32, added in its epilogue (addmm)  [B, D]
    H   = Eᵀ · x'                  cuBLAS, fp32 out (x' = x·coef/max|coef|) [K·c, D]
    dW_c = weight_grad(H)          inv·(H − (ŵ·H)·ŵ), one write per row
    then, once: the target column's terms from [B] values (index_add of B rows)

or, with a fused update (:class:`RowUpdate`), the target column's terms first, summed per target
row into ``[B, D]``, and per chunk ``weight_update(H)``: each row's gradient (its target terms
included) formed in registers and the optimizer's step applied to the row — no ``[n, D]``
gradient is written, cleared or read.

**Why ``E`` leaves out the per-sample factors.** ``dJ/dz_ij = coef_i·(p_ij − ε/C − (1−ε)[j=y_i])``
and ``dJ/dc = s·dJ/dz`` off the target. With ``coef ≈ 1/B`` and ``p ≈ 1/C``, the products
``coef·s·p`` at a million classes (≈ 1e-7) fall below fp16's normal range and flush to zero in
an fp16 operand. ``E`` holds only ``unit·(p − ε/C)`` (``|E| ≤ unit``; ``unit = 2^15`` in fp16,
so ``p`` down to ``2^-29`` ≈ 2e-9 stays a normal fp16 number, 1 otherwise); ``s``, ``coef`` and ``1/unit`` are
applied to the fp32 GEMM outputs (``coef`` through the rows of ``x'``, bounded by 1). The target
column, where the margin's derivative replaces ``s``, is added exactly from ``[B]`` values.
"""

from __future__ import annotations

import functools
import struct
import weakref
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import triton
from torch import Tensor

from shardfc.head.fused import CHUNK_SCALES as CHUNK_SCALES  # re-exported beside the chunk sizing it scales
from shardfc.head.fused import autotune, epilogue, interpreting, shapes_only
from shardfc.head.fused import check_chunk_scale as fused_check_chunk_scale
from shardfc.head.fused.device_scalars import scalars_on
from shardfc.head.fused.traffic import Region, gathered, note, rows_of, span, streamed
from shardfc.head.kernels import addmm_f32, mm_f32

#: The share of the device's L2 one chunk's working set fills (:func:`chunk_classes`). Its products
#: are written by one GEMM and read by the epilogue and two more GEMMs, and its ``H`` written by one
#: GEMM and read by the row kernel: in L2, none of them costs HBM traffic. Not all of L2: the rows
#: and optimizer state the row kernel streams pass through it too.
CHUNK_L2_SHARE = 0.6
#: L2 bytes of the device a meta tensor stands for (``shardfc plan``; its ``--l2``): an H100's.
META_L2_BYTES = 50 * 2**20
#: The shard's scored rows in the compute dtype are made once per step (:func:`scored_rows`) when
#: they take at most this many bytes (1M classes × D = 512 in bf16), and every GEMM slices them;
#: above, each chunk makes its own operand, bounding the step's memory whatever the shard's size.
OPERAND_BYTES = 2**30
#: Classes per chunk under Triton's interpreter: small, so the tests cross several chunks.
INTERPRETER_CHUNK = 16
#: Chunks are whole multiples of this many classes (the epilogues' class tile).
CHUNK_QUANTUM = 128
#: :data:`shardfc.head.fused.CHUNK_SCALES`: the chunk sizes a step can take, as multiples of the
#: L2-sized one (:func:`chunk_classes`): 1 keeps each chunk's products and ``H`` in L2; the larger
#: ones issue fewer launches a step.
#: The scale a step takes unless told otherwise (``impl="auto"`` times every scale): the one with
#: the least on-paper time at the headline workload once the host's issue time is counted
#: (docs/gpu.md, "Chunk sizes"), until a GPU has timed them.
DEFAULT_CHUNK_SCALE = 1
#: Programs per SM the per-row kernels' grids aim at (:func:`row_tile`).
ROW_WAVES = 4
#: The fewest rows a per-row kernel's program takes.
MIN_ROW_TILE = 8
#: ``E``'s scale in fp16 (see the module docstring); other dtypes need none.
FP16_UNIT = 2.0**15
#: Epilogue tiles: ``(BM, BN)`` of the forward and backward epilogues, ``(BR, BD)`` of the row
#: kernels. Memory-bound elementwise kernels: no tensor cores, nothing to tune.
EPILOGUE_TILES = (32, 128)
#: ... with sub-centres or the filter, whose blocks keep more alive (smaller: no spills).
HEAVY_EPILOGUE_TILES = (32, 64)
ROW_TILES = (32, 128)
#: ... of the fused update, which keeps five tiles alive (H, the row, its momentum, the target
#: terms, the gradient): half as wide, so a thread holds ~130 registers, not ~250.
UPDATE_TILES = (32, 64)
#: ... of AdamW's, which keeps two moments besides: half as many rows (under Triton 3.9, 32×64 with
#: the next step's operand spills 8 bytes at 168 registers; 16×64 takes 96, none spilled).
ADAMW_UPDATE_TILES = (16, 64)
INTERPRETER_TILES = (16, 16)


@dataclass
class RowUpdate:
    """The optimizer's step the backward applies to each scored row as it forms its gradient, on
    ``param`` (the shard's weight, updated in place at the weight rows), rounded once to nearest
    into the dtypes of the weight and its state:

    * SGD (weight decay, momentum, Nesterov; no dampening) with ``momentum_buffer`` (same shape;
      None without momentum) — what :class:`shardfc.head.partial_fc.RowSparseSGD` does with the
      gradient;
    * AdamW (``exp_avg`` set, :meth:`adamw`): decoupled weight decay, the moments ``exp_avg`` and
      ``exp_avg_sq`` (same shape) and the per-row step count ``row_step`` (fp64 ``[rows]``) for
      the bias corrections — :class:`shardfc.head.partial_fc.RowSparseAdamW`'s step.

    (:func:`shardfc.head.partial_fc.head_optimizer`, ``fused_update``.)"""

    param: Tensor
    momentum_buffer: Optional[Tensor]
    lr: float
    momentum: float
    weight_decay: float
    nesterov: bool
    exp_avg: Optional[Tensor] = None
    exp_avg_sq: Optional[Tensor] = None
    row_step: Optional[Tensor] = None
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    #: :meth:`hyper_values` as an fp32 tensor on the weight's device, which the kernel reads (the
    #: optimizer's :class:`~.device_scalars.DeviceScalars`, at one address across steps, so a captured
    #: step replays with the values staged for it); None: made by the launch from the numbers.
    hyper: Optional[Tensor] = None

    @classmethod
    def adamw(cls, param: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, row_step: Tensor, lr: float,
              betas: Tuple[float, float], eps: float, weight_decay: float) -> "RowUpdate":
        """AdamW's step (see the class)."""
        return cls(param, None, lr, 0.0, weight_decay, False, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                   row_step=row_step, betas=(float(betas[0]), float(betas[1])), eps=float(eps))

    @property
    def is_adamw(self) -> bool:
        return self.exp_avg is not None

    def hyper_values(self) -> Tuple[float, ...]:
        """The numbers the kernel reads, in its order (:data:`.epilogue.SGD_HYPER` or
        :data:`.epilogue.ADAMW_HYPER`): each β as two fp32 halves whose fp64 sum is β to 2⁻⁴⁸."""
        if self.is_adamw:
            (b1_hi, b1_lo), (b2_hi, b2_lo) = (_split(b) for b in self.betas)
            return (float(self.lr), 1.0 - self.lr * self.weight_decay, b1_hi, b1_lo, b2_hi, b2_lo,
                    1.0 - self.betas[0], 1.0 - self.betas[1], float(self.eps))
        return (float(self.lr), float(self.momentum), float(self.weight_decay))

    def hyper_on(self, device: torch.device) -> Tensor:
        """:attr:`hyper`, or a tensor of :meth:`hyper_values` made now on ``device``."""
        return self.hyper if self.hyper is not None else scalars_on(self.hyper_values(), device)

    def state(self) -> List[Tensor]:
        """The ``[rows, D]`` tensors the step rewrites at each updated row: the weight and its
        momentum, or its two moments."""
        extra = (self.exp_avg, self.exp_avg_sq) if self.is_adamw else (self.momentum_buffer,)
        return [t for t in (self.param, *extra) if t is not None]


@functools.lru_cache(maxsize=None)
def _cuda_l2_bytes(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).L2_cache_size)


def l2_bytes(device: torch.device) -> int:
    """The L2 cache of ``device`` (a CUDA GPU's, read once; :data:`META_L2_BYTES` on meta)."""
    if device.type == "cuda":
        return _cuda_l2_bytes(device.index if device.index is not None else torch.cuda.current_device())
    return META_L2_BYTES


def chunk_classes(n_cls: int, batch: int, K: int, D: int, elem: int, device: torch.device,
                  backward: bool = False, scale: Optional[int] = 1) -> int:
    """Classes per chunk: ``scale`` times the most whose working set — what the chunk's kernels
    write and read again: the ``[B, K·c]`` products and the ``K·c`` operand rows the GEMMs reread,
    in ``elem``-byte elements, and in the ``backward`` the ``[K·c, D]`` fp32 ``H`` the row kernel
    reads — fills :data:`CHUNK_L2_SHARE` of ``device``'s L2 (:func:`l2_bytes`), a multiple of
    :data:`CHUNK_QUANTUM` (at least one; interpreter: ``scale ×`` :data:`INTERPRETER_CHUNK`), never
    past the shard rounded up to the quantum. At ``scale`` 1 a chunk's products and ``H`` are still
    in L2 when the next chunk's, which take their blocks, overwrite them: they never reach HBM.

    The rows the row kernel streams (the weight and optimizer state the fused update rewrites, the
    gradient it writes) are read or written once each: they pass through L2 but are never reused,
    so they take no share of it. A larger ``scale`` (:data:`CHUNK_SCALES`) trades that L2 fit for
    fewer chunks, so fewer launches: which pays depends on how long the host takes to issue a
    launch against how long the GPU takes to run it (``shardfc plan --bytes`` shows both for each
    scale; ``impl="auto"`` times them)."""
    scale = check_chunk_scale(scale)
    if interpreting():
        return INTERPRETER_CHUNK * scale
    per_row = batch * elem + D * elem + (4 * D if backward else 0)
    c = int(CHUNK_L2_SHARE * l2_bytes(device)) // (K * max(per_row, 1))
    c = max(CHUNK_QUANTUM, c // CHUNK_QUANTUM * CHUNK_QUANTUM) * scale
    return min(c, triton.cdiv(max(n_cls, 1), CHUNK_QUANTUM) * CHUNK_QUANTUM)


def check_chunk_scale(scale) -> int:
    """``scale`` validated: one of :data:`CHUNK_SCALES` (None: :data:`DEFAULT_CHUNK_SCALE`)."""
    return DEFAULT_CHUNK_SCALE if scale is None else fused_check_chunk_scale(scale)


def row_tile(n_rows: int, widest: int, device: torch.device) -> int:
    """Rows a program of a per-row kernel takes: ``widest``, or :data:`MIN_ROW_TILE` when the grid
    over ``n_rows`` rows at ``widest`` would give fewer than :data:`ROW_WAVES` programs per SM of
    ``device`` (on the meta device, :data:`~.autotune.META_SMS`). These kernels stream rows: a grid
    below one wave leaves SMs idle with bandwidth unused, and a few waves even out the programs
    that gather scattered rows (Partial FC) or hold a target row. Two tiles, not every halving:
    each is a build of its own (in the sm_90 build, the SGD update's 16-row tile spills 8 bytes
    where the 8- and 32-row ones spill none). Fixed under the interpreter."""
    if interpreting() or device.type not in ("cuda", "meta"):
        return widest
    sms = autotune.META_SMS if device.type == "meta" else autotune.sm_count(device.index or 0)
    return widest if triton.cdiv(n_rows, widest) >= ROW_WAVES * sms else min(widest, MIN_ROW_TILE)


def _tiles(which):
    return INTERPRETER_TILES if interpreting() else which


def heavy(K: int, filter_: bool) -> bool:
    """Sub-centres or the filter: the epilogues take :data:`HEAVY_EPILOGUE_TILES`."""
    return K > 1 or filter_


def _block_tiles(K: int, filter_: bool):
    return _tiles(HEAVY_EPILOGUE_TILES if heavy(K, filter_) else EPILOGUE_TILES)


def emulate_rtne(out: Tensor) -> bool:
    """A bf16 store under the interpreter, which truncates: the kernel rounds by hand first."""
    return interpreting() and out.dtype == torch.bfloat16


def unit_for(compute_dtype: torch.dtype) -> float:
    return FP16_UNIT if compute_dtype == torch.float16 else 1.0


def _operand_launch(w, rows, inv, out, r0, n_rows, compute_inv, scale, write):
    if shapes_only(w):
        reads = [gathered(w, rows, r0, n_rows)] + rows_of(rows, r0, n_rows)
        writes = rows_of(out, 0, n_rows) if write else []
        (writes if compute_inv else reads).extend(rows_of(inv, r0, n_rows) if compute_inv or scale else [])
        note("operand_rows", reads, writes)
        return
    BR, BD = _tiles(ROW_TILES)
    BR = row_tile(n_rows, BR, w.device)
    epilogue.operand_rows_kernel[(triton.cdiv(n_rows, BR),)](
        w, rows if rows is not None else w, inv if inv is not None else w, out if out is not None else w,
        n_rows, r0, w.shape[1], w.stride(0), out.stride(0) if out is not None else 0,
        HAS_ROWS=rows is not None, COMPUTE_INV=compute_inv, SCALE=scale, WRITE=write,
        EMULATE_RTNE=out is not None and emulate_rtne(out), BR=BR, BD=BD,
    )


def scored_rows(w: Tensor, rows: Optional[Tensor], n_rows: int, dtype: torch.dtype, normalize: bool,
                need_inv: bool) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """One pass over the shard's ``n_rows`` scored rows, once per step: ``(operand, inv)``.

    ``inv`` ``[n_rows]`` fp32: ``1/‖w‖`` (None unless ``need_inv``). ``operand`` ``[n_rows, D]`` in
    ``dtype``: the rows (gathered through ``rows``; times ``inv`` when ``normalize``), which every
    GEMM of the step slices — so the matmuls stream 2 bytes per element, not 4 — or None when it
    would exceed :data:`OPERAND_BYTES` (each chunk then makes its own, :func:`operand_rows`)."""
    inv = torch.empty(n_rows, dtype=torch.float32, device=w.device) if need_inv else None
    write = n_rows * w.shape[1] * torch.finfo(dtype).bits // 8 <= OPERAND_BYTES
    out = torch.empty(n_rows, w.shape[1], dtype=dtype, device=w.device) if write else None
    if n_rows and (write or need_inv):
        _operand_launch(w, rows, inv, out, 0, n_rows, need_inv, normalize, write)
    return out, inv


class NextOperand:
    """One shard's :func:`scored_rows` result for the next step, written by this step's fused update
    (:func:`backward` with ``next_operand``), so that the next forward skips the pass over ``W``.

    It stands for the weight exactly as the update left it, so :meth:`take` hands it out only while
    nothing else has changed the weight: the same tensor (held weakly), ``data_ptr``, ``_version``,
    shape and dtype, and the same compute dtype, normalisation and need for the norms. Any in-place
    torch operation on the weight (``load_state_dict``, ``grow``, a torch optimizer's step, the
    row-sparse optimizers, whose Triton kernel bumps the version too) changes ``_version``, and
    the next forward makes a fresh operand. Writes through ``.data`` (or another kernel that does
    not bump the version) bypass the check: call :meth:`clear` after them
    (:meth:`shardfc.ShardedMarginHead.release_next_operands`). Held between steps, it keeps the
    operand's memory (``2·n·D`` bytes in bf16) allocated, which every step allocates anyway."""

    def __init__(self) -> None:
        self.clear()

    def __getstate__(self) -> dict:  # a copy or a pickle of the head makes its operand again
        return {}

    def __setstate__(self, state: dict) -> None:
        self.clear()

    def clear(self) -> None:
        self._weight = None
        self._key: Optional[tuple] = None
        self.operand: Optional[Tensor] = None
        self.inv: Optional[Tensor] = None

    @staticmethod
    def _key_of(w: Tensor, dtype: torch.dtype, normalize: bool, need_inv: bool) -> tuple:
        return (w.data_ptr(), w._version, tuple(w.shape), w.dtype, dtype, bool(normalize), bool(need_inv))

    def keep(self, w: Tensor, operand: Tensor, inv: Optional[Tensor], dtype: torch.dtype, normalize: bool,
             need_inv: bool) -> None:
        """``(operand, inv)`` are now what :func:`scored_rows` would make from ``w`` as it is."""
        self._weight = weakref.ref(w)
        self._key = self._key_of(w, dtype, normalize, need_inv)
        self.operand, self.inv = operand, inv

    def take(self, w: Tensor, dtype: torch.dtype, normalize: bool,
             need_inv: bool) -> Optional[Tuple[Tensor, Optional[Tensor]]]:
        """``(operand, inv)`` for ``w`` as it is now, or None (and forgotten) when anything differs."""
        if self._weight is None:
            return None
        if self._weight() is not w or self._key != self._key_of(w, dtype, normalize, need_inv):
            self.clear()
            return None
        return self.operand, self.inv

    @property
    def nbytes(self) -> int:
        """Bytes it holds (the operand and the norms)."""
        return sum(t.untyped_storage().nbytes() for t in (self.operand, self.inv) if t is not None)


def operand_rows(w: Tensor, rows: Optional[Tensor], inv: Optional[Tensor], r0: int, n_rows: int,
                 dtype: torch.dtype, scale: bool) -> Tensor:
    """Scored rows ``r0 .. r0 + n_rows`` of ``w`` (through ``rows``), times ``inv`` (``scale``), in
    ``dtype``: one chunk's GEMM operand, ``[n_rows, D]``, where the step has no :func:`scored_rows`."""
    out = torch.empty(n_rows, w.shape[1], dtype=dtype, device=w.device)
    if n_rows:
        _operand_launch(w, rows, inv, out, r0, n_rows, False, scale, True)
    return out


def _raw_rows(w: Tensor, rows: Optional[Tensor], r0: int, r1: int) -> Tensor:
    """The chunk's centre rows as stored (fp32 for the filter's cosines): a view, or gathered."""
    return w[r0:r1] if rows is None else w.index_select(0, rows[r0:r1])


class _Chunk:
    """One chunk's GEMM operand (a slice of the step's, or its own) and products (and the filter's
    cosines)."""

    def __init__(self, a: Tensor, w: Tensor, rows, inv, tr, c0: int, c1: int, K: int, normalize: bool,
                 operand: Optional[Tensor]):
        self.c0, self.c1, self.r0, self.r1 = c0, c1, c0 * K, c1 * K
        if operand is not None:
            self.op = operand[self.r0:self.r1]
        else:
            self.op = operand_rows(w, rows, inv, self.r0, self.r1 - self.r0, a.dtype, normalize)
        self.p = a @ self.op.t()  # [B, K·c] in the compute dtype
        self.f = None
        if tr is not None:
            self.f = tr @ _raw_rows(w, rows, self.r0, self.r1).to(tr.dtype).t()

    def block_reads(self, inv: Optional[Tensor], per_sample) -> list:
        """What an epilogue over this chunk's products reads (``shardfc plan --bytes``): the block
        (and the filter's cosines), the rows' ``1/‖w‖`` and the ``[B]`` vectors ``per_sample``."""
        reads = [span(self.p)] + ([span(self.f)] if self.f is not None else []) + rows_of(inv, self.r0, self.r1 - self.r0)
        return reads + [span(t) for t in per_sample]

    def filter_args(self):
        return (self.f, self.f.stride(0)) if self.f is not None else (self.p, 0)


def forward_stats(a: Tensor, w: Tensor, rows: Optional[Tensor], inv: Optional[Tensor], tr: Optional[Tensor],
                  tcol: Tensor, tval: Tensor, n_cls: int, K: int, scale: float, threshold: float,
                  normalize: bool, smooth: bool, operand: Optional[Tensor] = None,
                  chunk_scale: Optional[int] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """``(pmax, psum, plsum)`` ``[B, parts]``: the shard's partial statistics, chunk by chunk
    (``chunk_scale``: :func:`chunk_classes`'s ``scale``; None: :data:`DEFAULT_CHUNK_SCALE`)."""
    B, dev = a.shape[0], a.device
    per_chunk = chunk_classes(n_cls, B, K, a.shape[1], a.element_size(), dev, scale=chunk_scale)
    BM, BN = _block_tiles(K, tr is not None)
    wanted = autotune.splits_wanted(B, BM, dev, off_gpu=2)  # the tests fold two splits per chunk
    per_prog = triton.cdiv(triton.cdiv(per_chunk, wanted), BN) * BN
    chunks = [(c0, min(c0 + per_chunk, n_cls)) for c0 in range(0, n_cls, per_chunk)]
    splits = [triton.cdiv(c1 - c0, per_prog) for c0, c1 in chunks]
    n_parts = sum(splits)
    pmax = torch.empty(B, n_parts, dtype=torch.float32, device=dev)
    psum = torch.empty_like(pmax)
    plsum = torch.empty_like(pmax) if smooth else pmax
    part0 = 0
    for (c0, c1), n_split in zip(chunks, splits):
        ch = _Chunk(a, w, rows, inv, tr, c0, c1, K, normalize, operand)
        if shapes_only(ch.p):
            outs = [Region(t, ("cols", part0, n_split), B * n_split * 4) for t in {id(t): t for t in (pmax, psum, plsum)}.values()]
            note("forward_epilogue", ch.block_reads(inv, (tcol, tval)), outs)
        else:
            f, stride_f = ch.filter_args()
            epilogue.forward_epilogue_kernel[(triton.cdiv(B, BM), n_split)](
                ch.p, f, inv if inv is not None else pmax, tcol, tval, pmax, psum, plsum,
                B, c1 - c0, c0, ch.r0, per_prog, ch.p.stride(0), stride_f, part0, n_parts,
                float(scale), float(threshold), K=K, FILTER=tr is not None, SMOOTH=smooth, BM=BM, BN=BN,
            )
        part0 += n_split
    return pmax, psum, plsum


def backward(a: Tensor, w: Tensor, rows: Optional[Tensor], inv: Optional[Tensor], tr: Optional[Tensor],
             tcol: Tensor, tval: Tensor, tsub: Tensor, tdraw: Tensor, on: Tensor,
             row_max: Tensor, inv_sum: Tensor, coef: Tensor, grad_w: Tensor, *, n_cls: int, K: int,
             scale: float, threshold: float, eps_over_c: float, one_minus_eps: float,
             normalize: bool, accumulate: bool, scatter: bool, a_exact: Optional[Tensor] = None,
             operand: Optional[Tensor] = None, update: Optional[RowUpdate] = None,
             next_operand: bool = False, grad_sq: Optional[Tensor] = None,
             chunk_scale: Optional[int] = None) -> Tensor:
    """The shard's ``dJ/da`` (fp32 ``[B, D]``); ``dJ/dW`` written into ``grad_w`` (added with
    ``accumulate``; at the weight rows with ``scatter``, else at the scored rows) — or, with
    ``update``, applied to the weight by the optimizer's step row by row and never stored
    (``grad_w`` is then unused).

    ``a`` is in the compute dtype; ``row_max``/``inv_sum`` the global ``M`` and ``1/S``; ``coef`` the
    per-sample weights of the objective (0 for ignored samples); ``tval``/``tdraw``/``tsub``/``on``
    the margin's target value and derivative, the target's sub-centre, and whether the label is
    on this shard; ``a_exact``: the embeddings before the cast (the target rows' gradient uses
    them; default ``a``); ``operand``: the step's :func:`scored_rows` operand (None: per chunk).
    ``next_operand`` (with ``update``, every row scored and ``operand``): the update also writes
    the updated rows' operand and ``1/‖w‖`` over ``operand`` and ``inv``, chunk by chunk — the next
    step's, as :func:`scored_rows` would make them from the new weights (:class:`NextOperand`).
    In place is safe: a chunk's operand rows and norms are read by its own GEMMs and kernels only,
    all before its update, and the target rows' terms are formed before the loop.
    ``chunk_scale``: :func:`chunk_classes`'s ``scale`` (None: :data:`DEFAULT_CHUNK_SCALE`).
    ``grad_sq`` (fp32 ``[1]``, without ``update``): set to the sum of squares of every row of
    ``grad_w`` this backward writes, as stored (after ``accumulate``'s add and the target rows'),
    from the weight-gradient pass itself: each of its programs sums its rows' squares, and the
    ``B`` target rows are corrected after their terms are added — no pass over ``grad_w``."""
    if grad_sq is not None and update is not None:
        raise ValueError("grad_sq is the stored gradient's: a fused update stores none")
    if next_operand and (update is None or rows is not None or operand is None or (inv is None) == normalize):
        raise ValueError("next_operand needs the fused update, every row scored, the step's operand and the "
                         "norms exactly when the rows are normalised")
    a_exact = a if a_exact is None else a_exact
    B, D, dev = a.shape[0], a.shape[1], a.device
    cd = a.dtype
    unit = unit_for(cd)
    per_chunk = chunk_classes(n_cls, B, K, D, a.element_size(), dev, backward=True, scale=chunk_scale)
    BM, BN = _block_tiles(K, tr is not None)
    BR, BD = _tiles(ROW_TILES)
    BR = row_tile(per_chunk * K, BR, dev)  # one chunk's rows in a few waves of programs
    # coef rides on the rows of x for the weight GEMM, scaled to at most 1 so fp16 keeps it normal.
    cmax = coef.abs().amax()
    cmax = torch.where(cmax > 0, cmax, torch.ones_like(cmax))
    x_coef = (a.float() * (coef / cmax).unsqueeze(1)).to(cd)
    hscale = (cmax * (scale / unit)).reshape(1).contiguous()
    scratch = torch.empty(1, dtype=torch.float32, device=dev)  # for pointer arguments a kernel ignores

    # The target column, exactly, from [B] values: dJ/dc_t = z_t'·coef·(p_t − ε/C − (1−ε)) on the
    # label's shard; its dJ/da is dc_t·ŵ_t and its dJ/dw_t the normalisation backward of dc_t·a.
    # Formed first, from the rows as they are before any update of this step.
    p_t = torch.exp(tval - row_max) * inv_sum
    dc_t = torch.where(on, tdraw * coef * (p_t - eps_over_c - one_minus_eps), torch.zeros_like(p_t))
    t_scored = tcol.clamp(min=0).to(torch.int64) * K + tsub.to(torch.int64)
    t_row = t_scored if rows is None else rows[t_scored]
    w_t = w[t_row].float()
    h_t = dc_t.unsqueeze(1) * a_exact.float()
    if normalize:
        inv_t = inv[t_scored].unsqueeze(1)
        w_hat_t = w_t * inv_t
        grad_a_t = dc_t.unsqueeze(1) * w_hat_t
        h_t = inv_t * (h_t - (h_t * w_hat_t).sum(dim=1, keepdim=True) * w_hat_t)
    else:
        grad_a_t = dc_t.unsqueeze(1) * w_t
    if update is not None:
        slot, t_sum = _target_slots(t_scored, h_t, n_cls * K)
        hyper = update.hyper_on(dev)  # read by every chunk's update: the step's numbers, on the device

    grad_a = torch.zeros(B, D, dtype=torch.float32, device=dev)
    # With grad_sq, each weight-gradient program's sum of squares, chunk after chunk.
    starts = range(0, n_cls, per_chunk)
    programs = [triton.cdiv((min(c0 + per_chunk, n_cls) - c0) * K, BR) for c0 in starts]
    sq_parts = torch.zeros(sum(programs), dtype=torch.float32, device=dev) if grad_sq is not None else None
    sq_at = 0
    for c0, n_programs in zip(starts, programs):
        c1 = min(c0 + per_chunk, n_cls)
        ch = _Chunk(a, w, rows, inv, tr, c0, c1, K, normalize, operand)
        n_rows = ch.r1 - ch.r0
        if shapes_only(ch.p):
            note("backward_epilogue", ch.block_reads(inv, (tcol, tval, row_max, inv_sum)), [span(ch.p)])
        else:
            f, stride_f = ch.filter_args()
            epilogue.backward_epilogue_kernel[(triton.cdiv(B, BM), triton.cdiv(c1 - c0, BN))](
                ch.p, f, inv if inv is not None else scratch, tcol, tval, row_max, inv_sum,
                B, c1 - c0, c0, ch.r0, ch.p.stride(0), stride_f, float(scale), float(threshold),
                float(eps_over_c), float(unit), K=K, FILTER=tr is not None, SMOOTH=eps_over_c > 0,
                EMULATE_RTNE=emulate_rtne(ch.p), BM=BM, BN=BN,
            )
        addmm_f32(grad_a, ch.p, ch.op)  # gx += E·Ŵ, one GEMM
        h = mm_f32(ch.p.t(), x_coef)  # H = Eᵀ·x', [K·c, D] fp32
        w_hat = operand is not None and normalize  # the normalised rows, already in the operand
        w_read = operand if w_hat else w
        if shapes_only(h):
            _note_rows(update, h, w_read, None if w_hat else rows, inv, rows, grad_w, ch.r0, n_rows, accumulate, scatter,
                       slot if update is not None else None, operand if next_operand else None)
        elif update is not None:
            _update_launch(update, h, w_read, rows, inv, hscale, slot, t_sum, n_rows, ch.r0, D, normalize, w_hat,
                           scratch, operand if next_operand else None, hyper)
        else:
            epilogue.weight_grad_kernel[(n_programs,)](
                h, w_read, rows if rows is not None else scratch, inv if inv is not None else scratch, grad_w,
                hscale, sq_parts[sq_at:] if sq_parts is not None else scratch, n_rows, ch.r0, D,
                h.stride(0), w_read.stride(0), grad_w.stride(0),
                HAS_ROWS=rows is not None, NORM_W=normalize, W_HAT=w_hat, ACCUMULATE=accumulate, SCATTER=scatter,
                SQ=sq_parts is not None, EMULATE_RTNE=emulate_rtne(grad_w), BR=BR, BD=BD,
            )
        sq_at += n_programs
        # Freed before the next chunk allocates its own: the caching allocator then hands it these
        # blocks, whose lines are still in L2, so the dirty products and H are overwritten there
        # instead of being written back to HBM.
        del ch, h
    grad_a *= (coef * (scale / unit)).unsqueeze(1)
    grad_a += grad_a_t
    if update is None:
        # Samples sharing a target add up (index_add); samples elsewhere add zeros to row 0.
        at = t_row if scatter else t_scored
        grad_w.index_add_(0, at, h_t.to(grad_w.dtype))
        if grad_sq is not None:
            grad_sq.copy_(sq_parts.sum().reshape(1) + _target_rows_correction(grad_w, at, t_scored, h_t, n_cls * K))
    return grad_a


def _target_rows_correction(grad_w: Tensor, at: Tensor, t_scored: Tensor, h_t: Tensor, n_scored: int) -> Tensor:
    """What adding the target terms ``h_t`` at rows ``at`` of ``grad_w`` (done already) changed in
    its sum of squares, from those ``B`` rows only: ``Σ ‖G_r‖² − ‖G_r − T_r‖²`` over the distinct
    rows ``r``, ``T_r`` the sum of the terms added there (counted once, at one sample per row)."""
    if t_scored.numel() == 0:
        return torch.zeros(1, dtype=torch.float32, device=grad_w.device)
    _, t_sum = _target_slots(t_scored, h_t, n_scored)
    g = grad_w[at].float()
    return ((g * g).sum() - (g - t_sum).square().sum()).reshape(1)


def _update_launch(update: RowUpdate, h: Tensor, w_read: Tensor, rows: Optional[Tensor], inv: Optional[Tensor],
                   hscale: Tensor, slot: Tensor, t_sum: Tensor, n_rows: int, r0: int, D: int, normalize: bool,
                   w_hat: bool, scratch: Tensor, next_op: Optional[Tensor], hyper: Tensor) -> None:
    """One chunk's fused update: :func:`epilogue.weight_update_kernel` (SGD) or
    :func:`epilogue.adamw_update_kernel` on its ``n_rows`` scored rows from ``r0``; ``next_op``: the
    step's operand, which the kernel overwrites with the next step's rows (and ``inv``)."""
    p = update.param
    UR, UD = _tiles(ADAMW_UPDATE_TILES if update.is_adamw else UPDATE_TILES)
    UR = row_tile(n_rows, UR, h.device)
    grid = (triton.cdiv(n_rows, UR),)
    common = (h, w_read, rows if rows is not None else scratch, inv if inv is not None else scratch, hscale, slot, t_sum, p)
    op = next_op if next_op is not None else p
    flags = dict(HAS_ROWS=rows is not None, NORM_W=normalize, W_HAT=w_hat, NEXT=next_op is not None,
                 EMULATE_RTNE=emulate_rtne(p), EMULATE_OP=emulate_rtne(op), BR=UR, BD=UD)
    if update.is_adamw:
        m, v, step = update.exp_avg, update.exp_avg_sq, update.row_step
        epilogue.adamw_update_kernel[grid](
            *common, m, v, step, op, hyper, n_rows, r0, D, h.stride(0), w_read.stride(0), t_sum.stride(0), p.stride(0),
            m.stride(0), v.stride(0), op.stride(0), **flags,
        )
        return
    buf = update.momentum_buffer
    epilogue.weight_update_kernel[grid](
        *common, buf if buf is not None else p, op, hyper, n_rows, r0, D, h.stride(0), w_read.stride(0), t_sum.stride(0),
        p.stride(0), buf.stride(0) if buf is not None else 0, op.stride(0),
        MOMENTUM=buf is not None, NESTEROV=bool(update.nesterov), **flags,
    )


def _split(x: float) -> Tuple[float, float]:
    """``(hi, lo)``: ``hi`` the fp32 nearest ``x``, ``lo`` the fp32 nearest ``x − hi``, so that
    ``hi + lo`` in fp64 is ``x`` to 2⁻⁴⁸ relative (a kernel's fp32 scalar arguments carrying an fp64)."""
    hi = _fp32(x)
    return hi, _fp32(x - hi)


def _fp32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _note_rows(update: Optional[RowUpdate], h: Tensor, w_read: Tensor, read_rows: Optional[Tensor],
               inv: Optional[Tensor], rows: Optional[Tensor], grad_w: Tensor, r0: int, n: int, accumulate: bool,
               scatter: bool, slot: Optional[Tensor], next_op: Optional[Tensor] = None) -> None:
    """What :func:`epilogue.weight_update_kernel` or :func:`epilogue.weight_grad_kernel` would read
    and write for one chunk's ``n`` rows (``shardfc plan --bytes``). The target terms the update
    adds (``t_sum``, at most ``B`` rows over the whole step) are left out; so is the second read of
    the rows it has just written, for ``next_op`` (the next step's operand rows and norms, which
    it writes), from L1/L2. The weight rows, their optimizer state and the gradient rows are
    streamed (the kernels load and store them ``evict_first``: each is touched once a step)."""
    reads = [span(h[:n]), gathered(w_read, read_rows, r0, n)] + rows_of(inv, r0, n) + rows_of(rows, r0, n)
    if update is not None:
        state = streamed([gathered(t, rows, r0, n) for t in update.state()])
        if update.row_step is not None:
            step = update.row_step
            state += streamed([span(step[r0:r0 + n]) if rows is None
                               else Region(step, ("rows", rows, rows.storage_offset() + r0, n), n * step.element_size())])
        nxt = rows_of(next_op, r0, n) + rows_of(inv, r0, n) if next_op is not None else []
        note("adamw_update" if update.is_adamw else "weight_update", reads + state + rows_of(slot, r0, n), state + nxt)
        return
    out = streamed([gathered(grad_w, rows if scatter else None, r0, n)])[0]
    note("weight_grad", reads + ([out] if accumulate else []), [out])


def _target_slots(t_scored: Tensor, h_t: Tensor, n_scored: int) -> Tuple[Tensor, Tensor]:
    """For the fused update: ``slot`` ``[n_scored]`` int32, −1 except at the scored rows that are
    some sample's target, where it names one of those samples; and ``t_sum`` ``[B, D]`` fp32, at that
    sample's row the sum of the target terms of every sample with that target (the others zero).
    Which of several samples names a row does not matter: all of them add into the one it names.
    No host sync: a scatter, a gather and an index_add of ``B`` rows."""
    B = t_scored.shape[0]
    slot = torch.full((n_scored,), -1, dtype=torch.int32, device=t_scored.device)
    slot[t_scored] = torch.arange(B, dtype=torch.int32, device=t_scored.device)
    t_sum = torch.zeros_like(h_t).index_add_(0, slot[t_scored].to(torch.int64), h_t)
    return slot, t_sum
