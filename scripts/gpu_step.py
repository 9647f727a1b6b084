"""The head's step on one GPU, looked at from six sides, in one process (``scripts/gpu_check.sh`` runs it):

* ``smoke`` (first: seconds): ``torch.mm`` / ``torch.addmm`` with ``out_dtype=torch.float32`` and bf16
  operands on the device — whether this torch build takes them — and which path
  :func:`shardfc.head.kernels.addmm_f32` then chose (:data:`~shardfc.head.kernels.OUT_DTYPE_WORKS`:
  the fallback to fp32 products is chosen once, on a RuntimeError);
* ``correctness``: each ``impl``'s loss and gradients (``x.grad``, ``weight.grad``) against the dense
  float64 reference (:func:`shardfc.reference_loss`), in fp32 and under bf16 autocast, with the CPU
  tests' tolerances (fp32: :data:`FP32_RTOL`; bf16: at most twice the torch path's error plus 2e-3);
* ``step``: the step as ``shardfc bench`` times it (zero_grad kept, forward, backward, SGD momentum)
  and as the trainer runs it (plus the head clipped at 5, in the update and by a pass), per impl,
  beside the three bf16 matmuls of the same shapes, and Partial FC r = 0.1 with bf16 centres and the
  row-sparse update; the SGD and AdamW steps fused into the backward (AdamW also after it), and the
  fused SGD step with the operand made by each forward instead of written by the last update;
  the fused SGD step at each chunk scale (:data:`shardfc.head.fused.CHUNK_SCALES`: the chunk-size
  sweep; ``plan`` gives each one's launches and bytes on paper) and replayed as one CUDA graph
  (:class:`shardfc.head.capture.CapturedHeadStep`); median of ``--steps`` after ``--warmup``,
  CUDA-synchronised, with the host's issue time (a clock around the enqueue, stopped before the
  synchronise) beside the GPU time, and peak memory above rest;
* ``graph``: the captured step replayed against the eager fused step over a schedule of learning
  rates — losses and weights to fp32 rounding — per GPU implementation (CUDA only);
* ``profile``: one step under ``torch.profiler`` (kernel count, the ten slowest kernels), under
  ``torch.cuda.set_sync_debug_mode("warn")`` (each host synchronisation, with the line that caused it)
  and under ``set_sync_debug_mode("error")`` (a sync raises: the step must pass, issue 31), that one
  also for a Partial FC head (r = 0.1, bf16 centres, ``sparse_grad``); skipped on a CPU;
* ``plan``: ``shardfc plan``'s predicted step peak beside the measured one, for the configurations
  the plan models (centres and compute in one dtype), and ``plan --bytes``' chunk candidates at the
  step's shapes (launches, HBM bytes, GPU and host-issue time on paper per chunk scale).
* ``step2`` (last): the headline rows of ``step`` again at a second C (``--second-classes``, 250k).

    python scripts/gpu_step.py --parts smoke,correctness,step,graph,profile,plan,step2 --classes 1000000 --json out.json

``--device cpu`` with tiny sizes checks the script itself (the fused impls run under
``TRITON_INTERPRET=1`` when it is set; otherwise their rows say why they cannot run). Exit 1 if a
correctness row fails, a step synchronised the host under ``set_sync_debug_mode("error")`` or any
part raised, else 0. A JSON of everything with ``--json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import traceback
import warnings
from typing import Any, Callable, Dict, List, Optional

import torch

import shardfc
from shardfc.head.fused import CHUNK_SCALES
from shardfc.head.margins import build_margin
from shardfc.parallel.context import DistContext

IMPLS = ("torch", "triton", "gemm")
FP32_RTOL = 1e-4
GRAD_CLIP = 5.0  # the head clip the rows time (--head-grad-clip 5, the former default)
LR, MOMENTUM, WEIGHT_DECAY = 0.1, 0.9, 5e-4
#: chunks.CHUNK_L2_SHARE that gives the former chunks (32 MiB of bf16 products at B = 1024, D = 512:
#: 16,384 classes, whose working set with the operand rows and H is 1.6x an H100's L2)
FORMER_L2_SHARE = 1.6


def log(msg: str) -> None:
    print(f"[gpu_step] {msg}", file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.detach().double(), ref.detach().double()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-300))


def autocast(device: torch.device, dtype: str):
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, dtype))


def make_head(dim: int, classes: int, device: torch.device, impl: str, weight0: Optional[torch.Tensor] = None,
              dtype=torch.float32, **options):
    """A one-shard head on ``device`` whose rows are ``weight0`` (skips the N(0, 0.01²) draw)."""
    from shardfc.tools.bench.peers import centres_from

    ctx = DistContext(device=device)
    if weight0 is None:
        g = torch.Generator(device=device).manual_seed(0)
        weight0 = torch.randn(classes, dim, generator=g, device=device).mul_(0.01)
    with centres_from(weight0):
        head = shardfc.ShardedMarginHead(dim, classes, margin=build_margin("arcface"), context=ctx, dtype=dtype,
                                         impl=impl, **options)
    with torch.no_grad():
        head.weight.copy_(weight0.to(head.weight.dtype))
    return head, ctx


def inputs(batch: int, dim: int, classes: int, device: torch.device, count: int, dtype=torch.float32, seed: int = 1):
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(count):
        x = torch.randn(batch, dim, generator=g, device=device).to(dtype).requires_grad_(True)
        y = torch.randint(0, classes, (batch,), generator=g, device=device)
        out.append((x, y))
    return out


def cannot_run(e: Exception, impl: str) -> Optional[str]:
    text = str(e)
    return text if f"impl={impl!r} cannot run" in text else None


def row_error(row: Dict[str, Any], e: Exception, impl: str) -> None:
    """A row's own error: "unavailable" where the head says ``impl`` cannot run here, else "FAILED"
    with the traceback."""
    why = cannot_run(e, impl) if isinstance(e, ValueError) else None
    if isinstance(e, RuntimeError) and str(e).startswith("cannot capture the head's step"):
        why = str(e)  # a CUDA graph where the head cannot have one (no CUDA here): the head's reason
    if why is not None:
        row.update(status="unavailable", reason=why)
    else:
        row.update(status="FAILED", reason=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())


# --------------------------------------------------------------------------- correctness
def correctness(args, device: torch.device) -> Dict[str, Any]:
    C, B, D = args.check_classes, args.batch, args.dim
    g = torch.Generator(device=device).manual_seed(7)
    weight0 = torch.randn(C, D, generator=g, device=device).mul_(0.01)
    x0 = torch.randn(B, D, generator=g, device=device)
    y = torch.randint(0, C, (B,), generator=g, device=device)
    margin = build_margin("arcface")
    x64 = x0.double().requires_grad_(True)
    w64 = weight0.double().requires_grad_(True)
    ref = shardfc.reference_loss(x64, w64, y, margin)
    ref.backward()
    ref_loss, ref_gx, ref_gw = float(ref.detach()), x64.grad, w64.grad
    del x64, w64
    rows: List[Dict[str, Any]] = []
    for dtype in ("float32", "bfloat16"):
        torch_err = None
        for impl in IMPLS:
            row: Dict[str, Any] = dict(classes=C, batch=B, dim=D, dtype=dtype, impl=impl)
            try:
                head, _ = make_head(D, C, device, impl, weight0)
                x = x0.clone().requires_grad_(True)
                with autocast(device, dtype):
                    loss = head(x, y)
                loss.backward()
                sync(device)
                loss = loss.detach()
                err = max(abs(float(loss) - ref_loss) / abs(ref_loss), rel(x.grad, ref_gx), rel(head.weight.grad, ref_gw))
                row.update(loss=float(loss), reference_loss=ref_loss, loss_rel_err=abs(float(loss) - ref_loss) / abs(ref_loss),
                           x_grad_rel_err=rel(x.grad, ref_gx), weight_grad_rel_err=rel(head.weight.grad, ref_gw),
                           ran=head.last_impl)
                if dtype == "float32":
                    tol = FP32_RTOL
                elif impl == "torch":
                    tol = None  # the bf16 reference point of the others
                    torch_err = err
                else:
                    tol = None if torch_err is None else 2 * torch_err + 2e-3
                row.update(max_rel_err=err, tolerance=tol, status="ok" if tol is None or err <= tol else "FAILED")
                del head, x, loss
            except ValueError as e:
                why = cannot_run(e, impl)
                if why is None:
                    raise
                row.update(status="unavailable", reason=why)
            except Exception as e:  # the row's own failure, reported with the others
                row.update(status="FAILED", reason=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
            rows.append(row)
            log(f"correctness C={C} {dtype} impl={impl}: {row['status']} "
                + (f"max rel err {row['max_rel_err']:.2e} (tol {row['tolerance']})" if "max_rel_err" in row else row.get("reason", "")))
            release(device)
    return {"rows": rows}


# --------------------------------------------------------------------------- step timing
def freeze_imports() -> None:
    """Move what the imports made (torch, dynamo, Triton: a few hundred thousand objects) out of the
    collector's reach, so that :func:`release`'s ``gc.collect()`` between rows scans only what the
    rows made: 0.17 s a collection before, 42 of them in the step part. Nothing a row makes is
    frozen, so each row's cycles are still freed before the next row's memory is measured."""
    import gc

    import torch._dynamo  # noqa: F401 - the first optimizer imports it (torch.optim's compile guard)

    gc.collect()
    gc.freeze()


def release(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


#: The host's issue time of the last :func:`time_steps` (median ms from the start of a step to the
#: return of its last enqueue, before the synchronise).
LAST_HOST_MS: List[Optional[float]] = [None]


def time_steps(step: Callable[[Any, Any], Any], batches, device: torch.device, warmup: int, steps: int):
    """Median ms of ``steps`` calls after ``warmup``; the largest peak above the memory before a step.
    The median host issue time goes to :data:`LAST_HOST_MS` (a GPU step whose host time is above its
    GPU time waits for the host)."""
    for i in range(warmup):
        step(*batches[i % len(batches)])
    sync(device)
    times, peaks, host = [], [], []
    for i in range(steps):
        x, y = batches[i % len(batches)]
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        sync(device)
        t0 = time.perf_counter()
        step(x, y)
        host.append((time.perf_counter() - t0) * 1e3)
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        if device.type == "cuda":
            peaks.append(torch.cuda.max_memory_allocated(device) - before)
    LAST_HOST_MS[0] = statistics.median(host) if host else None
    return statistics.median(times), (max(peaks) if peaks else None), times


def head_step(head, opt, ctx, device, dtype: str, clip):
    """One head step; ``clip``: False (none), True or "in step" (as ``shardfc train
    --head-grad-clip`` does: the norm from the weight-gradient pass, the factor applied by the
    optimizer as its ``grad_scale``) or "pass" (a reduction over ``.grad``, then ``mul_``)."""
    from shardfc.train.step import clip_head_grad_, grads_divided_by, head_clip_factor, scales_in_step

    in_step = clip in (True, "in step") and scales_in_step(opt)
    if in_step:
        head.measure_weight_grad_norm()

    def step(x, y):
        opt.zero_grad(set_to_none=False)
        with autocast(device, dtype):
            loss = head(x, y)
        loss.backward()
        if in_step:
            _, coef = head_clip_factor(head, GRAD_CLIP, ctx)
            with grads_divided_by(opt, coef.reciprocal()):
                opt.step()
        else:
            if clip:
                clip_head_grad_(head, GRAD_CLIP, ctx)
            opt.step()
        x.grad = None
        return loss

    return step


def floor_step(B: int, C: int, D: int, device: torch.device, dtype: str):
    cdt = getattr(torch, dtype)
    g = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(B, D, generator=g, device=device).to(cdt)
    w = torch.randn(C, D, generator=g, device=device).to(cdt)
    dz = torch.randn(B, C, generator=g, device=device).to(cdt)

    def step(_x, _y):
        x @ w.t()
        dz @ w
        dz.t() @ x

    return step


@contextlib.contextmanager
def l2_share(share: Optional[float]):
    """The fused chunks sized for ``share`` of the L2 (``chunks.CHUNK_L2_SHARE``) inside the block."""
    if share is None:
        yield
        return
    from shardfc.head.fused import chunks  # needs Triton: only the fused rows ask

    before, chunks.CHUNK_L2_SHARE = chunks.CHUNK_L2_SHARE, share
    try:
        yield
    finally:
        chunks.CHUNK_L2_SHARE = before


@contextlib.contextmanager
def fresh_operand(on: bool):
    """Inside the block (``on``), a fused update builds no operand for the next step (the head hands
    the backward no :class:`~shardfc.head.fused.chunks.NextOperand`, so the update kernel runs
    without ``NEXT``): every forward makes it in its pass over W (the comparison row)."""
    if not on:
        yield
        return
    from shardfc.head.module import ShardedMarginHead

    before = ShardedMarginHead._next_operands_for
    ShardedMarginHead._next_operands_for = lambda self, impl, n: None
    try:
        yield
    finally:
        ShardedMarginHead._next_operands_for = before


def graph_step(head, opt, device, dtype: str):
    """One head step replayed as a CUDA graph (:class:`shardfc.head.capture.CapturedHeadStep`: eager
    for its first steps, then captured once and replayed); refused with its reason off CUDA."""
    from shardfc.head.capture import CapturedHeadStep

    captured = CapturedHeadStep(head, opt)

    def step(x, y):
        with autocast(device, dtype):
            loss, _ = captured.step(x.detach(), y)
        return loss

    return step


def smoke_part(args, device: torch.device) -> Dict[str, Any]:
    """Whether this torch takes ``out_dtype=torch.float32`` with bf16 operands for ``mm`` and ``addmm``
    on the device (no CPU test can tell for a CUDA build), and what ``addmm_f32`` chose."""
    from shardfc.head import kernels

    g = torch.Generator(device=device).manual_seed(5)
    a = torch.randn(64, 32, generator=g, device=device).bfloat16()
    b = torch.randn(32, 48, generator=g, device=device).bfloat16()
    ref = a.double() @ b.double()
    rows = []
    for op in ("mm", "addmm"):
        row: Dict[str, Any] = dict(op=op)
        try:
            c = torch.zeros(64, 48, device=device)
            out = torch.mm(a, b, out_dtype=torch.float32) if op == "mm" else \
                torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
            row.update(status="ok", dtype=str(out.dtype), rel_err=rel(out, ref))
        except Exception as e:  # the answer this part exists for, not a failure
            row.update(status="refused", reason=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        rows.append(row)
        log(f"smoke torch.{op}(out_dtype=float32, bf16) on {device.type}: {row['status']}")
    c = torch.zeros(64, 48, device=device)
    kernels.addmm_f32(c, a, b)
    err = rel(c, ref)
    chose = {f"{op}@{dev}": works for (op, dev), works in kernels.OUT_DTYPE_WORKS.items()}
    status = "ok" if err < 1e-5 else "FAILED"
    rows.append(dict(op="addmm_f32", status=status, rel_err=err, out_dtype_works=chose))
    log(f"smoke addmm_f32: rel err {err:.2e}, out_dtype: {chose or 'not tried (not CUDA)'}")
    return {"rows": rows}


def graph_part(args, device: torch.device) -> Dict[str, Any]:
    """The captured step replayed against the eager fused step, from the same weights and batches, over
    a schedule of learning rates: each step's loss and the final weights to fp32 rounding."""
    from shardfc.head.capture import CapturedHeadStep, capture_unavailable

    C, B, D = args.check_classes, args.batch, args.dim
    lrs = [LR, LR, LR / 2, LR / 2, LR / 5, LR / 10, LR / 10, LR / 20]
    batches = inputs(B, D, C, device, len(lrs), seed=11)
    rows = []
    # Issue 42: Partial FC captured too (its counter-based draw, the idle rows' clock on the device)
    for impl, options in [("triton", {}), ("gemm", {}), ("gemm", {"sample_rate": 0.1})]:
        row: Dict[str, Any] = dict(impl=impl, classes=C, lrs=lrs, **options)
        try:
            heads = [make_head(D, C, device, impl, **options)[0] for _ in range(2)]
            opts = [shardfc.head_optimizer(h, "sgd", lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY,
                                           fused_update=True) for h in heads]
            why = capture_unavailable(heads[1], opts[1])
            if why is not None:
                row.update(status="unavailable", reason=why)
                rows.append(row)
                continue
            captured = CapturedHeadStep(heads[1], opts[1])
            eager_losses, graph_losses, calls = [], [], []
            for lr, (x, y) in zip(lrs, batches):
                for opt in opts:
                    for group in opt.param_groups:
                        group["lr"] = lr
                opts[0].zero_grad(set_to_none=False)
                xe = x.detach().clone().requires_grad_(True)
                with autocast(device, args.dtype):
                    loss = heads[0](xe, y)
                loss.backward()
                opts[0].step()
                eager_losses.append(float(loss))
                with autocast(device, args.dtype):
                    gl, _ = captured.step(x.detach(), y)
                graph_losses.append(float(gl))
                calls.append(captured.last_call)
            loss_err = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(eager_losses, graph_losses))
            for opt in opts:
                getattr(opt, "catch_up_all_", lambda: None)()  # Partial FC: every idle row brought to now
            w_err = rel(heads[1].weight, heads[0].weight)
            ok = loss_err < 1e-5 and w_err < 1e-5 and captured.captures == 1 and calls[-1] == "replayed"
            row.update(status="ok" if ok else "FAILED", loss_rel_err=loss_err, weight_rel_err=w_err, calls=calls,
                       captures=captured.captures, replays=captured.replays)
            log(f"graph impl={impl} {options}: loss err {loss_err:.2e}, weight err {w_err:.2e}, calls {calls}")
            del heads, opts, captured
        except Exception as e:
            row_error(row, e, impl)
            log(f"graph impl={impl}: {row['status']}: {row['reason']}")
        rows.append(row)
        release(device)
    return {"rows": rows}


def step_part(args, device: torch.device, classes: Optional[int] = None,
              keep: Optional[Callable[[str], bool]] = None) -> Dict[str, Any]:
    """The rows at C = ``classes`` (default ``--classes``) whose names ``keep`` takes (default: those
    ``--step-rows`` names, or all)."""
    C, B, D = classes or args.classes, args.batch, args.dim
    rows: List[Dict[str, Any]] = []
    batches = inputs(B, D, C, device, 4)
    ms, _, times = time_steps(floor_step(B, C, D, device, args.dtype), batches, device, args.warmup, args.steps)
    rows.append(dict(name="matmul floor (3 GEMMs)", impl="-", ms=ms, host_ms=LAST_HOST_MS[0], times_ms=times,
                     peak_above_rest=None))
    log(f"step C={C}: floor {ms:.3f} ms")
    release(device)
    variants = []
    for impl in IMPLS:
        variants.append((f"{impl}: bench step", impl, False, {}, torch.float32, False))
        variants.append((f"{impl}: head clipped 5.0, norm from the backward, clip in the update", impl, "in step", {},
                         torch.float32, False))
        variants.append((f"{impl}: head clipped 5.0 by a pass (reduction + mul_)", impl, "pass", {}, torch.float32,
                         False))
    for impl in ("triton", "gemm"):
        variants.append((f"{impl}: SGD step fused into the backward", impl, False, {}, torch.float32, True))
        # Issue 31 item 5: chunks sized for L2 (the default) against the former 32 MiB of products,
        # which the working set overflowed (≈2.6x fewer chunks and launches, more HBM traffic).
        variants.append((f"{impl}: fused SGD step, former chunks (32 MiB of products)", impl, False,
                         {"l2_share": FORMER_L2_SHARE}, torch.float32, True))
        # The operand the update writes for the next step, against the forward's pass over W.
        variants.append((f"{impl}: fused SGD step, operand made by each forward", impl, False,
                         {"fresh_operand": True}, torch.float32, True))
        # Issue 42: the chunk-size sweep (scale 1 = the L2-sized chunks; the default is DEFAULT_CHUNK_SCALE)
        # and the step replayed as one CUDA graph.
        for scale in CHUNK_SCALES:
            variants.append((f"{impl}: fused SGD step, chunk scale {scale}", impl, False, {"gpu_chunk_scale": scale},
                             torch.float32, True))
        variants.append((f"{impl}: fused SGD step, CUDA graph replay", impl, False, {"graph": True}, torch.float32,
                         True))
        variants.append((f"{impl}: AdamW step fused into the backward", impl, False, {"optimizer": "adamw"},
                         torch.float32, True))
        variants.append((f"{impl}: AdamW, the optimizer after the backward", impl, False, {"optimizer": "adamw"},
                         torch.float32, False))
        variants.append((f"{impl}: Partial FC r=0.1, bf16 centres, sparse_grad", impl, False,
                         {"sample_rate": 0.1, "sparse_grad": True}, torch.bfloat16, False))
        variants.append((f"{impl}: Partial FC r=0.1, bf16 centres, fused update", impl, False,
                         {"sample_rate": 0.1}, torch.bfloat16, True))
        # Issue 41: the exact catch-up of idle rows (the default above) against the lazy update.
        variants.append((f"{impl}: Partial FC r=0.1, bf16 centres, sparse_grad, lazy idle rows", impl, False,
                         {"sample_rate": 0.1, "sparse_grad": True, "idle_rows": "lazy"}, torch.bfloat16, False))
        variants.append((f"{impl}: Partial FC r=0.1, bf16 centres, fused update, CUDA graph replay", impl, False,
                         {"sample_rate": 0.1, "graph": True}, torch.bfloat16, True))
        variants.append((f"{impl}: Partial FC r=0.1, fp32, fused update", impl, False,
                         {"sample_rate": 0.1}, torch.float32, True))
        variants.append((f"{impl}: Partial FC r=0.1, fp32, fused update, lazy idle rows", impl, False,
                         {"sample_rate": 0.1, "idle_rows": "lazy"}, torch.float32, True))
    if keep is None:
        wanted = [w.strip() for w in args.step_rows.split(",") if w.strip()] if args.step_rows else None
        keep = lambda name: wanted is None or any(w in name for w in wanted)  # noqa: E731
    for name, impl, clip, options, wdt, fused in variants:
        if not keep(name):
            continue
        row: Dict[str, Any] = dict(name=name, impl=impl)
        options = dict(options)
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(l2_share(options.pop("l2_share", None)))
            stack.enter_context(fresh_operand(options.pop("fresh_operand", False)))
            name_opt = options.pop("optimizer", "sgd")
            idle_rows = options.pop("idle_rows", "exact")
            graph = options.pop("graph", False)
            head, ctx = make_head(D, C, device, impl, dtype=wdt, **options)
            kw = dict(momentum=MOMENTUM) if name_opt == "sgd" else {}
            opt = shardfc.head_optimizer(head, name_opt, lr=LR, weight_decay=WEIGHT_DECAY, fused_update=fused,
                                         idle_rows=idle_rows, **kw)
            step = graph_step(head, opt, device, args.dtype) if graph else head_step(head, opt, ctx, device, args.dtype, clip)
            ms, peak, times = time_steps(step, batches, device, args.warmup, args.steps)
            row.update(ms=ms, host_ms=LAST_HOST_MS[0], times_ms=times, peak_above_rest=peak, ran=head.last_impl,
                       status="ok", optimizer=type(opt).__name__, update=head.last_update,
                       chunk_scale=head.last_chunk_scale)
            if fused and head.last_update != "fused" and device.type == "cuda":
                row.update(status="FAILED", reason=f"the update was not fused: {head.last_update}")
            log(f"step C={C} {name}: {ms:.3f} ms, peak above rest "
                + ("-" if peak is None else f"{peak / 2**20:.1f} MiB"))
            del head, opt, step
        except Exception as e:
            row_error(row, e, impl)
            log(f"step C={C} {name}: {row['status']}: {row['reason']}")
        finally:
            stack.close()
        rows.append(row)
        release(device)
    return {"classes": C, "batch": B, "dim": D, "dtype": args.dtype, "rows": rows}


#: The rows the step part times again at the second C (``--second-classes``): the bench step, the
#: fused step eager and replayed, and Partial FC's fused step eager and replayed — ends of row names
#: (after ``impl: ``), separated by ``;`` since the names hold commas.
SECOND_STEP_ROWS = ("bench step;SGD step fused into the backward;fused SGD step, CUDA graph replay;"
                    "Partial FC r=0.1, bf16 centres, fused update;"
                    "Partial FC r=0.1, bf16 centres, fused update, CUDA graph replay")


def second_step_part(args, device: torch.device) -> Dict[str, Any]:
    """The step part at a second C (``--second-classes``, 250k: issue 40 asks for the step at C = 1M
    and 250k), limited to ``--second-step-rows``; last, so that a part's timeout takes it first."""
    ends = [e.strip() for e in args.second_step_rows.split(";") if e.strip()]
    return step_part(args, device, args.second_classes, lambda name: any(name.endswith(": " + e) for e in ends))


# --------------------------------------------------------------------------- profile and host syncs
def sync_error_mode(step: Callable[[Any, Any], Any], batch, device: torch.device) -> Dict[str, Any]:
    """One ``step`` under ``torch.cuda.set_sync_debug_mode("error")``, where a host synchronisation
    raises RuntimeError: ``{"status": "pass"}``, or ``"FAILED"`` with the error (CUDA only: on another
    device ``"skipped"``). The step's inputs must already be on the device."""
    if device.type != "cuda":
        return {"status": "skipped", "reason": "CUDA only (torch.cuda.set_sync_debug_mode)"}
    sync(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(*batch)
    except Exception as e:  # a sync's RuntimeError, or anything else the step raised
        return {"status": "FAILED", "reason": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}",
                "traceback": traceback.format_exc()}
    finally:
        torch.cuda.set_sync_debug_mode("default")
    sync(device)
    return {"status": "pass"}


def profile_part(args, device: torch.device) -> Dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    C, B, D = args.classes, args.batch, args.dim
    out: Dict[str, Any] = {"classes": C, "batch": B, "dim": D, "dtype": args.dtype, "impls": {}}
    batches = inputs(B, D, C, device, 2)
    for name in args.profile_impls.split(","):
        # "<impl>" (the gradient stored, then the optimizer) or "<impl>+fused" (the SGD step in the
        # backward: what shardfc train runs by default on a GPU); neither clips the head
        impl, fused = name.split("+")[0], name.endswith("+fused")
        res: Dict[str, Any] = {}
        try:
            head, ctx = make_head(D, C, device, impl)
            opt = shardfc.head_optimizer(head, "sgd", lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY,
                                         fused_update=fused)
            step = head_step(head, opt, ctx, device, args.dtype, clip=False)
            for i in range(2):
                step(*batches[i % 2])
            sync(device)
            # host synchronisations, each with the Python line that asked for it
            syncs: Dict[str, int] = {}
            if device.type == "cuda":
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        step(*batches[0])
                        sync(device)
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                for w in caught:
                    if "called a synchronizing" in str(w.message):
                        key = f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0][:120]}"
                        syncs[key] = syncs.get(key, 0) + 1
            res["host_syncs"] = sum(syncs.values())
            res["host_sync_sites"] = syncs
            res["sync_error_mode"] = sync_error_mode(step, batches[1], device)
            log(f"profile impl={impl}: a step under set_sync_debug_mode('error'): {res['sync_error_mode']['status']} "
                + res["sync_error_mode"].get("reason", ""))
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with profile(activities=activities) as prof:
                step(*batches[1])
                sync(device)
            kernels: Dict[str, List[float]] = {}
            for evt in prof.events():
                # device-side events, less the user annotations that span kernels already counted
                # (the optimizer's "Optimizer.step#SGD.step" range: 2.8 ms counted twice on the first run)
                if (device.type == "cuda" and str(getattr(evt, "device_type", "")).endswith("CUDA")
                        and not getattr(evt, "is_user_annotation", False)):
                    us = getattr(evt, "device_time", None)
                    if us is None:
                        us = getattr(evt, "cuda_time", 0.0)
                    kernels.setdefault(evt.name, []).append(float(us))
            res["kernels"] = sum(len(v) for v in kernels.values())
            res["kernel_time_ms"] = sum(sum(v) for v in kernels.values()) / 1e3
            top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:10]
            res["slowest"] = [dict(name=k[:140], calls=len(v), total_ms=sum(v) / 1e3) for k, v in top]
            res["ran"] = head.last_impl
            if impl == "triton" and device.type == "cuda":  # the forward tile the autotuner kept
                from shardfc.head.fused import autotune

                best = getattr(autotune.lse_forward(1, False, "tf32", False), "best_config", None)
                res["forward_config"] = str(best)
                log(f"profile impl=triton: forward autotune kept {best}")
            log(f"profile C={C} {name}: {res['kernels']} kernels, {res['kernel_time_ms']:.3f} ms of kernels, "
                f"{res['host_syncs']} host syncs")
            for s in res["slowest"]:
                log(f"    {s['total_ms']:8.3f} ms  x{s['calls']:<4d} {s['name'][:100]}")
            for site, n in syncs.items():
                log(f"    sync x{n}: {site}")
            del head, opt, step
            res["partial_fc_sync_error_mode"] = partial_fc_sync_check(args, device, impl, batches)
        except Exception as e:
            res.update(status="FAILED", reason=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
            log(f"profile {name}: FAILED: {res['reason']}")
        out["impls"][name] = res
        release(device)
    return out


def partial_fc_sync_check(args, device: torch.device, impl: str, batches) -> Dict[str, Any]:
    """The trainer's step of a Partial FC head (r = 0.1, bf16 centres, ``sparse_grad``, row-sparse
    SGD) under ``set_sync_debug_mode("error")``, after two warm-up steps."""
    if device.type != "cuda":
        return {"status": "skipped", "reason": "CUDA only (torch.cuda.set_sync_debug_mode)"}
    try:
        head, ctx = make_head(args.dim, args.classes, device, impl, dtype=torch.bfloat16, sample_rate=0.1, sparse_grad=True)
        opt = shardfc.head_optimizer(head, "sgd", lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
        step = head_step(head, opt, ctx, device, args.dtype, clip=True)
        for i in range(2):
            step(*batches[i % 2])
        res = sync_error_mode(step, batches[0], device)
    except Exception as e:
        res = {"status": "FAILED", "reason": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    log(f"profile impl={impl}: a Partial FC step under set_sync_debug_mode('error'): {res['status']} "
        + res.get("reason", ""))
    release(device)
    return res


# --------------------------------------------------------------------------- plan vs measured
def plan_part(args, device: torch.device) -> Dict[str, Any]:
    from shardfc.tools.plan import plan

    C, B, D = args.classes, args.batch, args.dim
    rows = []
    for dtype, impl in (("float32", "triton"), ("bfloat16", "triton"), ("bfloat16", "gemm")):
        row: Dict[str, Any] = dict(dtype=dtype, impl=impl, classes=C)
        try:
            p = plan(C, D, B, dtype=dtype, impl=impl, weight_decay=WEIGHT_DECAY,
                     sms=torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132)
            row.update(planned_step_peak=p["step_peak"], planned_resting=p["resting"], planned_parts=p["parts"])
            wdt = getattr(torch, dtype)
            head, ctx = make_head(D, C, device, impl, dtype=wdt)
            opt = shardfc.head_optimizer(head, "sgd", lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
            step = head_step(head, opt, ctx, device, "float32", clip=False)  # x and centres in `dtype`
            batches = inputs(B, D, C, device, 2, dtype=wdt)
            ms, peak, _ = time_steps(step, batches, device, 2, 3)
            rest = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
            row.update(measured_step_peak=peak, measured_allocated_at_rest=rest, ms=ms, ran=head.last_impl,
                       status="ok")
            if peak:
                row["measured_over_planned"] = peak / max(p["step_peak"], 1)
            log(f"plan C={C} {dtype} impl={impl}: planned step peak {p['step_peak'] / 2**20:.1f} MiB, measured "
                + ("-" if peak is None else f"{peak / 2**20:.1f} MiB") + f" ({ms:.3f} ms)")
            del head, opt, step, batches
        except Exception as e:
            row_error(row, e, impl)
            log(f"plan {dtype} impl={impl}: {row['status']}: {row['reason']}")
        rows.append(row)
        release(device)
    out: Dict[str, Any] = {"rows": rows}
    try:  # each chunk scale on paper at the step's shapes (issue 42): what the step part's sweep measures
        p = plan(C, D, B, dtype="float32", compute_dtype=args.dtype, impl="gemm", fused_update=True, traffic=True,
                 sms=torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132,
                 l2_bytes=torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 50 * 2**20)
        out["chunk_candidates"] = p["chunk_candidates"]
        log(f"plan C={C}: chunk scale on paper {p['chunk_candidates']['pick']}")
    except Exception as e:
        out["chunk_candidates"] = {"status": "FAILED", "reason": f"{type(e).__name__}: {e}"}
        log(f"plan chunk candidates: FAILED: {e}")
    return out


PARTS = {"smoke": smoke_part, "correctness": correctness, "step": step_part, "graph": graph_part,
         "profile": profile_part, "plan": plan_part, "step2": second_step_part}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {','.join(PARTS)}")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--classes", type=int, default=1_000_000, help="C of the step, profile and plan parts")
    p.add_argument("--check-classes", type=int, default=250_000, help="C of the correctness part")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="compute dtype of the step")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-impls", default="triton+fused,triton",
                   help="comma-separated: an impl (the optimizer's step) or impl+fused (the step in the backward)")
    p.add_argument("--step-rows", default=None,
                   help="comma-separated parts of the step part's row names: only those rows (default: every row)")
    p.add_argument("--second-classes", type=int, default=250_000, help="C of the step2 part")
    p.add_argument("--second-step-rows", default=SECOND_STEP_ROWS,
                   help="';'-separated ends of row names (after 'impl: '): the step2 part's rows")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_step: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    env = {"torch": torch.__version__, "cuda": torch.version.cuda,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = None
    result: Dict[str, Any] = {"environment": env, "args": vars(args)}
    freeze_imports()
    status = 0
    for name in args.parts.split(","):
        t0 = time.perf_counter()
        try:
            result[name] = PARTS[name](args, device)
        except Exception as e:
            result[name] = {"status": "FAILED", "reason": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            log(f"{name}: FAILED: {e}\n{traceback.format_exc()}")
            status = 1
        result[name + "_seconds"] = time.perf_counter() - t0
        if args.json:  # after each part, so a timeout leaves what was done
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=1, default=str)
    for row in result.get("correctness", {}).get("rows", []):
        if row.get("status") == "FAILED":
            status = 1
    for part in ("smoke", "step", "graph", "plan", "step2"):
        for row in result.get(part, {}).get("rows", []):
            if row.get("status") == "FAILED":
                status = 1
    for res in result.get("profile", {}).get("impls", {}).values():  # a step that synchronised the host
        for key in ("sync_error_mode", "partial_fc_sync_error_mode"):
            if res.get(key, {}).get("status") == "FAILED":
                status = 1
    print(summary(result))
    return status


def summary(r: Dict[str, Any]) -> str:
    env = r["environment"]
    lines = [f"## gpu_step: {env['device']}, torch {env['torch']}, CUDA {env['cuda']}, triton {env['triton']}"]
    if "correctness" in r and "rows" in r["correctness"]:
        lines += ["", "| correctness | impl | loss err | x.grad err | W.grad err | tol | status |", "|---|---|---|---|---|---|---|"]
        for row in r["correctness"]["rows"]:
            f = lambda k: f"{row[k]:.2e}" if isinstance(row.get(k), float) else "-"  # noqa: E731
            lines.append(f"| C={row['classes']} {row['dtype']} | {row['impl']} | {f('loss_rel_err')} | {f('x_grad_rel_err')} | "
                         f"{f('weight_grad_rel_err')} | {f('tolerance')} | {row['status']} {row.get('reason', '')[:80]} |")
    for s in [r[part] for part in ("step", "step2") if "rows" in r.get(part, {})]:
        lines += ["", f"| step C={s['classes']} B={s['batch']} D={s['dim']} {s['dtype']} | ms | host issue ms "
                      "| peak above rest MiB | status |", "|---|---:|---:|---:|---|"]
        for row in s["rows"]:
            ms = f"{row['ms']:.3f}" if row.get("ms") is not None else "-"
            host = f"{row['host_ms']:.3f}" if row.get("host_ms") is not None else "-"
            pk = f"{row['peak_above_rest'] / 2**20:.1f}" if row.get("peak_above_rest") else "-"
            lines.append(f"| {row['name']} | {ms} | {host} | {pk} | {row.get('status', 'ok')} "
                         f"{row.get('reason', '')[:80]} |")
    for row in r.get("smoke", {}).get("rows", []):
        lines.append(f"smoke {row['op']}: {row['status']} {row.get('reason', '')[:100]}"
                     + (f" (out_dtype works: {row['out_dtype_works']})" if "out_dtype_works" in row else ""))
    for row in r.get("graph", {}).get("rows", []):
        errs = (f": loss err {row['loss_rel_err']:.2e}, weight err {row['weight_rel_err']:.2e}"
                if "loss_rel_err" in row else "")
        pfc = f" Partial FC r={row['sample_rate']}" if "sample_rate" in row else ""
        lines.append(f"graph replay vs eager, impl={row['impl']}{pfc}: {row['status']}{errs} {row.get('reason', '')[:100]}")
    if "profile" in r and "impls" in r["profile"]:
        for impl, res in r["profile"]["impls"].items():
            if "kernels" in res:
                lines.append(f"\nprofile {impl}: {res['kernels']} kernels, {res['kernel_time_ms']:.3f} ms, "
                             f"{res['host_syncs']} host syncs")
            for key, what in (("sync_error_mode", "step"), ("partial_fc_sync_error_mode", "Partial FC step")):
                if key in res:
                    lines.append(f"profile impl={impl}: {what} under set_sync_debug_mode('error'): {res[key]['status']}"
                                 + (f" ({res[key]['reason'][:100]})" if res[key].get("reason") else ""))
    if "plan" in r and "rows" in r["plan"]:
        lines += ["", "| plan vs measured | planned MiB | measured MiB | ms |", "|---|---:|---:|---:|"]
        for row in r["plan"]["rows"]:
            pl = f"{row['planned_step_peak'] / 2**20:.1f}" if "planned_step_peak" in row else "-"
            me = f"{row['measured_step_peak'] / 2**20:.1f}" if row.get("measured_step_peak") else "-"
            ms = f"{row['ms']:.3f}" if "ms" in row else "-"
            lines.append(f"| {row['dtype']} {row['impl']} | {pl} | {me} | {ms} {row.get('reason', '')[:60]} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
