"""``shardfc bench --peers``: the head side by side with the matmul floor and the field's fastest
implementations, in one process, on one rank's work.

One file by design: the systems (:data:`SYSTEMS`, one small builder each) and the loop that times
them share the workload, the setup and the row format, and a new peer is one builder and one
registry line here; the CLI (``peers_cli``) and the report (``peers_report``) are apart.

Workload: the gathered batch ``B`` (embeddings ``[B, D]``, fp32 leaves that require grad, as a
backbone hands them over), ``C`` local classes (fp32 centres ``[C, D]``), uniform labels. A *step*
of a system = forward + backward + SGD (momentum 0.9, weight decay 5e-4) on the class centres +
``zero_grad(set_to_none=False)`` (gradients stay allocated, as the bench does everywhere). The
compute runs under ``torch.autocast`` in ``dtype`` (bf16 by default; ``float32``: no autocast).

Rows (:data:`SYSTEMS`, in this order):

* ``floor``: the three matmuls of a step alone, ``x·Wᵀ``, ``dZ·W``, ``dZᵀ·x`` on the same shapes
  in the compute dtype (operands prepared outside the timing) — the floor the ratios divide by.
* ``shardfc-torch`` / ``shardfc-triton`` / ``shardfc-gemm``: :class:`shardfc.ShardedMarginHead`
  with ``impl="torch"`` / ``"triton"`` / ``"gemm"`` (:data:`shardfc.head.fused.IMPLS`) and the
  margin (ArcFace s=64 m=0.5 by default); an impl the head says cannot run here (its forward's
  ``ValueError("impl='<name>' cannot run: <why>")``) leaves its row unavailable with that reason.
  ``shardfc-auto``: ``impl="auto"``, the head's own choice (it times the candidates on the first
  forward, the check step's, and logs the table on logger ``shardfc.head``); the note says which
  impl it chose (``head.last_impl``). ``shardfc-fused-update``: the same with
  ``head_optimizer(..., fused_update=True)``, the SGD step applied in the backward (the note says
  whether it was: off CUDA the optimizer's step runs, as for the other rows). ``shardfc-chunked``: ``chunk_size="auto"``;
  ``shardfc-partial``: Partial FC at ``sample_rate`` (0.1). These two leave ``impl`` to the head
  (``auto``). Every shardfc row steps with :func:`shardfc.head_optimizer`, as training does.
* ``dense`` / ``dense-compile``: the plain dense head a user would write — normalise, full
  ``[B, C]`` logits, the margin at the target by the formula of :class:`shardfc.margins.ArcFace`,
  ``F.cross_entropy`` — eager and under ``torch.compile``.
* plain softmax (no margin, nothing normalised): ``softmax-shardfc-torch`` /
  ``softmax-shardfc-triton`` / ``softmax-shardfc-gemm`` (``margin=Softmax()``), ``softmax-dense``
  (``F.cross_entropy(x·Wᵀ)``), ``softmax-torch-lce`` (torch's own
  ``F.linear_cross_entropy``, ``options=None``: its default, ``linear`` then ``cross_entropy``),
  ``softmax-torch-lce-chunked`` (the same with ``LinearCrossEntropyOptions(batch_chunk_size=r)``:
  torch's chunked path, which chunks the *batch*, ``r`` rows at a time, never the classes; ``r`` from
  :func:`lce_batch_chunk`, the head's 64 MiB chunk budget; both on the CPU and CUDA, unavailable
  on a torch without them), ``softmax-cce`` (Cut Cross-Entropy's ``linear_cross_entropy``) and
  ``softmax-liger`` (Liger's ``LigerFusedLinearCrossEntropyLoss``), these two when installed
  (``pip install 'shardfc[peers]'``). The peers get their inputs cast to the compute dtype.

A system that cannot run keeps its row with the reason: ``unavailable`` (not installed, not in
this torch, needs CUDA, skipped on the CPU) or ``failed`` (its own error, out of memory).

Measures (per row):

* ``step_time_ms``: median of ``steps`` timed steps after a check step and ``warmup`` steps, each
  between two ``torch.cuda.synchronize()``;
* ``extra_memory_bytes``: on CUDA, the largest over the timed steps of ``max_memory_allocated``
  during the step minus ``memory_allocated`` before it; on the CPU, the step's peak of live tensor
  bytes (:class:`~shardfc.tools.bench.memory.PeakMemory`) in one extra step of its own;
* ``ratio_to_floor``: ``step_time_ms`` over the floor's;
* ``loss``: the loss of the check step — the first forward, on the same inputs and the same initial
  centres for every system — against ``reference_loss``, :func:`shardfc.reference_loss` on those
  inputs in float64 (float32 if float64 does not fit): ``loss_rel_err`` and ``loss_agrees`` (within
  :data:`LOSS_RTOL` of the compute dtype). Partial FC samples the negatives, so its loss is not
  compared.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from shardfc.checks import check_int, check_names, check_positive_int, check_probability
from shardfc.tools.bench.memory import PeakMemory

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: margins the dense peer writes plainly (normalised embeddings and centres, no feature norm)
MARGINS = ("arcface", "cosface", "combined", "normsoftmax")
#: relative tolerance of a row's loss against the float64 reference, by compute dtype
LOSS_RTOL = {"float32": 1e-3, "bfloat16": 2e-2, "float16": 2e-2}
LR = 0.1
MOMENTUM = 0.9
WEIGHT_DECAY = 5e-4
SEED = 1234
#: the fields of a row, in order (the JSON's rows hold exactly these)
ROW_FIELDS = (
    "system", "label", "group", "status", "reason", "step_time_ms", "step_times_ms", "ratio_to_floor",
    "extra_memory_bytes", "loss", "reference_loss", "loss_rel_err", "loss_agrees", "note",
)
NEEDS_CUDA = "needs CUDA (or TRITON_INTERPRET=1)"


@dataclass(frozen=True)
class System:
    label: str
    group: str  # "floor", "margin" or "softmax": which reference its loss is held to
    build: Callable[["Workload", "Setup"], "Built"]


class Unavailable(Exception):
    """A system that cannot run here; the message is the row's reason."""


@dataclass
class Built:
    step: Callable[[torch.Tensor, torch.Tensor], Optional[torch.Tensor]]  # one step; the loss (detached) or None
    note: str = ""
    comparable: bool = True  # whether its loss is the dense reference's
    ran: Optional[Callable[[], str]] = None  # after the check step: a note on what actually ran


@dataclass(frozen=True)
class Workload:
    batch: int
    dim: int
    classes: int
    dtype: str = "bfloat16"
    margin: str = "arcface"
    sample_rate: float = 0.1
    chunk_size: Union[int, str] = "auto"
    steps: int = 10
    warmup: int = 3
    device: str = "cpu"


@dataclass
class Setup:
    """What every system shares: the device, the initial centres and the inputs of each step."""

    device: torch.device
    weight0: torch.Tensor  # [C, D] fp32, the initial centres of every system
    inputs: List[Tuple[torch.Tensor, torch.Tensor]]  # one (x, y) per step; inputs[0] is the check step's


# --------------------------------------------------------------------------- the step
def _autocast(wl: Workload, device: torch.device):
    if wl.dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[wl.dtype])


def _training_step(wl: Workload, device: torch.device, loss_fn, optimizer):
    """forward (autocast) + backward + SGD + zero_grad(set_to_none=False), as one callable."""

    def step(x, y):
        with _autocast(wl, device):
            loss = loss_fn(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        x.grad = None
        return loss.detach()

    return step


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)


def _centres(setup: Setup) -> torch.nn.Parameter:
    return torch.nn.Parameter(setup.weight0.clone())


# --------------------------------------------------------------------------- systems
def _build_floor(wl: Workload, setup: Setup) -> Built:
    cdt = DTYPES[wl.dtype]
    g = torch.Generator(device=setup.device).manual_seed(SEED + 7)
    x = setup.inputs[0][0].detach().to(cdt)
    w = setup.weight0.to(cdt)
    dz = torch.randn(wl.batch, wl.classes, generator=g, device=setup.device).to(cdt)

    def step(_x, _y):
        z = x @ w.t()
        dx = dz @ w
        dw = dz.t() @ x
        del z, dx, dw
        return None

    return Built(step, note=f"{wl.dtype} operands made outside the timing", comparable=False)


@contextlib.contextmanager
def centres_from(weight0: torch.Tensor):
    """Heads built inside start from (a copy of) the rows of ``weight0``, on its device, instead of
    drawing their own ``N(0, 0.01²)`` rows (:func:`shardfc.head.module.init_rows`): at a million
    classes that draw takes seconds per head on the CPU, and every row starts from ``weight0`` anyway."""
    from shardfc.head import module

    original = module.init_rows

    def rows(start: int, stop: int, dim: int, seed: int, device=None) -> torch.Tensor:
        if dim == weight0.shape[1] and 0 <= start <= stop <= weight0.shape[0]:
            return weight0[start:stop].clone()
        return original(start, stop, dim, seed, device=device)

    module.init_rows = rows
    try:
        yield
    finally:
        module.init_rows = original


def _impl_unavailable(e: ValueError, impl: Optional[str], device: torch.device) -> Optional[str]:
    """The row's reason when ``e`` is the head's "impl='<name>' cannot run: <why>" (None when it is
    another error): :data:`NEEDS_CUDA` for a CUDA-only impl on another device, else the head's own words."""
    text = str(e)
    if impl is None or f"impl={impl!r} cannot run" not in text:
        return None
    return NEEDS_CUDA if device.type != "cuda" and "CUDA" in text else text


def _shardfc(margin_name: Optional[str], impl: Optional[str], options: Optional[Callable[[Workload], Dict[str, Any]]] = None,
             fused_update: bool = False) -> Callable[[Workload, Setup], Built]:
    """A shardfc row: ``margin_name`` (None: the workload's margin), ``impl`` (None: the head's
    default), the head's ``options`` for the workload, and whether the head's backward applies
    the SGD step (``head_optimizer(..., fused_update=True)``; its note says whether it did).

    An explicit ``impl`` that cannot run here is the head's to say: its forward raises
    ``ValueError("impl='<name>' cannot run: <why>")`` before anything changes state, and the row
    becomes unavailable with that reason (:func:`_impl_unavailable`), whatever the impl."""

    def build(wl: Workload, setup: Setup) -> Built:
        from shardfc.head.margins import build_margin
        from shardfc.head.module import ShardedMarginHead
        from shardfc.head.partial_fc import head_optimizer
        from shardfc.parallel.context import DistContext

        name = wl.margin if margin_name is None else margin_name
        opts = options(wl) if options else {}
        kwargs = dict(margin=build_margin(name), context=DistContext(device=setup.device), dtype=torch.float32, **opts)
        note = ""
        if impl is not None:
            kwargs["impl"] = impl
        with centres_from(setup.weight0):
            head = ShardedMarginHead(wl.dim, wl.classes, **kwargs)
        with torch.no_grad():
            head.weight.copy_(setup.weight0)
        opt = head_optimizer(head, "sgd", lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, fused_update=fused_update)
        comparable = opts.get("sample_rate", 1.0) >= 1.0
        if not comparable:
            note = "; ".join(filter(None, [note, "loss not compared: Partial FC samples the negatives"]))

        def loss_fn(x, y):
            try:
                return head(x, y)
            except ValueError as e:  # the head's "impl='<name>' cannot run: <why>"
                reason = _impl_unavailable(e, impl, setup.device)
                if reason is not None:
                    raise Unavailable(reason) from None
                raise

        def ran() -> str:  # which path the head took
            last = head.last_impl
            if impl == "auto":
                text = f"auto chose impl={last}"
            else:
                text = f"ran impl={last}" if impl in (None, last) else f"**asked impl={impl}, ran impl={last}**"
            if fused_update:
                text += "; update fused into the backward" if head.last_update == "fused" else f"; {head.last_update}"
            return text

        return Built(_training_step(wl, setup.device, loss_fn, opt), note=note, comparable=comparable, ran=ran)

    return build


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """Low-precision logits (autocast's) in fp32 for the softmax; fp32/fp64 as they are."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def dense_margin_loss(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, margin) -> torch.Tensor:
    """The plain dense margin loss: normalise, full ``[B, C]`` logits, the margin at the target, cross-entropy.

    ArcFace written out as :class:`shardfc.margins.ArcFace` defines it (``s·cos(θ+m)``, and
    ``s·(cos θ − m·sin m)`` past ``θ > π − m``); the other normalised margins through their ``target``."""
    from shardfc.head import margins as M

    cos = _at_least_fp32(F.normalize(x, dim=1) @ F.normalize(w, dim=1).t())
    c = cos.gather(1, y[:, None]).squeeze(1).clamp(-1.0, 1.0)
    if isinstance(margin, M.ArcFace):
        s, m = margin.s, margin.m
        sin = torch.sqrt(torch.clamp(1.0 - c * c, min=torch.finfo(c.dtype).eps))
        phi = c * math.cos(m) - sin * math.sin(m)
        if margin.easy_margin:
            phi = torch.where(c <= 0, c, phi)
        else:
            phi = torch.where(c < math.cos(math.pi - m), c - m * math.sin(m), phi)
        target = s * phi
    else:
        target = margin.target(c)[0]
    logits = (cos * margin.scale).scatter(1, y[:, None], target[:, None])
    return F.cross_entropy(logits, y)


def dense_softmax_loss(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Plain softmax cross-entropy over the full ``[B, C]`` logits ``x·Wᵀ``."""
    return F.cross_entropy(_at_least_fp32(x @ w.t()), y)


def _dense(softmax: bool, compiled: bool) -> Callable[[Workload, Setup], Built]:
    def build(wl: Workload, setup: Setup) -> Built:
        from shardfc.head.margins import build_margin

        if compiled and setup.device.type != "cuda":
            raise Unavailable("skipped on the CPU: torch.compile's C++ build is too slow for a CPU check (run on CUDA)")
        w = _centres(setup)
        if softmax:
            def loss_fn(x, y):
                return dense_softmax_loss(x, w, y)
        else:
            margin = build_margin(wl.margin)

            def loss_fn(x, y):
                return dense_margin_loss(x, w, y, margin)
        if compiled:
            loss_fn = torch.compile(loss_fn)
        return Built(_training_step(wl, setup.device, loss_fn, _sgd([w])))

    return build


def _cast(wl: Workload, t: torch.Tensor) -> torch.Tensor:
    return t if wl.dtype == "float32" else t.to(DTYPES[wl.dtype])


def _peer_import(what: Callable[[], Any], package: str):
    try:
        return what()
    except ImportError as e:
        raise Unavailable(f"not installed: {package} (pip install {package}, or 'shardfc[peers]'; {e})") from None
    except Exception as e:  # an installed package that fails to import: say how
        raise Unavailable(f"{package} does not import: {type(e).__name__}: {e}") from None


def _build_cce(wl: Workload, setup: Setup) -> Built:
    def load():
        from cut_cross_entropy import linear_cross_entropy

        return linear_cross_entropy

    lce = _peer_import(load, "cut-cross-entropy")
    if setup.device.type != "cuda":
        raise Unavailable("needs CUDA")
    w = _centres(setup)

    def loss_fn(x, y):
        return lce(_cast(wl, x), _cast(wl, w), y)

    return Built(_training_step(wl, setup.device, loss_fn, _sgd([w])), note="inputs cast to the compute dtype")


def _build_liger(wl: Workload, setup: Setup) -> Built:
    def load():
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        return LigerFusedLinearCrossEntropyLoss

    cls = _peer_import(load, "liger-kernel")
    if setup.device.type != "cuda":
        raise Unavailable("needs CUDA")
    w = _centres(setup)
    flce = cls()

    def loss_fn(x, y):
        return flce(_cast(wl, w), _cast(wl, x), y)

    return Built(_training_step(wl, setup.device, loss_fn, _sgd([w])), note="inputs cast to the compute dtype")


#: the activation budget of ``softmax-torch-lce-chunked``'s batch chunks: the head's default
#: ``chunk_budget_bytes`` (what ``shardfc-chunked`` spends on its class chunks), at the head's 8 bytes
#: per logit (fp32 plus a low-precision copy)
LCE_CHUNK_BUDGET_BYTES = 64 * 2**20


def lce_batch_chunk(batch: int, classes: int) -> int:
    """Rows per batch chunk of ``softmax-torch-lce-chunked``: the most whose ``[rows, C]`` logits fit
    :data:`LCE_CHUNK_BUDGET_BYTES` at 8 bytes each (at least 1, at most ``batch``)."""
    return max(1, min(batch, LCE_CHUNK_BUDGET_BYTES // (8 * classes)))


def _torch_lce(chunked: bool) -> Callable[[Workload, Setup], Built]:
    """torch's own ``F.linear_cross_entropy``: ``options=None`` (its default: ``linear`` then
    ``cross_entropy``, the full ``[B, C]`` logits) or, ``chunked``, its chunked path with
    ``LinearCrossEntropyOptions(batch_chunk_size=`` :func:`lce_batch_chunk` ``)`` — torch chunks the
    batch, not the classes."""

    def build(wl: Workload, setup: Setup) -> Built:
        lce = getattr(F, "linear_cross_entropy", None)
        if lce is None:
            raise Unavailable(f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy")
        options, note = None, "options=None"
        if chunked:
            opts_cls = getattr(torch.nn, "LinearCrossEntropyOptions", None)
            if opts_cls is None:
                raise Unavailable(f"torch {torch.__version__} has no torch.nn.LinearCrossEntropyOptions")
            rows = lce_batch_chunk(wl.batch, wl.classes)
            options = opts_cls(batch_chunk_size=rows)
            note = (f"options=LinearCrossEntropyOptions(batch_chunk_size={rows}): {math.ceil(wl.batch / rows)} "
                    f"batch chunk(s) of [{rows}, C] logits")
            if setup.device.type != "cuda":  # the dispatch-mode count sees the op's outputs, not its loop
                note += f"; CPU memory leaves out the [{rows}, C] buffers of each chunk (inside one custom op)"
        w = _centres(setup)

        def loss_fn(x, y):
            return lce(_cast(wl, x), _cast(wl, w), y, options=options)

        cast = "" if wl.dtype == "float32" else "inputs cast to the compute dtype"
        return Built(_training_step(wl, setup.device, loss_fn, _sgd([w])), note="; ".join(filter(None, [note, cast])))

    return build


#: every row of the bench, in order (name -> System)
SYSTEMS: Dict[str, System] = {
    "floor": System("matmul floor: x·Wᵀ, dZ·W, dZᵀ·x", "floor", _build_floor),
    "shardfc-torch": System("shardfc, impl=torch", "margin", _shardfc(None, "torch")),
    "shardfc-triton": System("shardfc, impl=triton", "margin", _shardfc(None, "triton")),
    "shardfc-gemm": System("shardfc, impl=gemm", "margin", _shardfc(None, "gemm")),
    "shardfc-auto": System("shardfc, impl=auto", "margin", _shardfc(None, "auto")),
    "shardfc-fused-update": System("shardfc, impl=auto, SGD step in the backward", "margin",
                                   _shardfc(None, "auto", fused_update=True)),
    "shardfc-chunked": System("shardfc, chunk_size=auto", "margin", _shardfc(None, None, lambda wl: {"chunk_size": wl.chunk_size})),
    "shardfc-partial": System("shardfc, Partial FC", "margin", _shardfc(None, None, lambda wl: {"sample_rate": wl.sample_rate})),
    "dense": System("plain torch dense, eager", "margin", _dense(softmax=False, compiled=False)),
    "dense-compile": System("plain torch dense, torch.compile", "margin", _dense(softmax=False, compiled=True)),
    "softmax-shardfc-torch": System("softmax: shardfc, impl=torch", "softmax", _shardfc("softmax", "torch")),
    "softmax-shardfc-triton": System("softmax: shardfc, impl=triton", "softmax", _shardfc("softmax", "triton")),
    "softmax-shardfc-gemm": System("softmax: shardfc, impl=gemm", "softmax", _shardfc("softmax", "gemm")),
    "softmax-dense": System("softmax: plain torch dense, eager", "softmax", _dense(softmax=True, compiled=False)),
    "softmax-torch-lce": System("softmax: torch linear_cross_entropy", "softmax", _torch_lce(chunked=False)),
    "softmax-torch-lce-chunked": System("softmax: torch linear_cross_entropy, batch-chunked", "softmax",
                                        _torch_lce(chunked=True)),
    "softmax-cce": System("softmax: Cut Cross-Entropy", "softmax", _build_cce),
    "softmax-liger": System("softmax: Liger fused linear cross-entropy", "softmax", _build_liger),
}


# --------------------------------------------------------------------------- arguments
def parse_systems(systems: Union[None, str, Sequence[str]]) -> List[str]:
    """``None`` (all), ``"a,b"`` or ``["a", "b"]`` -> checked list, in the order of :data:`SYSTEMS`."""
    if systems is None:
        return list(SYSTEMS)
    names = check_names("systems", systems, list(SYSTEMS))
    return [s for s in SYSTEMS if s in names]


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when available, else ``cpu``; ``cuda`` without CUDA is an error."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device 'cuda': CUDA is not available here (torch {torch.__version__}, "
                         f"built with CUDA {torch.version.cuda}); use --device cpu for a small check")
    return device


def check_workload(batch, dim, classes, dtype="bfloat16", margin="arcface", sample_rate=0.1, chunk_size="auto",
                   steps=10, warmup=3, device="auto") -> Workload:
    """A :class:`Workload` from checked arguments; a bad one raises ``ValueError`` naming it."""
    check_positive_int("batch", batch)
    check_positive_int("dim", dim)
    check_positive_int("classes", classes)
    check_int("steps", steps, 1)
    check_int("warmup", warmup, 0)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    key = str(margin).lower()
    if key not in MARGINS:
        raise ValueError(f"margin must be one of {', '.join(MARGINS)} (normalised, no feature norm: what the dense "
                         f"peer writes plainly), got {margin!r}")
    sample_rate = check_probability("sample_rate", sample_rate, low_open=True, high_open=False)
    if chunk_size != "auto":
        check_positive_int("chunk_size", chunk_size)
    return Workload(batch, dim, classes, dtype, key, sample_rate, chunk_size, steps, warmup, resolve_device(device))


# --------------------------------------------------------------------------- running
def environment(device: torch.device) -> Dict[str, Any]:
    """What the figures were measured on: the device (the GPU's name), torch, CUDA and triton versions."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # not installed, or broken: say so rather than fail the bench
        triton_version = None
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "device": gpu if gpu else "cpu",
        "device_type": device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _is_oom(e: BaseException) -> bool:
    oom = getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom is not None and isinstance(e, oom)) or "out of memory" in str(e).lower()


def _reason(e: BaseException) -> str:
    text = " ".join(str(e).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return ("out of memory: " if _is_oom(e) else f"{type(e).__name__}: ") + text


def _setup(wl: Workload) -> Setup:
    from shardfc.head.module import INIT_STD

    device = torch.device(wl.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=device).manual_seed(SEED)
    weight0 = torch.randn(wl.classes, wl.dim, generator=g, device=device).mul_(INIT_STD)  # the heads' N(0, 0.01²)
    count = 1 + wl.warmup + wl.steps + 1  # check step, warm-up, timed, a memory step (CPU)
    inputs = []
    for _ in range(count):
        x = torch.randn(wl.batch, wl.dim, generator=g, device=device).requires_grad_(True)
        y = torch.randint(0, wl.classes, (wl.batch,), generator=g, device=device)
        inputs.append((x, y))
    return Setup(device, weight0, inputs)


def reference_losses(wl: Workload, setup: Setup, group: str) -> Tuple[Optional[float], str]:
    """:func:`shardfc.reference_loss` on the check step's inputs and the initial centres: float64,
    else float32 if float64 does not fit; ``(loss, how)``."""
    from shardfc.head.margins import Softmax, build_margin
    from shardfc.head.reference import reference_loss

    margin = Softmax() if group == "softmax" else build_margin(wl.margin)
    x, y = setup.inputs[0]
    failure = ""
    for dt in (torch.float64, torch.float32):
        try:
            with torch.no_grad():
                value = float(reference_loss(x.detach().to(dt), setup.weight0.to(dt), y, margin))
            return value, f"reference in {str(dt).replace('torch.', '')}"
        except RuntimeError as e:
            failure = _reason(e)
        _release(setup.device)
    return None, f"no reference: {failure}"


def _blank_row(name: str) -> Dict[str, Any]:
    s = SYSTEMS[name]
    return {k: None for k in ROW_FIELDS} | {"system": name, "label": s.label, "group": s.group, "note": ""}


def _say(progress: bool, text: str) -> None:
    if progress:
        print(f"[peers] {text}", file=sys.stderr, flush=True)


def _run_system(name: str, wl: Workload, setup: Setup, progress: bool) -> Dict[str, Any]:
    row = _blank_row(name)
    device = setup.device
    built = None
    try:
        built = SYSTEMS[name].build(wl, setup)
        row["note"] = built.note
        steps = setup.inputs
        t0 = time.perf_counter()
        loss = built.step(*steps[0])  # the check step: initial centres, the reference's inputs
        _sync(device)
        if loss is not None:
            row["loss"] = float(loss)
        if built.ran is not None:
            row["note"] = "; ".join(filter(None, [built.ran(), row["note"]]))
        _say(progress, f"{name}: check step {time.perf_counter() - t0:.3f} s" +
             ("" if loss is None else f", loss {row['loss']:.6g}"))
        for i in range(wl.warmup):
            built.step(*steps[1 + i])
        _sync(device)
        mem = PeakMemory(device)
        cuda = device.type == "cuda"
        times, peaks = [], []
        for i in range(wl.steps):
            x, y = steps[1 + wl.warmup + i]
            if cuda:
                mem.start()
            _sync(device)
            t0 = time.perf_counter()
            built.step(x, y)
            _sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
            if cuda:
                peaks.append(mem.stop())
        if not cuda:  # the live-tensor counter slows operators down: a step of its own
            mem.start()
            try:
                built.step(*steps[-1])
            finally:
                peaks.append(mem.stop())
        row.update(status="ok", step_times_ms=times, step_time_ms=statistics.median(times),
                   extra_memory_bytes=int(max(peaks)))
        _say(progress, f"{name}: {row['step_time_ms']:.3f} ms per step, {row['extra_memory_bytes'] / 2**20:.1f} MiB extra")
    except Unavailable as e:
        row.update(status="unavailable", reason=str(e))
        _say(progress, f"{name}: unavailable: {e}")
    except Exception as e:  # the system's own error, or out of memory: its row says which
        row.update(status="failed", reason=_reason(e), step_time_ms=None, step_times_ms=None, extra_memory_bytes=None)
        _say(progress, f"{name}: failed: {row['reason']}")
    if built is not None and not built.comparable:
        row["loss_agrees"] = None
    row["_comparable"] = built is not None and built.comparable
    del built
    if name == "dense-compile" and row["status"] != "unavailable":
        torch._dynamo.reset()
    if row["status"] != "unavailable" or device.type == "cuda":  # what a row built goes before the next
        _release(device)
    return row


def run_peers(
    batch: int,
    dim: int,
    classes: int,
    systems: Union[None, str, Sequence[str]] = None,
    dtype: str = "bfloat16",
    margin: Optional[str] = None,
    sample_rate: Optional[float] = None,
    chunk_size: Union[int, str, None] = None,
    steps: int = 10,
    warmup: int = 3,
    device: str = "auto",
    progress: bool = True,
) -> Dict[str, Any]:
    """Run the rows of ``systems`` (default: all) one after another in this process.

    Returns one object: ``workload`` (the checked arguments), ``environment`` (device and GPU
    name, torch, CUDA and triton versions), ``memory_measure``, ``loss_rtol``, ``references``
    (group -> reference loss and how it was computed) and ``rows`` (one dict per system with exactly
    :data:`ROW_FIELDS`). Bad arguments raise ``ValueError`` naming the argument before anything runs,
    as do ``margin`` (default ``"arcface"``), ``sample_rate`` (default 0.1) and ``chunk_size`` (default
    ``"auto"``) given without a system that reads them (a margin row; ``shardfc-partial``;
    ``shardfc-chunked``).
    """
    names = parse_systems(systems)
    margin_rows = [n for n in names if SYSTEMS[n].group == "margin"]
    for given, name, readers, rows in (
        (margin, "margin", margin_rows, "margin rows (the systems not named softmax-* or floor)"),
        (sample_rate, "sample_rate", [n for n in names if n == "shardfc-partial"], "shardfc-partial row"),
        (chunk_size, "chunk_size", [n for n in names if n == "shardfc-chunked"], "shardfc-chunked row"),
    ):
        if given is not None and not readers:  # a setting no row reads would be dropped silently
            raise ValueError(f"{name}={given!r} applies to the {rows}, not to systems {names}")
    margin = "arcface" if margin is None else margin
    sample_rate = 0.1 if sample_rate is None else sample_rate
    chunk_size = "auto" if chunk_size is None else chunk_size
    wl = check_workload(batch, dim, classes, dtype, margin, sample_rate, chunk_size, steps, warmup, device)
    dev = torch.device(wl.device)
    env = environment(dev)
    _say(progress, f"{env['device']}, torch {env['torch']}, triton {env['triton']}: B={wl.batch} D={wl.dim} "
                   f"C={wl.classes} {wl.dtype}, {wl.warmup} warm-up + {wl.steps} timed steps")
    setup = _setup(wl)
    rows = []
    for name in names:
        rows.append(_run_system(name, wl, setup, progress))
    references: Dict[str, Dict[str, Any]] = {}
    rtol = LOSS_RTOL[wl.dtype]
    for row in rows:
        comparable = row.pop("_comparable")
        if row["loss"] is None or not comparable:
            continue
        group = row["group"]
        if group not in references:
            value, how = reference_losses(wl, setup, group)
            references[group] = {"loss": value, "how": how}
        ref = references[group]["loss"]
        if ref is None:
            row["note"] = "; ".join(filter(None, [row["note"], references[group]["how"]]))
            continue
        err = abs(row["loss"] - ref) / max(abs(ref), 1e-12)
        row.update(reference_loss=ref, loss_rel_err=err, loss_agrees=bool(err <= rtol))
    floor = next((r for r in rows if r["system"] == "floor" and r["status"] == "ok"), None)
    if floor is not None and floor["step_time_ms"] > 0:
        for row in rows:
            if row["status"] == "ok":
                row["ratio_to_floor"] = row["step_time_ms"] / floor["step_time_ms"]
    return {
        "workload": asdict(wl),
        "environment": env,
        "memory_measure": PeakMemory(dev).measure,
        "loss_rtol": rtol,
        "references": references,
        "rows": [{k: r[k] for k in ROW_FIELDS} for r in rows],
    }


def failures(result: Dict[str, Any]) -> List[str]:
    """The rows that failed or whose loss disagrees with the reference, one line each (empty: none)."""
    out = []
    for r in result["rows"]:
        if r["status"] == "failed":
            out.append(f"{r['system']}: {r['reason']}")
        elif r["loss_agrees"] is False:
            out.append(f"{r['system']}: loss {r['loss']:.6g} vs reference {r['reference_loss']:.6g} "
                       f"(relative error {r['loss_rel_err']:.2e} > {result['loss_rtol']:g})")
    return out


__all__ = [
    "DTYPES", "LCE_CHUNK_BUDGET_BYTES", "LOSS_RTOL", "MARGINS", "ROW_FIELDS", "SYSTEMS", "Workload", "check_workload",
    "dense_margin_loss", "dense_softmax_loss", "environment", "failures", "lce_batch_chunk", "parse_systems",
    "resolve_device", "run_peers",
]
