"""Measure the head variants on W spawned processes: step time, per-rank peak memory, traffic.

Variants (all with the same margin, dtype and global batch):

* ``naive``      :class:`shardfc.head.baselines.NaiveParallelHead` — logits of every shard gathered to rank 0.
* ``replicated`` :class:`shardfc.head.baselines.ReplicatedHead` — the full FC on every rank, local batch
  only; its weight gradient is all-reduced after the backward, as DDP would.
* ``sharded``    :class:`shardfc.ShardedMarginHead`, one ``[B, n_local]`` buffer.
* ``chunked``    the same with ``chunk_size`` (online softmax, logits recomputed in the backward).
* ``partial``    the same with ``sample_rate`` (Partial FC) and the row-sparse head optimizer; with
  ``sparse_grad`` its weight gradient is the sampled rows' only (no ``[n_local, D]`` ``.grad``).
* ``partial_lazy`` the same with the lazy update (``idle_rows="lazy"``: idle rows wait, unchanged,
  for their next sample) instead of the exact one: what the exact catch-up costs, in the same run.

The sharded variants build their optimizer with :func:`shardfc.head.partial_fc.head_optimizer`
(torch's SGD for an fp32 head without sampling; the row-sparse SGD, fp32 updates rounded once, for
bf16/fp16 weights), as training does.

A step is forward + backward + optimizer step (SGD, momentum 0.9, no weight decay) +
``zero_grad(set_to_none=False)``, on random embeddings ``[B_r, D]`` (leaf tensors that require grad)
and uniform labels. ``B`` is the *global* batch: rank ``r`` gets ``B // W`` rows, plus one for the
first ``B % W`` ranks.

Every variant keeps its weight gradients allocated between steps (``set_to_none=False``), as
memory-conscious training loops do: the gradient buffer is part of the resting state, and the
sharded head adds its weight gradient into it in place (``weight_grad_in_place``, its default;
Partial FC's sampled rows go in with ``index_add_``), so its step allocates nothing of size
``[n_local, D]``. The baselines get the same treatment: autograd adds their fresh gradient into
the kept ``.grad``. The warm-up step (at least one before memory is measured) allocates the
gradients and the optimizer state.

Per variant (see :func:`run_bench`):

* ``step_time_s``: median over the timed steps of the step's time, the step time being the
  slowest rank's (all ranks start each step together after a barrier).
* ``peak_bytes_per_rank``: per rank, the largest over the measured steps of the step's peak memory
  above the resting state just before it. Resting state = weights + gradients + optimizer state
  (and the step's inputs), measured after warm-up; everything else the step allocates counts.
  On CUDA: ``max_memory_allocated``; on the CPU: the peak of the live bytes of the tensors the
  step's operators create, counted by a dispatch mode (:mod:`shardfc.tools.bench.memory`), on any
  machine — what ``shardfc plan`` predicts.
* ``balance``: ``max / min`` of ``peak_bytes_per_rank`` (``None`` if a rank's peak is 0).
* ``comm_bytes_per_rank``: bytes of one step's collectives as counted by
  :func:`shardfc.parallel.count_comm` at the calls (gathered output / reduce-scatter input /
  all-reduce tensor / ...), the largest over ranks.
* ``floor_ratio``: ``step_time_s`` over the time of the step's three matmuls alone — logits
  ``a·Wᵀ``, ``dZ·W`` and ``dZᵀ·a`` on the variant's shapes (``[B, D]×[D, n_local]`` for
  naive/sharded/chunked, ``n_sampled = ⌈r·n_local⌉`` for partial, ``[B_r, D]×[D, C]`` for replicated),
  timed on all ranks at once like the step, once right after each timed step (so both see the
  same machine load), median over those of the slowest rank. The matmuls read the head's own weight
  rows; their ``dZ`` and products exist only while they are timed.

Memory and traffic are measured first, on ``min(steps, 2)`` extra steps per variant after a warm-up
step; the timed steps come after, in a phase of their own, because the CPU measure slows every
operator down (see :mod:`shardfc.tools.bench.memory`). One head exists at a time: each variant's
head, optimizer and buffers are gone before the next one is built.
"""

from __future__ import annotations

import gc
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from shardfc.checks import check_int, check_names
from shardfc.parallel.partition import split_evenly
from shardfc.tools.bench.memory import PeakMemory

VARIANTS = ("naive", "replicated", "sharded", "chunked", "partial", "partial_lazy")
#: the fields of one result, in order (the JSON holds exactly these)
FIELDS = ("variant", "step_time_s", "peak_bytes_per_rank", "balance", "comm_bytes_per_rank", "floor_ratio")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: chunk size of the ``chunked`` variant when none is given
DEFAULT_CHUNK_SIZE = 1024
#: Partial FC rate of the ``partial`` variants when none is given
DEFAULT_SAMPLE_RATE = 0.1
LR = 0.01
MOMENTUM = 0.9
SEED = 1234


# --------------------------------------------------------------------------- variants
def parse_variants(variants: Union[str, Sequence[str]]) -> List[str]:
    """``"a,b"`` or ``["a", "b"]`` -> checked list (unknown names or duplicates: ValueError)."""
    return check_names("variants", variants, list(VARIANTS))


def local_batch_sizes(batch: int, world_size: int) -> List[int]:
    """The global batch split over ranks: ``B // W`` each, one more for the first ``B % W``."""
    return split_evenly(batch, world_size)


# --------------------------------------------------------------------------- config
@dataclass(frozen=True)
class BenchConfig:
    world_size: int
    batch: int
    dim: int
    classes: int
    variants: tuple
    steps: int
    warmup: int
    sample_rate: float
    chunk_size: Union[int, str]
    dtype: str
    margin: str
    progress: bool
    sparse_grad: bool = False


def _check_config(world_size, batch, dim, classes, variants, steps, warmup, sample_rate, chunk_size, dtype, margin, progress,
                  sparse_grad=False) -> BenchConfig:
    from shardfc.head.margins import build_margin

    check_int("world_size", world_size, 1)
    check_int("batch", batch, 1)
    check_int("dim", dim, 1)
    check_int("classes", classes, 1)
    if classes < world_size:
        raise ValueError(f"classes must be >= world_size so every rank holds a shard, got classes={classes}, world_size={world_size}")
    names = parse_variants(variants)
    check_int("steps", steps, 1)
    check_int("warmup", warmup, 0)
    # A setting of a variant that is not run would be dropped silently: refused instead.
    if sample_rate is not None and not {"partial", "partial_lazy"} & set(names):
        raise ValueError(f"sample_rate={sample_rate!r} applies to the partial variants, not to variants {names}")
    if chunk_size is not None and "chunked" not in names:
        raise ValueError(f"chunk_size={chunk_size!r} applies to the chunked variant, not to variants {names}")
    if sample_rate is None:
        sample_rate = DEFAULT_SAMPLE_RATE
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) or not (0 < sample_rate <= 1):
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
    if chunk_size is None:
        chunk_size = DEFAULT_CHUNK_SIZE
    if chunk_size != "auto":
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an integer >= 1 or 'auto', got {chunk_size!r}")
    if isinstance(dtype, torch.dtype):
        dtype = {v: k for k, v in DTYPES.items()}.get(dtype, str(dtype))
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if not isinstance(margin, str):
        raise ValueError(f"margin must be a margin name such as 'arcface', got {margin!r}")
    build_margin(margin)  # raises a clear ValueError for an unknown name
    if not isinstance(sparse_grad, bool):
        raise ValueError(f"sparse_grad must be True or False, got {sparse_grad!r}")
    if sparse_grad and (sample_rate >= 1 or not {"partial", "partial_lazy"} & set(names)):
        raise ValueError(f"sparse_grad applies to the partial variant with sample_rate < 1; got variants {names}, "
                         f"sample_rate={sample_rate!r}")
    return BenchConfig(world_size, batch, dim, classes, tuple(names), steps, warmup, float(sample_rate), chunk_size, dtype,
                       margin, bool(progress), sparse_grad)


# --------------------------------------------------------------------------- public API
def run_bench(
    world_size: int,
    batch: int,
    dim: int,
    classes: int,
    variants: Union[str, Sequence[str]] = ("sharded", "chunked"),
    steps: int = 5,
    warmup: int = 1,
    sample_rate: Optional[float] = None,
    chunk_size: Union[int, str, None] = None,
    dtype: Union[str, torch.dtype] = "float32",
    margin: str = "arcface",
    backend: Optional[str] = None,
    progress: bool = True,
    details: Optional[Dict[str, Any]] = None,
    sparse_grad: bool = False,
) -> List[Dict[str, Any]]:
    """Run the bench on ``world_size`` spawned processes; one result dict per variant.

    Each dict has exactly the keys of :data:`FIELDS` (see the module docstring). ``details``, if
    given, is filled with what the table and the plot need besides: ``memory_measure``,
    ``backend``, ``config`` (the checked arguments) and ``sizes`` (local batches).
    Bad arguments raise ``ValueError`` naming the argument and value before anything starts, as do
    ``sample_rate`` (default :data:`DEFAULT_SAMPLE_RATE`) and ``chunk_size`` given without a variant
    that reads them.
    """
    from shardfc.parallel.launch import default_backend, spawn

    cfg = _check_config(world_size, batch, dim, classes, variants, steps, warmup, sample_rate, chunk_size, dtype, margin,
                        progress, sparse_grad)
    backend = backend or default_backend()
    if progress:
        print(
            f"[bench] {world_size} ranks ({backend}), B={batch} D={dim} C={classes} {cfg.dtype}, "
            f"variants {','.join(cfg.variants)}, {cfg.warmup} warm-up + {cfg.steps} timed steps",
            file=sys.stderr,
            flush=True,
        )
    per_rank = spawn(_bench_worker, world_size, asdict(cfg), backend=backend, timeout_s=3600.0)
    results = [_aggregate(v, [r["variants"][v] for r in per_rank]) for v in cfg.variants]
    if details is not None:
        details.update(
            memory_measure=per_rank[0]["memory_measure"],
            backend=backend,
            sizes=local_batch_sizes(batch, world_size),
            config=asdict(cfg),
        )
    return results


def _aggregate(variant: str, ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
    steps = len(ranks[0]["step_s"])
    step_time = statistics.median(max(r["step_s"][i] for r in ranks) for i in range(steps))
    reps = len(ranks[0]["floor_s"])
    floor = statistics.median(max(r["floor_s"][i] for r in ranks) for i in range(reps))
    peaks = [int(max(r["peak"])) for r in ranks]
    balance = (max(peaks) / min(peaks)) if min(peaks) > 0 else None
    comm = int(max(max(r["comm"]) for r in ranks))
    return {
        "variant": variant,
        "step_time_s": float(step_time),
        "peak_bytes_per_rank": peaks,
        "balance": balance,
        "comm_bytes_per_rank": comm,
        "floor_ratio": float(step_time / floor) if floor > 0 else None,
    }


# --------------------------------------------------------------------------- worker
def _say(cfg: Dict[str, Any], rank: int, text: str) -> None:
    if cfg["progress"] and rank == 0:
        print(f"[bench] {text}", file=sys.stderr, flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _build(variant: str, cfg: Dict[str, Any], device: torch.device):
    """(head, optimizer, after_backward hook, matmul shape (rows, classes)) for one variant."""
    from shardfc.head.layout import class_ranges
    from shardfc.head.margins import build_margin
    from shardfc.head.module import ShardedMarginHead
    from shardfc.head.partial_fc import head_optimizer

    dtype = DTYPES[cfg["dtype"]]
    common = dict(margin=build_margin(cfg["margin"]), device=device, dtype=dtype)
    D, C, W = cfg["dim"], cfg["classes"], cfg["world_size"]
    rank = dist.get_rank()
    n_local = len(class_ranges(C, W)[rank])
    B, b = cfg["batch"], local_batch_sizes(cfg["batch"], W)[rank]
    after_backward = None
    if variant == "naive":
        from shardfc.head.baselines import NaiveParallelHead

        head, shape = NaiveParallelHead(D, C, **common), (B, n_local)
    elif variant == "replicated":
        from shardfc.head.baselines import ReplicatedHead

        head, shape = ReplicatedHead(D, C, **common), (b, C)
        after_backward = head.average_gradients
    elif variant in ("sharded", "chunked", "partial", "partial_lazy"):
        partial = variant.startswith("partial")
        options = dict(chunk_size=cfg["chunk_size"]) if variant == "chunked" else {}
        if partial:
            options = dict(sample_rate=cfg["sample_rate"], sparse_grad=cfg["sparse_grad"])
        head = ShardedMarginHead(D, C, **options, **common)
        opt = head_optimizer(head, "sgd", lr=LR, momentum=MOMENTUM, weight_decay=0.0,
                             idle_rows="lazy" if variant == "partial_lazy" else "exact")
        if partial:
            n_local = min(n_local, math.ceil(cfg["sample_rate"] * n_local))
        return head, opt, None, (B, n_local)
    else:  # pragma: no cover - checked in the parent
        raise ValueError(variant)
    opt = torch.optim.SGD(head.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=0.0)
    return head, opt, after_backward, shape


def _inputs(cfg: Dict[str, Any], rank: int, step: int, device: torch.device):
    b = local_batch_sizes(cfg["batch"], cfg["world_size"])[rank]
    g = torch.Generator().manual_seed(SEED * 1_000_003 + step * 1009 + rank)
    x = torch.randn(b, cfg["dim"], generator=g).to(device, DTYPES[cfg["dtype"]]).requires_grad_(True)
    y = torch.randint(0, cfg["classes"], (b,), generator=g).to(device)
    return x, y


def train_step(head, optimizer, x, y, after_backward=None, set_to_none: bool = False) -> None:
    """One training step of a head: forward, backward, ``after_backward()``, optimizer step,
    ``zero_grad(set_to_none)``. The bench keeps gradients (``set_to_none=False``): they are part
    of the resting state. ``shardfc plan`` replays this same function."""
    loss = head(x, y)
    loss.backward()
    del loss
    if after_backward is not None:
        after_backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=set_to_none)


#: Columns of the floor's matmuls at a time: its ``[rows, n]`` products never exist whole (at
#: C = 10M on two ranks they would be 5 GB each), only ``[rows, FLOOR_BLOCK]`` blocks.
FLOOR_BLOCK = 65536


class _Floor:
    """The three matmuls of a step on ``[rows, D] × [D, classes]`` (this rank's part), timed
    like a step: all ranks start together after a barrier. ``W`` is the first ``classes`` rows of
    the head's own weight (no copy), walked FLOOR_BLOCK columns at a time (the same flops); ``dZ``
    is one block made for each timing and freed after it, so nothing of the floor's but the small
    ``a`` outlives :meth:`time`."""

    def __init__(self, shape, cfg: Dict[str, Any], device: torch.device):
        self.rows, self.classes = shape
        g = torch.Generator().manual_seed(SEED + 7)
        self.device = device
        self.a = torch.randn(self.rows, cfg["dim"], generator=g).to(device, DTYPES[cfg["dtype"]])

    def time(self, head) -> float:
        w = head.weight.detach()[: self.classes]
        dz = torch.zeros(self.rows, min(self.classes, FLOOR_BLOCK), dtype=w.dtype, device=w.device)
        ga = torch.zeros(self.rows, w.shape[1], dtype=w.dtype, device=w.device)
        dist.barrier()
        _sync(self.device)
        t0 = time.perf_counter()
        for b0 in range(0, self.classes, FLOOR_BLOCK):
            w_b = w[b0 : b0 + FLOOR_BLOCK]
            dz_b = dz[:, : w_b.shape[0]]
            z = self.a @ w_b.t()
            ga += dz_b @ w_b
            gw = dz_b.t() @ self.a
            del z, gw
        _sync(self.device)
        dt = time.perf_counter() - t0
        del ga, dz
        return dt


#: steps per variant whose memory is measured (after at least one warm-up step)
MEMORY_STEPS = 2


def _warm_up(head, opt, after_backward, cfg, rank, device, count: int, label: str) -> None:
    for i in range(count):
        x, y = _inputs(cfg, rank, -1 - i, device)
        dist.barrier()
        t0 = time.perf_counter()
        train_step(head, opt, x, y, after_backward)
        _sync(device)
        _say(cfg, rank, f"{label}: warm-up {i + 1}/{count} {time.perf_counter() - t0:.3f} s")


def _release(device: torch.device) -> None:
    """Free what the last variant left (reference cycles included) before the next is built."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _measure(variant: str, cfg: Dict[str, Any], rank: int, device: torch.device) -> Dict[str, List[int]]:
    """Peak memory and traffic of ``min(MEMORY_STEPS, steps)`` steps after a warm-up."""
    from shardfc.parallel.collectives import count_comm

    mem = PeakMemory(device)
    rec: Dict[str, List[int]] = {"peak": [], "comm": []}
    _say(cfg, rank, f"{variant}: building (memory phase)")
    head, opt, after_backward, _ = _build(variant, cfg, device)
    _warm_up(head, opt, after_backward, cfg, rank, device, max(1, cfg["warmup"]), f"{variant} memory")
    for i in range(min(MEMORY_STEPS, cfg["steps"])):
        x, y = _inputs(cfg, rank, 10_000 + i, device)
        dist.barrier()
        mem.start()
        with count_comm() as counter:
            train_step(head, opt, x, y, after_backward)
        rec["peak"].append(mem.stop())
        rec["comm"].append(counter.total_bytes)
        _say(cfg, rank, f"{variant}: memory step {i + 1} peak {rec['peak'][-1] / 2**20:.1f} MiB (rank 0)")
    return rec


def _time(variant: str, cfg: Dict[str, Any], rank: int, device: torch.device) -> Dict[str, List[float]]:
    """Step times and matmul-floor times of ``steps`` steps after ``warmup`` steps."""
    rec: Dict[str, List[float]] = {"step_s": [], "floor_s": []}
    _say(cfg, rank, f"{variant}: building (timing phase)")
    head, opt, after_backward, shape = _build(variant, cfg, device)
    floor = _Floor(shape, cfg, device)
    floor.time(head)  # warm-up
    _warm_up(head, opt, after_backward, cfg, rank, device, cfg["warmup"], variant)
    for i in range(cfg["steps"]):
        x, y = _inputs(cfg, rank, i, device)
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        train_step(head, opt, x, y, after_backward)
        _sync(device)
        dt = time.perf_counter() - t0
        rec["step_s"].append(dt)
        rec["floor_s"].append(floor.time(head))  # right after the step: the same machine load
        _say(cfg, rank, f"{variant}: step {i + 1}/{cfg['steps']} {dt:.3f} s, matmul floor {rec['floor_s'][-1]:.3f} s (rank 0)")
    return rec


def _bench_worker(rank: int, world_size: int, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Phase 1 measures every variant's memory and traffic, phase 2 times every variant and its
    matmul floor. Each variant's head lives in one call of :func:`_measure` or :func:`_time` and
    is freed (:func:`_release`) before the next is built."""
    from shardfc.parallel.collectives import comm_device

    device = comm_device(None)
    recs: Dict[str, Dict[str, Any]] = {}
    for variant in cfg["variants"]:
        recs[variant] = _measure(variant, cfg, rank, device)
        _release(device)
    for variant in cfg["variants"]:
        recs[variant].update(_time(variant, cfg, rank, device))
        _release(device)
    return {"memory_measure": PeakMemory(device).measure, "variants": recs}


__all__ = ["FIELDS", "VARIANTS", "DEFAULT_CHUNK_SIZE", "run_bench", "parse_variants", "local_batch_sizes", "train_step"]
