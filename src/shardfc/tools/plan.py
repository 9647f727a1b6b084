"""``shardfc plan``: per-rank memory of a :class:`~shardfc.ShardedMarginHead` step, and what fits a budget.

The prediction replays, buffer by buffer, what one training step of the head allocates and frees
on the rank with the largest shard (rank 0: ``⌈C/W⌉`` classes, ``⌈B/W⌉`` local rows). It follows
``head.py``, ``sharded_loss.py``, ``shard_math.py``, ``normalize.py`` and, for Partial FC,
``partial_fc.py`` line by line; a buffer lives while a Python name, a view of it, a saved tensor or
an autograd input buffer holds it:

* forward: the finiteness check and L2 normalisation of the embeddings, the all-gather of the
  ``[B, D]`` embeddings and of the labels, ``s·a`` ``[B, D]``; per chunk of classes the inverse
  norms ``1/‖w_j‖`` ``[K]`` (with their ``[K]`` temporaries: the normalised centres are never
  materialised) and the logits ``[B, K]``, column-scaled in place (no chunk size: one
  ``[B, n_local]`` buffer kept for the backward; with a chunk size the previous chunk's logits are
  alive while the next chunk's are computed);
* backward: ``s·a`` and the ``[B, D]`` embedding gradient; per chunk the inverse norms, the logits
  (recomputed when chunked: the previous chunk's stay alive through a view until the next chunk's
  first weight-gradient block), the ``[B, D]`` product ``dZ·w``, and the weight gradient in row
  blocks of ``shard_math.WGRAD_BLOCK``: with gradients kept each block is a ``[block, D]``
  temporary added into ``.grad`` (the previous block's is alive while the next one is computed);
  without, each block is written straight into ``grad_w = empty_like(w)``, allocated once per
  step; then the reduce-scatter of the embedding gradient and the L2 normalisation's backward;
* Partial FC: the sampling scores ``[n]``, top-k and sort, the row look-up ``[n]``, the sampled
  sub-weight ``w[rows]`` ``[n_s, D]``; its gradient ``[n_s, D]`` (``empty_like``, filled block by
  block) is added into ``.grad`` with ``index_add_`` (gradients kept) or into a dense
  ``zeros_like(w)`` ``[n, D]`` (not kept); the row-sparse optimizer's ``[n_s, D]`` temporaries;
* the optimizer step's temporaries (SGD: one ``[n, D]`` with weight decay; AdamW: two).

Buffers of less than ``O(B)`` bytes are left out.

Gradients between steps (``grad_in_place``; CLI ``--grads-kept`` / ``--no-grads-kept``):

* ``True`` (default): the weight's ``.grad`` is kept between steps (``zero_grad(set_to_none=False)``,
  what ``shardfc bench`` does) and the head adds the step's weight gradient into it in place
  (``weight_grad_in_place=True``, the head's default): the step allocates nothing of size
  ``[n, D]``. The gradient is then resting, like the weights: the ``gradients`` part is that
  ``[n, D]`` ``.grad`` and is not in ``step_peak``.
* ``False``: ``zero_grad(set_to_none=True)``: the step allocates the gradient
  (``empty_like(w)`` written block by block; under Partial FC a dense ``zeros_like(w)``), which
  lives until ``zero_grad`` after the optimizer step; the ``gradients`` part is the step's
  weight-gradient buffers at the peak and is in ``step_peak``.

(A head built with ``weight_grad_in_place=False`` that keeps its gradients gets a fresh ``[n, D]``
gradient each step, which autograd adds into ``.grad``: ``False`` approximates it.)

Two memory models:

* ``"allocated"`` (default; what a CUDA caching allocator reports and what a budget must hold):
  a tensor counts from its allocation;
* ``"resident"`` (what ``shardfc bench`` measures on CPU, the resident set): a tensor counts from
  the first write to it, so ``grad_w = empty_like(w)`` grows block by block as it is filled. It
  also counts CPU-only copies: with low-precision weights ``vector_norm(w, dtype=float32)`` first
  casts its input to fp32 on the CPU (not on CUDA), a block of at most ``WGRAD_BLOCK`` rows.

Parts (per rank, at the step's peak): ``weights`` and ``optimizer_state`` (resting),
``gradients`` (resting when kept, else the step's), ``activations`` (logits, inverse norms,
temporaries; with gradients kept also the weight-gradient blocks and Partial FC's ``[n_s, D]``
sub-gradient) and ``communication`` (gathered embeddings, their gradient and the reduce-scatter
buffers). ``step_peak`` is the sum of the step's parts (activations + communication, plus
gradients when not kept): what ``shardfc bench`` reports as ``peak_bytes_per_rank``. ``resting``
is the sum of the resting parts, and ``total = resting + step_peak`` the sum of all five.

Usage::

    shardfc plan --classes 1000000 --dim 512 --batch 1024 --world-size 8 --budget 16GiB
    shardfc plan ... --no-grads-kept      # the training loop calls zero_grad(set_to_none=True)
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from shardfc.head.kernels import WGRAD_BLOCK

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
OPTIMIZERS = ("sgd", "sgd_nomomentum", "adamw")
MEMORY_MODELS = ("allocated", "resident")
PARTS = ("weights", "gradients", "optimizer_state", "activations", "communication")

_W, _G, _O, _A, _C = PARTS  # categories of the simulated buffers


# --------------------------------------------------------------------------- the replay
class _Replay:
    """Live buffers and their peak, in bytes, under both memory models at once."""

    def __init__(self) -> None:
        self.live: Dict[int, List] = {}  # id -> [allocated bytes, size, touched bytes, category]
        self._next = 0
        self.cur = {"allocated": 0, "resident": 0}
        self.peak = {"allocated": 0, "resident": 0}
        self.peak_parts: Dict[str, Dict[str, int]] = {m: {} for m in MEMORY_MODELS}

    def alloc(self, nbytes: int, cat: str, touched: bool = True, cpu_only: bool = False) -> Optional[int]:
        """A new buffer of ``nbytes``; ``touched``: written at once (else see :meth:`touch`);
        ``cpu_only``: a copy only the CPU makes (counts in the resident model only)."""
        nbytes = int(nbytes)
        if nbytes <= 0:
            return None
        h = self._next
        self._next += 1
        allocated = 0 if cpu_only else nbytes
        self.live[h] = [allocated, nbytes, nbytes if touched else 0, cat]
        self.cur["allocated"] += allocated
        self.cur["resident"] += nbytes if touched else 0
        self._update()
        return h

    def touch(self, h: Optional[int], upto: int) -> None:
        """The first ``upto`` bytes of ``h`` have been written."""
        if h is None:
            return
        entry = self.live[h]
        upto = min(int(upto), entry[1])
        if upto > entry[2]:
            self.cur["resident"] += upto - entry[2]
            entry[2] = upto
            self._update()

    def free(self, *handles: Optional[int]) -> None:
        for h in handles:
            if h is None:
                continue
            allocated, _, touched, _ = self.live.pop(h)
            self.cur["allocated"] -= allocated
            self.cur["resident"] -= touched

    def _update(self) -> None:
        for model, slot in (("allocated", 0), ("resident", 2)):
            if self.cur[model] > self.peak[model]:
                self.peak[model] = self.cur[model]
                parts = {p: 0 for p in PARTS}
                for entry in self.live.values():
                    parts[entry[3]] += entry[slot]
                self.peak_parts[model] = parts


def _chunks(n: int, step: int) -> List[Tuple[int, int, int]]:
    """The pieces ``(index, start, size)`` of ``range(0, n, step)`` whose replay gives the exact
    peak: the first three and the last three (every full piece in between repeats the state of
    the ones replayed; what grows, the filled part of ``grad_w``, is largest in the last ones)."""
    count = math.ceil(n / step) if n else 0
    picked = sorted({k for k in (0, 1, 2, count - 3, count - 2, count - 1) if 0 <= k < count})
    return [(k, k * step, min(step, n - k * step)) for k in picked]


class _Shape:
    """The sizes of one replay: ``s`` bytes per weight/embedding element (the matmul dtype too),
    ``sd`` per statistics element (fp32, fp64 for fp64), the chunk size, whether the margin
    normalises the centres."""

    def __init__(self, B: int, D: int, s: int, sd: int, chunk: Optional[int], norm_w: bool):
        self.B, self.D, self.s, self.sd = B, D, s, sd
        self.chunk, self.norm_w = chunk, norm_w


def _convert(m: _Replay, h: Optional[int], nbytes_to: int, same: bool, cat: str = _A) -> Optional[int]:
    """``t.to(dtype)``: the same buffer when the dtype is unchanged, else a new one (old freed)."""
    if same:
        return h
    out = m.alloc(nbytes_to, cat)
    m.free(h)
    return out


def _normalized_rows(m: _Replay, rows: int, D: int, s: int) -> Tuple[Optional[int], Optional[int]]:
    """normalize.normalized_rows: ``w * norm.clamp(eps).reciprocal()`` -> (copy, norm)."""
    norm = m.alloc(rows * s, _A)
    clamp = m.alloc(rows * s, _A)
    inv = m.alloc(rows * s, _A)
    m.free(clamp)
    out = m.alloc(rows * D * s, _A)
    m.free(inv)
    return out, norm


def _normalized_rows_backward_(m: _Replay, rows: int, s: int) -> None:
    """normalize.normalized_rows_backward_: in place; only [rows] temporaries."""
    dot = m.alloc(rows * s, _A)  # bmm row dots
    mask = m.alloc(rows, _A)  # norm >= eps
    clamp = m.alloc(rows * s, _A)
    recip = m.alloc(rows * s, _A)
    m.free(clamp)
    zeros = m.alloc(rows * s, _A)
    inv = m.alloc(rows * s, _A)  # torch.where(...)
    m.free(mask, recip, zeros)
    m.free(inv, dot)


def _inverse_norms(m: _Replay, sh: _Shape, K: int) -> Optional[int]:
    """shard_math._inverse_norms: ``where(norm >= eps, norm.clamp(eps).reciprocal(), zeros_like(norm))``
    with ``norm = vector_norm(w_c, dim=1, dtype=stats dtype)`` -> the [K] inverse norms."""
    if not sh.norm_w:
        return None
    sd = sh.sd
    # CPU: vector_norm(dtype=fp32) casts its input first; shard_math bounds it to WGRAD_BLOCK rows
    cast = m.alloc(min(K, WGRAD_BLOCK) * sh.D * sd, _A, cpu_only=True) if sh.s != sd else None
    norm = m.alloc(K * sd, _A)
    m.free(cast)
    mask = m.alloc(K, _A)
    clamp = m.alloc(K * sd, _A)
    recip = m.alloc(K * sd, _A)
    m.free(clamp)
    zeros = m.alloc(K * sd, _A)
    inv = m.alloc(K * sd, _A)
    m.free(mask, recip, zeros, norm)
    return inv


def _raw_products(m: _Replay, sh: _Shape, K: int) -> Optional[int]:
    """shard_math._raw_products: ``(a_s @ w_c.t())`` in the matmul dtype, ``.to(stats dtype)``."""
    z = m.alloc(sh.B * K * sh.s, _A)
    return _convert(m, z, sh.B * K * sh.sd, sh.s == sh.sd)


def _shard_forward(m: _Replay, sh: _Shape, n: int) -> List[Optional[int]]:
    """shard_math.shard_forward; returns the saved logit buffers (no chunk size)."""
    saved: List[Optional[int]] = []
    a_s = m.alloc(sh.B * sh.D * sh.s, _A)  # _scaled_embeddings: s·a
    prev_inv = prev_z = None
    for _, _, K in _chunks(n, sh.chunk or max(n, 1)):
        inv = _inverse_norms(m, sh, K)
        m.free(prev_inv)  # `inv = ...` rebinds
        z = _raw_products(m, sh, K)  # column-scaled, margin, exp: all in place
        m.free(prev_z)  # `z = ...` rebinds (chunked; unchunked there is one chunk)
        if sh.chunk:
            prev_z = z
        else:
            saved.append(z)  # stats.buffers
        prev_inv = inv
    m.free(prev_inv, prev_z, a_s)  # the locals go on return
    return saved


def _shard_backward(
    m: _Replay, sh: _Shape, n: int, saved: List[Optional[int]], kept: bool, grad_cat: str
) -> Tuple[Optional[int], Optional[int]]:
    """shard_math.shard_backward; returns (grad_a, grad_w). ``kept``: ``grad_w_out`` is the
    weight's ``.grad`` (blocks added into it; grad_w None), else ``grad_w = empty_like(w)`` of
    category ``grad_cat``."""
    B, D, s, sd = sh.B, sh.D, sh.s, sh.sd
    a_s = m.alloc(B * D * s, _A)
    grad_a = m.alloc(B * D * sd, _C)  # zeros
    grad_w = None if kept else m.alloc(n * D * s, grad_cat, touched=False)  # empty_like(w)
    step = sh.chunk or max(n, 1)
    prev_inv = prev_view = prev_h = prev_dot = None  # locals that outlive an iteration
    for k, start, K in _chunks(n, step):
        inv = _inverse_norms(m, sh, K)
        m.free(prev_inv)
        z = _raw_products(m, sh, K) if sh.chunk else saved[k]  # then scaled in place
        g = z if s == sd else m.alloc(B * K * s, _A)  # z.to(compute dtype)
        ga = m.alloc(B * D * s, _A)  # grad_a.add_((g @ w_c).to(sd)): a temporary
        m.free(_convert(m, ga, B * D * sd, s == sd))
        for j, b0, bk in _chunks(K, WGRAD_BLOCK):
            if j == 0:  # g_t = g[:, b0:b1].t(): the previous chunk's g lived on in g_t until here
                m.free(prev_view)
                prev_view = g
            if kept:  # h = (g_t @ a_s).to(w.dtype), then rows.add_(h)
                h = m.alloc(bk * D * s, _A)
                m.free(prev_h)
                prev_h = h
            else:  # torch.mm(g_t, a_s, out=rows): straight into grad_w's rows
                m.touch(grad_w, (start + b0 + bk) * D * s)
            if sh.norm_w:  # the projection's [bk] temporaries
                dot = _convert(m, m.alloc(bk * s, _A), bk * sd, s == sd)  # bmm(h, wb).view(-1).to(sd)
                m.free(prev_dot)
                prev_dot = dot
                sq = m.alloc(bk * sd, _A)  # inv[b0:b1].square()
                prod = m.alloc(bk * sd, _A)
                m.free(sq)
                m.free(_convert(m, prod, bk * s, s == sd))  # .to(h.dtype), gone after addcmul_
        if g != z:
            m.free(z)  # `del z` (chunked) / stats.buffers.clear() (unchunked: one chunk)
        prev_inv = inv
    out = grad_a if s == sd else m.alloc(B * D * s, _C)  # return grad_a.to(a.dtype), ...
    # then the locals go: the last g (unchunked full precision: the logits themselves) with g_t
    m.free(prev_inv, prev_h, prev_dot, a_s, prev_view)
    if out != grad_a:
        m.free(grad_a)
    return out, grad_w


def _l2_forward(m: _Replay, b: int, D: int, s: int) -> Tuple[List[Optional[int]], Optional[int]]:
    """normalize.l2_normalize forward: (saved buffers, output)."""
    xf = m.alloc(b * D * 4, _A) if s < 4 else None  # x.float()
    sf = max(s, 4)
    y, norm = _normalized_rows(m, b, D, sf)
    out = m.alloc(b * D * s, _A) if s < 4 else y  # y.to(x.dtype)
    m.free(xf)
    return [y, norm], out


def _l2_backward(m: _Replay, b: int, D: int, s: int) -> Optional[int]:
    """normalize._L2Normalize.backward: a copy of the gradient, projected in place."""
    sf = max(s, 4)
    out = m.alloc(b * D * sf, _A)  # grad.to(y.dtype, copy=True)
    _normalized_rows_backward_(m, b, sf)
    return _convert(m, out, b * D * s, s >= 4)  # .to(ctx.in_dtype)


def _replay_step(
    C: int, D: int, B: int, W: int, s: int, sd: int, optimizer: str, sample_rate: float, chunk: Optional[int],
    norm_w: bool, norm_x: bool, weight_decay: float, grads_kept: bool,
) -> Tuple[_Replay, Dict[str, int]]:
    n = math.ceil(C / W)  # rank 0 holds the largest shard
    b = math.ceil(B / W)
    partial = sample_rate < 1.0
    ns = min(n, max(math.ceil(sample_rate * n), min(B, n))) if partial else n  # worst case: B distinct positives
    sh = _Shape(B, D, s, sd, chunk, norm_w)
    m = _Replay()
    # --- forward: head.forward
    t = m.alloc(b * D, _A)  # check_embeddings: isfinite(embeddings)
    m.free(t)
    l2_saved, x = _l2_forward(m, b, D, s) if norm_x else ([], None)
    x_out = x if x is not None and x not in l2_saved else None  # low precision: y.to(dtype), head.forward's x
    gathered = labels = None
    if W > 1:  # all_gather_rows of [b, D] (rank 0 has the widest slice: no padding)
        gathered = m.alloc(W * b * D * s, _C)
        if B % W:  # torch.cat of the unpadded parts
            cat = m.alloc(B * D * s, _C)
            m.free(gathered)
            gathered = cat
        labels = m.alloc(W * b * 8, _C)  # all_labels
    sub_w = rows = None
    if partial:  # head._sample_classes / partial_fc.sample_rows / take_rows
        score = m.alloc(n * 4, _A)  # torch.rand(n)
        top_v = m.alloc(ns * 4, _A)  # score.topk(keep).indices
        top_i = m.alloc(ns * 8, _A)
        m.free(top_v)
        rows = m.alloc(ns * 8, _A)  # .sort().values: the marked rows, until the optimizer step
        sort_i = m.alloc(ns * 8, _A)
        m.free(sort_i, top_i, score)
        lut = m.alloc(n * 8, _A)  # torch.full((n,), -1)
        t = m.alloc(ns * 8, _A)  # lut[rows] = arange(ns)
        m.free(t)
        sub_w = m.alloc(ns * D * s, _A)  # take_rows: w[rows]
        m.free(lut)
    saved = _shard_forward(m, sh, ns)
    m.free(labels)  # head.forward returns: its locals go (the loss keeps the gathered embeddings)
    if W > 1:
        m.free(x_out)
        x_out = None
    # --- backward: the loss's backward, then (partial) take_rows', the gather's, the normalisation's
    # The sampled sub-weight is no leaf: its gradient is always a fresh buffer, added into w after.
    accumulate = grads_kept and not partial
    grad_cat = _A if (partial and grads_kept) else _G
    grad_a, grad_sub = _shard_backward(m, sh, ns, saved, accumulate, grad_cat)
    m.free(gathered, sub_w, x_out)  # the loss function's saved tensors are released
    if partial:  # _TakeRows.backward: w.grad.index_add_ in place, or zeros_like(w).index_add_
        grad_w = None if grads_kept else m.alloc(n * D * s, _G)
        m.free(grad_sub)
    else:
        grad_w = grad_sub  # AccumulateGrad takes it as .grad (None: already added into .grad)
    if W > 1:  # reduce_scatter_rows, times the world size
        rs = m.alloc(b * D * s, _C)
        grad_x = m.alloc(b * D * s, _C)
        m.free(rs, grad_a)
    else:
        grad_x = grad_a
    if norm_x:
        gx = _l2_backward(m, b, D, s)
        m.free(grad_x, *l2_saved)
        grad_x = gx
    # --- optimizer step
    if partial:
        if optimizer == "adamw":
            _row_sparse_adamw(m, ns, D, s)
        else:
            _row_sparse_sgd(m, ns, D, s, momentum=optimizer == "sgd", weight_decay=weight_decay)
        m.free(rows)
    elif optimizer == "adamw":  # torch.optim.AdamW (single-tensor): (exp_avg_sq.sqrt() / bc).add_(eps)
        t1 = m.alloc(n * D * s, _A)
        t2 = m.alloc(n * D * s, _A)
        m.free(t1, t2)
    elif weight_decay:  # torch.optim.SGD (single-tensor): grad.add(param, alpha=weight_decay)
        t1 = m.alloc(n * D * s, _A)
        m.free(t1)
    # zero_grad: set_to_none frees the gradient (kept: zero_() in place); the input's goes with it
    m.free(grad_w, grad_x)
    info = {"n_local": n, "n_sampled": ns, "local_batch": b}
    return m, info


def _row_sparse_sgd(m: _Replay, ns: int, D: int, s: int, momentum: bool, weight_decay: float) -> None:
    size = ns * D * s
    g = m.alloc(size, _A)  # p.grad[idx]
    w = m.alloc(size, _A)  # p[idx]
    if weight_decay:
        t = m.alloc(size, _A)
        g2 = m.alloc(size, _A)
        m.free(t, g)
        g = g2
    if momentum:
        t = m.alloc(size, _A)  # buf[idx]
        t2 = m.alloc(size, _A)  # * mom
        m.free(t)
        bm = m.alloc(size, _A)  # + g
        m.free(t2, g)
        g = bm
    t3 = m.alloc(size, _A)  # lr * g
    t4 = m.alloc(size, _A)  # w - t3
    m.free(t3, t4, g, w)


def _row_sparse_adamw(m: _Replay, ns: int, D: int, s: int) -> None:
    size = ns * D * s
    g = m.alloc(size, _A)
    t = m.alloc(size, _A)
    w = m.alloc(size, _A)
    m.free(t)
    t = m.alloc(size, _A)
    mm = m.alloc(size, _A)
    m.free(t)
    t = m.alloc(size, _A)
    t2 = m.alloc(size, _A)
    m.free(t)
    v = m.alloc(size, _A)
    m.free(t2)
    a = m.alloc(size, _A)  # (lr / bias1) * m
    q = m.alloc(size, _A)  # v.sqrt()
    q2 = m.alloc(size, _A)  # / bias2_sqrt
    m.free(q)
    q3 = m.alloc(size, _A)  # + eps
    m.free(q2)
    e = m.alloc(size, _A)  # a / q3
    m.free(a, q3)
    w2 = m.alloc(size, _A)
    m.free(e, w, g, mm, v, w2)


# --------------------------------------------------------------------------- public API
def _check_pos_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _margin_flags(margin) -> Tuple[bool, bool, str]:
    from shardfc.head.margins import Margin, build_margin

    m = margin if isinstance(margin, Margin) else build_margin(margin)
    return m.normalize_weights, m.normalize_embeddings, type(m).__name__


def _dtype_name(dtype) -> str:
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).replace("torch.", "")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    return dtype


def _evaluate(C: int, D: int, B: int, W: int, dtype: str, optimizer: str, sample_rate: float, chunk: Optional[int],
              norm_w: bool, norm_x: bool, weight_decay: float, model: str, grads_kept: bool) -> Dict[str, Any]:
    s = DTYPE_BYTES[dtype]
    sd = 8 if dtype == "float64" else 4
    replay, info = _replay_step(C, D, B, W, s, sd, optimizer, sample_rate, chunk, norm_w, norm_x, weight_decay, grads_kept)
    n = info["n_local"]
    weights = n * D * s
    state = {"sgd": n * D * s, "sgd_nomomentum": 0, "adamw": 2 * n * D * s}[optimizer]
    if optimizer == "adamw" and sample_rate < 1.0:
        state += n * 8  # RowSparseAdamW's per-row step count
    parts = dict(replay.peak_parts[model]) or {p: 0 for p in PARTS}
    parts[_W], parts[_O] = weights, state
    resting = weights + state
    if grads_kept:  # the dense [n, D] .grad rests between steps (the replay then allocates no _G buffer)
        parts[_G] = n * D * s
        resting += parts[_G]
    step_peak = replay.peak[model]
    return {"parts": parts, "step_peak": step_peak, "resting": resting, "total": resting + step_peak, **info}


def plan(
    num_classes: int,
    dim: int,
    batch: int,
    world_size: int = 1,
    dtype: Union[str, torch.dtype] = "float32",
    optimizer: str = "sgd",
    sample_rate: float = 1.0,
    chunk_size: Optional[int] = None,
    budget_bytes: Optional[Union[int, str]] = None,
    *,
    margin="arcface",
    weight_decay: float = 0.0,
    memory_model: str = "allocated",
    chunk_budget_bytes: int = 64 * 2**20,
    grad_in_place: bool = True,
) -> Dict[str, Any]:
    """Per-rank memory of one head training step, and (with a budget) the largest C and B that fit.

    Args:
        num_classes, dim: ``C`` and ``D`` of the head.
        batch: the GLOBAL batch ``B`` (every rank scores all of it against its classes).
        world_size: ranks ``W`` (1: a single process, no collectives).
        dtype: of the weights and embeddings (``float32``, ``bfloat16``, ``float16``, ``float64``).
        optimizer: ``"sgd"`` (momentum), ``"sgd_nomomentum"`` or ``"adamw"`` (row-sparse under Partial FC).
        sample_rate: Partial FC rate in ``(0, 1]`` (1: every class every step).
        chunk_size: classes per chunk (``None``: one ``[B, n_local]`` buffer; ``"auto"``: as the
            head picks it, ``chunk_budget_bytes // (8·B)``).
        budget_bytes: bytes per rank (an int, or a string like ``"16GiB"``); ``None``: no search.
        margin: a margin name or instance (only whether it normalises weights/embeddings matters).
        weight_decay: > 0 adds the dense SGD's ``[n, D]`` weight-decay temporary.
        memory_model: ``"allocated"`` or ``"resident"`` (see the module docstring).
        chunk_budget_bytes: the head's budget for ``chunk_size="auto"`` (default 64 MiB).
        grad_in_place: ``True`` (default): the weight gradient is kept between steps
            (``optimizer.zero_grad(set_to_none=False)``) and the head adds into it in place
            (its default ``weight_grad_in_place=True``): the gradient is resting, the step holds
            only ``[WGRAD_BLOCK, D]`` blocks of it. ``False``: ``zero_grad(set_to_none=True)``:
            the step allocates the ``[n, D]`` gradient (see the module docstring).

    Returns a dict with ``parts`` (bytes per part at the peak: weights, gradients,
    optimizer_state, activations, communication), ``total`` (their sum), ``step_peak`` (what the
    step needs above the resting state), ``resting`` (weights + optimizer state, + gradients when
    kept), ``n_local``, ``n_sampled``, ``local_batch``, the inputs (``grad_in_place`` among them),
    and with a budget ``budget_bytes``, ``fits``, ``max_classes``, ``max_batch`` (0 when not even
    ``B = 1`` fits).

    Raises ValueError naming the argument for bad arguments, and when the budget does not hold
    even one class.
    """
    _check_pos_int("num_classes", num_classes)
    _check_pos_int("dim", dim)
    _check_pos_int("batch", batch)
    _check_pos_int("world_size", world_size)
    dtype = _dtype_name(dtype)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) or not (0 < sample_rate <= 1):
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
    if chunk_size == "auto":  # head.ShardedMarginHead._chunk_for
        _check_pos_int("chunk_budget_bytes", chunk_budget_bytes)
        chunk_size = max(1, chunk_budget_bytes // (8 * batch))
    elif chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(f"chunk_size must be a positive integer, 'auto' or None, got {chunk_size!r}")
    if memory_model not in MEMORY_MODELS:
        raise ValueError(f"memory_model must be one of {', '.join(MEMORY_MODELS)}, got {memory_model!r}")
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or weight_decay < 0:
        raise ValueError(f"weight_decay must be a number >= 0, got {weight_decay!r}")
    if not isinstance(grad_in_place, bool):
        raise ValueError(f"grad_in_place must be True or False, got {grad_in_place!r}")
    budget = None if budget_bytes is None else parse_bytes(budget_bytes)
    norm_w, norm_x, margin_name = _margin_flags(margin)

    def evaluate(C: int, B: int) -> Dict[str, Any]:
        return _evaluate(C, dim, B, world_size, dtype, optimizer, float(sample_rate), chunk_size, norm_w, norm_x,
                         weight_decay, memory_model, grad_in_place)

    result = evaluate(num_classes, batch)
    result.update(
        num_classes=num_classes, dim=dim, batch=batch, world_size=world_size, dtype=dtype, optimizer=optimizer,
        sample_rate=float(sample_rate), chunk_size=chunk_size, margin=margin_name, weight_decay=weight_decay,
        memory_model=memory_model, grad_in_place=grad_in_place,
    )
    if budget is not None:
        if evaluate(1, batch)["total"] > budget:
            raise ValueError(
                f"budget_bytes={budget} ({format_bytes(budget)}) is too small for even one class at "
                f"batch={batch}, dim={dim}, world_size={world_size}: that alone needs "
                f"{format_bytes(evaluate(1, batch)['total'])} per rank"
            )
        max_c = _largest(lambda c: evaluate(c, batch)["total"] <= budget, 1)
        fits_b1 = evaluate(num_classes, 1)["total"] <= budget
        max_b = _largest(lambda bb: evaluate(num_classes, bb)["total"] <= budget, 1) if fits_b1 else 0
        result.update(budget_bytes=budget, fits=result["total"] <= budget, max_classes=max_c, max_batch=max_b)
    return result


def _largest(fits, low: int, cap: int = 1 << 50) -> int:
    """Largest integer ``x >= low`` with ``fits(x)`` (``fits(low)`` is true, ``fits`` monotone)."""
    high = low * 2
    while high <= cap and fits(high):
        low, high = high, high * 2
    if high > cap:
        return low
    while high - low > 1:  # fits(low), not fits(high)
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return low


_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}


def parse_bytes(value: Union[int, float, str]) -> int:
    """``16GiB``, ``16G`` (binary), ``16GB`` (decimal), ``1.5e9``, ``123`` -> bytes (positive)."""
    if isinstance(value, bool):
        raise ValueError(f"budget must be a byte count such as 16GiB, got {value!r}")
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"budget must be a byte count such as 16GiB, 500MB or 1e9, got {value!r}")
        number = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not math.isfinite(number) or number < 1:
        raise ValueError(f"budget must be at least 1 byte, got {value!r}")
    return int(number)


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{int(n)} B"


def format_plan(result: Dict[str, Any]) -> str:
    """A readable table of :func:`plan`'s result."""
    r = result
    chunk = r["chunk_size"] if r["chunk_size"] else "none"
    lines = [
        f"head: C={r['num_classes']:,} D={r['dim']} global B={r['batch']} on W={r['world_size']} "
        f"({r['dtype']}, {r['margin']}, optimizer {r['optimizer']}, chunk {chunk}, sample rate {r['sample_rate']})",
        f"rank 0: {r['n_local']:,} classes"
        + (f" ({r['n_sampled']:,} sampled per step)" if r["n_sampled"] != r["n_local"] else "")
        + f", {r['local_batch']} local rows; memory model: {r['memory_model']}",
        "gradients kept between steps (zero_grad(set_to_none=False)), added into in place"
        if r["grad_in_place"]
        else "gradients freed between steps (zero_grad(set_to_none=True)): the step allocates them",
        "",
        "| part (per rank) | bytes | |",
        "|---|---:|---:|",
    ]
    labels = {
        "weights": "weights",
        "gradients": "gradients",
        "optimizer_state": "optimizer state",
        "activations": "logits / activations",
        "communication": "communication buffers",
    }
    for part in PARTS:
        lines.append(f"| {labels[part]} | {r['parts'][part]:,} | {format_bytes(r['parts'][part])} |")
    lines.append(f"| **total** | **{r['total']:,}** | **{format_bytes(r['total'])}** |")
    lines.append("")
    resting = "weights + gradients + optimizer state" if r["grad_in_place"] else "weights + optimizer state"
    lines.append(f"resting ({resting}): {format_bytes(r['resting'])}; "
                 f"step peak above it: {format_bytes(r['step_peak'])}")
    if "budget_bytes" in r:
        lines.append(f"budget {format_bytes(r['budget_bytes'])} per rank: {'fits' if r['fits'] else 'DOES NOT FIT'}")
        lines.append(f"largest C at B={r['batch']}: {r['max_classes']:,}")
        lines.append(
            f"largest global B at C={r['num_classes']:,}: "
            + (f"{r['max_batch']:,}" if r["max_batch"] else "none (weights and optimizer state alone exceed the budget)")
        )
    return "\n".join(lines)


def _chunk_arg(text: str):
    return "auto" if text == "auto" else int(text)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="shardfc plan", description="Per-rank memory of the sharded head, and the largest C and B that fit a budget.")
    p.add_argument("--classes", type=int, required=True, help="number of classes C")
    p.add_argument("--dim", type=int, required=True, help="embedding width D")
    p.add_argument("--batch", type=int, required=True, help="GLOBAL batch B")
    p.add_argument("--world-size", type=int, default=1, help="ranks W (default 1)")
    p.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default="float32")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd")
    p.add_argument("--sample-rate", type=float, default=1.0, help="Partial FC rate in (0, 1] (default 1)")
    p.add_argument("--chunk-size", type=_chunk_arg, default=None, help="classes per chunk, or 'auto' (default: none)")
    p.add_argument("--budget", default=None, help="bytes per rank, e.g. 16GiB, 500MB, 1e9")
    p.add_argument("--margin", default="arcface", help="margin name (default arcface)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--memory-model", choices=MEMORY_MODELS, default="allocated",
                   help="allocated (CUDA allocator, default) or resident (CPU resident set, what shardfc bench measures on CPU)")
    p.add_argument("--grads-kept", dest="grad_in_place", action=argparse.BooleanOptionalAction, default=True,
                   help="--grads-kept (default): the head's gradient stays allocated between steps "
                        "(zero_grad(set_to_none=False)) and the step adds into it in place; --no-grads-kept: "
                        "zero_grad(set_to_none=True), the step allocates the [n, D] gradient")
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        result = plan(
            args.classes, args.dim, args.batch, args.world_size, args.dtype, args.optimizer, args.sample_rate,
            args.chunk_size, args.budget, margin=args.margin, weight_decay=args.weight_decay,
            memory_model=args.memory_model, grad_in_place=args.grad_in_place,
        )
    except ValueError as e:
        print(f"shardfc plan: error: {e}", file=sys.stderr)
        return 2
    print(format_plan(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0


__all__ = ["plan", "parse_bytes", "format_bytes", "format_plan", "main", "PARTS", "OPTIMIZERS"]
