"""``shardfc plan``: per-rank memory of a :class:`~shardfc.ShardedMarginHead` step, and what fits a budget.

The plan is not a model of the head: it runs the head. :mod:`.replay` builds the real head and its
real optimizer (:func:`~shardfc.head.partial_fc.head_optimizer`) on the ``meta`` device (shapes, no
data: any ``C`` is free), as rank 0 of a fake ``W``-rank process group (the largest shard,
``⌈C/W⌉`` classes, and the real collectives with their buffers), and runs the training step that
``shardfc bench`` runs, forward + backward + optimizer step + ``zero_grad``, under the dispatch mode
the bench measures CPU memory with. Every tensor storage the step creates counts from its creation
to its release; the largest total is ``step_peak``. Where a shape depends on values the replay
takes the worst case for Partial FC: every label of the global batch a distinct class of rank 0's
shard (see :mod:`.replay`). Every rank is assumed to hold rank 0's ``⌈B/W⌉`` rows.

The package is two files by concept: :mod:`.replay` runs a step on the meta device; this one is
what a user calls — :func:`plan` (arguments checked, replays memoised, the budget searches over
``C`` and ``B``) and its table, which share one result dict; the command line is :mod:`shardfc.cli.plan`.

Parts (per rank, bytes): ``weights``, ``optimizer_state`` and, when kept, ``gradients`` are the
state the step rests on (``resting``); at the step's peak, ``gradients`` (when not kept: the
storages that become a ``.grad``), ``communication`` (storages a collective reads or writes) and
``activations`` (all the others, including tensors Partial FC keeps on the host). ``total =
resting + step_peak``; ``bytes_per_class = resting / n_local``. Gradients kept (``grad_in_place=True``, the default, CLI ``--grads-kept``)
means ``zero_grad(set_to_none=False)``, as ``shardfc bench`` does; ``False`` means
``set_to_none=True``: the step then allocates the ``[n, D]`` gradient. With ``sparse_grad`` (Partial
FC) no ``.grad`` exists at all: the step's compact gradient of the sampled rows is its ``gradients``.

Counted: what the step's operators return. Not counted: an operator's internal scratch, the CUDA
caching allocator's rounding and reserve. One memory model, ``"allocated"`` (the former
``"resident"`` model is gone: the bench now counts live tensors on the CPU too). A replay costs
about 15 µs per operator, some 1.5 ms per chunk of a chunked head: a budget search that reaches
millions of chunks' worth of classes takes tens of seconds.

The head's implementation: ``impl="torch"`` (default) replays the torch path, the one that runs on
the CPU; ``impl="triton"`` and ``impl="gemm"`` replay the GPU implementations' step
(:mod:`shardfc.head.fused`, what ``impl="auto"`` chooses between on a CUDA GPU with Triton
installed): their launchers allocate on the meta device what they would on the GPU (the GEMM
path's chunk of products, its operand rows and fp32 GEMM outputs) and launch nothing, and the
optimizer is the one a CUDA run builds (:func:`.replay.fused_as_on_cuda`): torch's ``fused=True``
SGD/AdamW for fp32 centres without sampling (updates in place, no temporaries), the row-sparse
SGD's fused kernel (Partial FC, bf16/fp16 centres); the row-sparse AdamW, which has no fused
kernel of its own, as it runs. With ``fused_update`` the step is the backward's (SGD's or AdamW's
update kernel) and ``step()`` has nothing left to do for the head. The forwards' partial statistics (``[B, splits]`` fp32) follow the SM count
``sms`` (default 132, an H100 SXM). The torch path keeps torch's unfused optimizers, as it runs off
CUDA (with weight decay or AdamW, temporaries of a gradient's size).

Usage::

    shardfc plan --classes 1000000 --dim 512 --batch 1024 --world-size 8 --budget 16GiB
    shardfc plan ... --no-grads-kept      # the training loop calls zero_grad(set_to_none=True)
    shardfc plan ... --head-impl triton   # the GPU path (fused forward, GEMM backward), as on a CUDA GPU
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from typing import Any, Callable, Dict, Optional, Union

import torch

from shardfc.checks import check_positive_int
from shardfc.head.validation import check_head_options
from shardfc.tools.plan.units import format_bytes, parse_bytes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
OPTIMIZERS = ("sgd", "sgd_nomomentum", "adamw")
MEMORY_MODELS = ("allocated",)
#: the implementations a plan replays (``"auto"`` is one of these, depending on the device)
PLAN_IMPLS = ("torch", "triton", "gemm")
PARTS = ("weights", "gradients", "optimizer_state", "activations", "communication")


# --------------------------------------------------------------------------- checks
def _dtype_name(dtype) -> str:
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).replace("torch.", "")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return dtype


def _margin(margin):
    from shardfc.head.margins import Margin, build_margin

    return margin if isinstance(margin, Margin) else build_margin(margin)


# --------------------------------------------------------------------------- public API
def plan(
    num_classes: int,
    dim: int,
    batch: int,
    world_size: int = 1,
    dtype: Union[str, torch.dtype] = "float32",
    optimizer: str = "sgd",
    sample_rate: float = 1.0,
    chunk_size: Union[int, str, None] = None,
    budget_bytes: Optional[Union[int, str]] = None,
    *,
    margin="arcface",
    weight_decay: float = 0.0,
    memory_model: str = "allocated",
    chunk_budget_bytes: int = 64 * 2**20,
    grad_in_place: bool = True,
    sparse_grad: bool = False,
    subcenters: int = 1,
    impl: str = "torch",
    sms: int = 132,
    fused_update: bool = False,
    compute_dtype: Optional[str] = None,
    traffic: bool = False,
    l2_bytes: Union[int, str] = 50 * 2**20,
    gpu_chunk_scale: Optional[int] = None,
) -> Dict[str, Any]:
    """Per-rank memory of one head training step, and (with a budget) the largest C and B that fit.

    Args:
        num_classes, dim: ``C`` and ``D`` of the head.
        batch: the GLOBAL batch ``B`` (every rank scores all of it against its classes).
        world_size: ranks ``W`` (1: a single process, no collectives).
        dtype: of the weights, their optimizer state and the embeddings (``float32``, ``bfloat16``,
            ``float16``, ``float64``).
        optimizer: ``"sgd"`` (momentum 0.9), ``"sgd_nomomentum"`` or ``"adamw"``, as
            :func:`~shardfc.head.partial_fc.head_optimizer` builds them (row-sparse under Partial FC).
        sample_rate: Partial FC rate in ``(0, 1]`` (1: every class every step).
        chunk_size: the head's ``chunk_size`` (``None``, an int or ``"auto"``).
        budget_bytes: bytes per rank (an int, or a string like ``"16GiB"``); ``None``: no search.
        margin: a margin name or instance.
        weight_decay: the optimizer's.
        memory_model: ``"allocated"`` (the only one; see the module docstring).
        chunk_budget_bytes: the head's budget for ``chunk_size="auto"`` (default 64 MiB).
        grad_in_place: ``True`` (default): gradients kept between steps
            (``optimizer.zero_grad(set_to_none=False)``), the head adds into them in place.
            ``False``: ``zero_grad(set_to_none=True)``: the step allocates them.
        sparse_grad: Partial FC's row-sparse weight gradient (needs ``sample_rate < 1``).
        subcenters: Sub-center ArcFace's ``K`` centres per class (``K`` weight rows each; Partial FC
            samples whole classes). ``n_local``, ``n_sampled`` and ``bytes_per_class`` count classes.
        impl: the head's implementation, ``"torch"``, ``"triton"`` or ``"gemm"`` (the GPU paths
            ``impl="auto"`` chooses between on a CUDA GPU; need Triton installed; ``chunk_size`` is
            then ignored, as the head ignores it).
        sms: the GPU's streaming multiprocessors, for the GPU paths (see the module docstring).
        fused_update: :func:`~shardfc.head.partial_fc.head_optimizer`'s (SGD or AdamW: the step applied
            in the backward, no ``.grad``; the GPU paths only).
        compute_dtype: the matmuls' dtype, as autocast sets it (``"bfloat16"`` with ``float32``
            weights: the trainer's ``--amp``); None: ``dtype``.
        traffic: also count the step's HBM bytes kernel by kernel (:mod:`.traffic`): the result's
            ``traffic``. The GPU paths' chunks and the count's L2 model use ``l2_bytes``.
        l2_bytes: the GPU's L2 (default 50 MiB, an H100's), an int or a string like ``"50MiB"``.
        gpu_chunk_scale: the GPU paths' chunk scale (the head's ``gpu_chunk_scale``; None: its
            default). With ``traffic``, the result's ``chunk_candidates`` has one row per scale of
            :data:`~shardfc.head.fused.CHUNK_SCALES`: launches, HBM bytes, GPU time and host issue
            time on paper, the step's peak, and which one the paper picks
            (:func:`~shardfc.tools.plan.traffic.chunk_candidates`).

    Returns a dict with ``parts`` (bytes per part, see the module docstring), ``step_peak``,
    ``resting``, ``total``, ``bytes_per_class`` (resting bytes over ``n_local``), ``n_local``, ``n_sampled``, ``local_batch``, the inputs, and with a
    budget ``budget_bytes``, ``fits``, ``max_classes``, ``max_batch`` (0 when not even ``B = 1``
    fits).

    Raises ValueError naming the argument for bad arguments, and when the budget does not hold
    even one class. In a process where torch.distributed is initialised the replay runs in a
    spawned process (it needs a fake process group of its own).
    """
    check_positive_int("num_classes", num_classes)
    check_positive_int("dim", dim)
    check_positive_int("batch", batch)
    check_positive_int("world_size", world_size)
    check_positive_int("sms", sms)
    if impl not in PLAN_IMPLS:
        raise ValueError(f"impl must be one of {', '.join(PLAN_IMPLS)}, got {impl!r}")
    if impl != "torch" and importlib.util.find_spec("triton") is None:
        raise ValueError(f"impl={impl!r} replays the GPU kernels' step, which needs Triton installed "
                         "(pip install 'shardfc[gpu]')")
    dtype = _dtype_name(dtype)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    try:  # the head's own checks; the plan raises ValueError for every bad argument
        check_head_options(sample_rate=sample_rate, sparse_grad=sparse_grad, subcenters=subcenters)
    except TypeError as e:
        raise ValueError(str(e)) from None
    if chunk_size == "auto":
        check_positive_int("chunk_budget_bytes", chunk_budget_bytes)
    elif chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(f"chunk_size must be a positive integer, 'auto' or None, got {chunk_size!r}")
    if memory_model not in MEMORY_MODELS:
        raise ValueError(f"memory_model must be 'allocated' (the 'resident' model was removed: shardfc bench "
                         f"now counts live tensors on the CPU too), got {memory_model!r}")
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or weight_decay < 0:
        raise ValueError(f"weight_decay must be a number >= 0, got {weight_decay!r}")
    if not isinstance(grad_in_place, bool):
        raise ValueError(f"grad_in_place must be True or False, got {grad_in_place!r}")
    budget = None if budget_bytes is None else parse_bytes(budget_bytes)
    if not isinstance(fused_update, bool):
        raise ValueError(f"fused_update must be True or False, got {fused_update!r}")
    if fused_update and impl == "torch":
        raise ValueError(f"fused_update needs impl 'triton' or 'gemm' (the update the GPU backward applies), "
                         f"got impl={impl!r}")
    if compute_dtype is not None:
        compute_dtype = _dtype_name(compute_dtype)
    if not isinstance(traffic, bool):
        raise ValueError(f"traffic must be True or False, got {traffic!r}")
    l2 = parse_bytes(l2_bytes, "l2_bytes")
    margin = _margin(margin)
    if gpu_chunk_scale is not None:
        from shardfc.head.fused import check_chunk_scale

        if impl == "torch":
            raise ValueError("gpu_chunk_scale sizes the GPU paths' chunks: it needs impl 'triton' or 'gemm', got impl='torch'")
        check_chunk_scale(gpu_chunk_scale, "gpu_chunk_scale")

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return _in_fresh_process(
            plan, num_classes, dim, batch, world_size, dtype, optimizer, sample_rate, chunk_size, budget,
            margin=margin, weight_decay=weight_decay, chunk_budget_bytes=chunk_budget_bytes, grad_in_place=grad_in_place,
            sparse_grad=sparse_grad, subcenters=subcenters, impl=impl, sms=sms, fused_update=fused_update,
            compute_dtype=compute_dtype, traffic=traffic, l2_bytes=l2, gpu_chunk_scale=gpu_chunk_scale,
        )
    from shardfc.tools.plan.replay import fake_world

    head_options = dict(margin=margin, chunk_size=chunk_size, chunk_budget_bytes=chunk_budget_bytes,
                        sample_rate=float(sample_rate), impl=impl)
    if sparse_grad:
        head_options["sparse_grad"] = True
    if subcenters > 1:
        head_options["subcenters"] = subcenters
    if impl != "torch":
        head_options["gpu_chunk_scale"] = gpu_chunk_scale
    evaluator = functools.partial(_Evaluator, dim, world_size, DTYPES[dtype], optimizer, weight_decay, grad_in_place,
                                  fused_update=fused_update)
    with fake_world(world_size), _planned_device(impl, sms, l2, compute_dtype):
        evaluate = evaluator(head_options)
        result = dict(evaluate(num_classes, batch))
        if traffic:
            result["traffic"] = evaluate.traffic(num_classes, batch, l2)
            if impl != "torch":
                result["chunk_candidates"] = _chunk_candidates(evaluator, head_options, num_classes, batch, l2)
        result.update(
            num_classes=num_classes, dim=dim, batch=batch, world_size=world_size, dtype=dtype, optimizer=optimizer,
            sample_rate=float(sample_rate), chunk_size=chunk_size, margin=type(margin).__name__,
            weight_decay=weight_decay, memory_model=memory_model, grad_in_place=grad_in_place, sparse_grad=sparse_grad,
            subcenters=subcenters, impl=impl, sms=sms if impl != "torch" else None, fused_update=fused_update,
            compute_dtype=compute_dtype or dtype, l2_bytes=l2 if impl != "torch" or traffic else None,
            gpu_chunk_scale=_scale_run(impl, gpu_chunk_scale),
        )
        if budget is not None:
            one = evaluate(1, batch)["total"]
            if one > budget:
                raise ValueError(
                    f"budget_bytes={budget} ({format_bytes(budget)}) is too small for even one class at "
                    f"batch={batch}, dim={dim}, world_size={world_size}: that alone needs {format_bytes(one)} per rank"
                )
            max_c = _largest(lambda c: evaluate(c, batch)["total"], budget, 1)
            fits_b1 = evaluate(num_classes, 1)["total"] <= budget
            max_b = _largest(lambda b: evaluate(num_classes, b)["total"], budget, 1) if fits_b1 else 0
            result.update(budget_bytes=budget, fits=result["total"] <= budget, max_classes=max_c, max_batch=max_b)
    return result


def _scale_run(impl: str, gpu_chunk_scale: Optional[int]) -> Optional[int]:
    """The chunk scale the planned step runs at (None on the torch path)."""
    if impl == "torch":
        return None
    from shardfc.head.fused.chunks import check_chunk_scale

    return check_chunk_scale(gpu_chunk_scale)


def _chunk_candidates(evaluator, head_options: Dict[str, Any], num_classes: int, batch: int,
                      l2: int) -> Dict[str, Any]:
    """The step replayed at each chunk scale: :func:`~shardfc.tools.plan.traffic.chunk_candidates`
    of their traffic, with each one's step peak."""
    from shardfc.head.fused import CHUNK_SCALES
    from shardfc.tools.plan.traffic import chunk_candidates

    runs = {}
    for scale in CHUNK_SCALES:
        each = evaluator({**head_options, "gpu_chunk_scale": scale})
        runs[scale] = (each.traffic(num_classes, batch, l2), each(num_classes, batch)["step_peak"])
    return chunk_candidates(runs)


@contextlib.contextmanager
def _planned_device(impl: str, sms: int, l2: int, compute_dtype: Optional[str]):
    """The device the replay stands for, for the plan's duration: the GPU launchers' SM count and
    L2 (which sizes their chunks), or the CPU's fp32 matmuls for the torch path; and the compute
    dtype autocast would set (the meta device has no autocast)."""
    from unittest import mock

    from shardfc.head import function

    with contextlib.ExitStack() as stack:
        if compute_dtype is not None:
            stack.enter_context(mock.patch.object(function, "META_COMPUTE_DTYPE", DTYPES[compute_dtype]))
        if impl == "torch":  # the CPU's step: its fp32 matmuls of 16-bit operands copy them first
            from shardfc.head import kernels

            stack.enter_context(mock.patch.object(kernels, "MM_F32_META", "cpu"))
        else:
            from shardfc.head.fused import autotune, chunks

            stack.enter_context(mock.patch.object(autotune, "META_SMS", sms))
            stack.enter_context(mock.patch.object(chunks, "META_L2_BYTES", l2))
        yield


class _Evaluator:
    """``(C, B) -> parts and totals`` by one replay each, remembered."""

    def __init__(self, dim, world_size, dtype, optimizer, weight_decay, grad_in_place, head_options, fused_update=False):
        self.args = (dim, world_size, dtype, optimizer, weight_decay, grad_in_place)
        self.head_options = head_options
        self.fused_update = fused_update
        self.seen: Dict[tuple, Dict[str, Any]] = {}

    def traffic(self, num_classes: int, batch: int, l2: int) -> Dict[str, Any]:
        """The step's HBM bytes kernel by kernel (one more replay, counted: :mod:`.traffic`)."""
        from shardfc.tools.plan.replay import replay_step

        dim, world_size = self.args[:2]
        r = replay_step(num_classes, dim, batch, world_size, *self.args[2:], fused_update=self.fused_update,
                        traffic_l2=l2, **self.head_options)
        return r.traffic

    def __call__(self, num_classes: int, batch: int) -> Dict[str, Any]:
        key = (num_classes, batch)
        if key not in self.seen:
            self.seen[key] = self._evaluate(num_classes, batch)
        return self.seen[key]

    def _evaluate(self, num_classes: int, batch: int) -> Dict[str, Any]:
        from shardfc.head.partial_fc import num_sampled
        from shardfc.tools.plan.replay import replay_step

        dim, world_size, dtype, optimizer, weight_decay, kept = self.args
        r = replay_step(num_classes, dim, batch, world_size, dtype, optimizer, weight_decay, kept,
                        fused_update=self.fused_update, **self.head_options)
        sparse = self.head_options.get("sparse_grad", False)
        gradients = r.gradients if kept and not sparse else r.step_parts["gradients"]
        parts = dict(weights=r.weights, gradients=gradients, optimizer_state=r.optimizer_state,
                     activations=r.step_parts["activations"], communication=r.step_parts["communication"])
        resting = r.weights + r.optimizer_state + r.gradients
        rate = self.head_options["sample_rate"]
        n_sampled = r.n_local
        if rate < 1.0:  # the head's fixed count: max(⌈r·n⌉, the global batch), at most n (what the replay sampled)
            n_sampled = num_sampled(r.n_local, rate, r.local_batch * world_size)
        return dict(parts=parts, step_peak=r.step_peak, resting=resting, total=resting + r.step_peak,
                    bytes_per_class=resting / max(r.n_local, 1), n_local=r.n_local, n_sampled=n_sampled, local_batch=r.local_batch)


def _in_fresh_process(fn, *args, **kwargs):
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args, **kwargs).result()


def _largest(total: Callable[[int], int], budget: int, low: int, cap: int = 1 << 50) -> int:
    """Largest integer ``x >= low`` with ``total(x) <= budget`` (``total(low)`` fits, ``total``
    nondecreasing), in few evaluations of ``total`` (each is a replay, dearer for larger ``x``).

    ``total`` is close to affine by pieces, so the bracket grows by extrapolating the last two
    values (at most 8× at a time until two successive slopes agree within 1%), landing just past
    the answer; then each secant guess is evaluated with its neighbour on the other side of the
    budget, which settles an affine ``total`` at once (halving when that stops gaining)."""
    evaluations = 0

    def total_checked(x: int) -> int:
        nonlocal evaluations
        evaluations += 1
        if evaluations > 500:  # a bracket that halves at least every third try needs far fewer
            raise RuntimeError("shardfc plan: the budget search does not converge (is the memory monotone?)")
        return total(x)

    lo, t_lo = low, total_checked(low)
    prev: Optional[tuple] = None
    slope_before = None
    hi = t_hi = None
    while hi is None:
        x = 2 * lo
        if prev is not None and t_lo > prev[1]:
            slope = (t_lo - prev[1]) / (lo - prev[0])
            guess = lo + int((budget - t_lo) / slope)
            x = max(guess + guess // 1024 + 1, lo + 1)
            if slope_before is None or abs(slope - slope_before) > 0.01 * slope:
                x = min(x, 8 * lo)
            slope_before = slope
        if x > cap:
            return lo
        t = total_checked(x)
        if t > budget:
            hi, t_hi = x, t
        else:
            prev, (lo, t_lo) = (lo, t_lo), (x, t)
    slow = 0
    while hi - lo > 1:
        width = hi - lo
        x = (lo + hi) // 2 if slow >= 2 else lo + (budget - t_lo) * (hi - lo) // (t_hi - t_lo)
        x = min(max(x, lo + 1), hi - 1)
        for _ in range(2):  # the guess, then its neighbour on the side the guess leaves open
            t_x = total_checked(x)
            if t_x <= budget:
                lo, t_lo, x = x, t_x, x + 1
            else:
                hi, t_hi, x = x, t_x, x - 1
            if not lo < x < hi:
                break
        slow = slow + 1 if hi - lo > width // 2 else 0
    return lo


# --------------------------------------------------------------------------- output
def format_plan(result: Dict[str, Any]) -> str:
    """A readable table of :func:`plan`'s result."""
    r = result
    fused = r.get("impl", "torch") != "torch"
    chunk = (f"{r['gpu_chunk_scale']}x the L2-sized one" if r.get("gpu_chunk_scale") else "L2-sized") if fused \
        else r["chunk_size"] if r["chunk_size"] else "none"
    impl = f"{r['impl']}, {r['sms']} SMs" if fused else "torch"
    lines = [
        f"head: C={r['num_classes']:,} D={r['dim']} global B={r['batch']} on W={r['world_size']} "
        f"({r['dtype']}, {r['margin']}, impl {impl}, optimizer {r['optimizer']}, chunk {chunk}, sample rate {r['sample_rate']}"
        + (f", {r['subcenters']} sub-centres per class" if r.get("subcenters", 1) > 1 else "") + ")",
        f"rank 0: {r['n_local']:,} classes"
        + (f" ({r['n_sampled']:,} sampled per step)" if r["n_sampled"] != r["n_local"] else "")
        + f", {r['local_batch']} local rows; memory model: {r['memory_model']}",
        "row-sparse gradient: the sampled rows' only, made by the step, no .grad kept"
        if r.get("sparse_grad")
        else "gradients kept between steps (zero_grad(set_to_none=False)), added into in place"
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
    kept = r["grad_in_place"] and not r.get("sparse_grad")
    resting = "weights + gradients + optimizer state" if kept else "weights + optimizer state"
    lines.append(f"resting ({resting}): {format_bytes(r['resting'])}; "
                 f"step peak above it: {format_bytes(r['step_peak'])}")
    lines.append(f"bytes per class at rest: {r['bytes_per_class']:,.1f} ({r['bytes_per_class'] / r['dim']:.2f} x D)")
    if not fused:
        lines.append("(the torch path; on a CUDA GPU with Triton the head runs its GPU kernels: --head-impl triton or gemm plans those)")
    if "budget_bytes" in r:
        lines.append(f"budget {format_bytes(r['budget_bytes'])} per rank: {'fits' if r['fits'] else 'DOES NOT FIT'}")
        lines.append(f"largest C at B={r['batch']}: {r['max_classes']:,}")
        lines.append(
            f"largest global B at C={r['num_classes']:,}: "
            + (f"{r['max_batch']:,}" if r["max_batch"] else "none (weights and optimizer state alone exceed the budget)")
        )
    return "\n".join(lines)


__all__ = ["plan", "parse_bytes", "format_bytes", "format_plan", "PARTS", "OPTIMIZERS", "PLAN_IMPLS"]
