"""``shardfc bench --trainer``: the trainer measured against its own ceiling, in one process.

Every other argument is a ``shardfc train`` flag (``--preset``, ``--config``, ``--dataset``,
``--backbone``, ...), so the bench measures exactly the step a run of those flags takes, on one
process (one device: the rates are per GPU, or per CPU process)::

    shardfc bench --trainer --steps 30                        # the default run (synthetic, tiny, 32x32)
    shardfc bench --trainer --pool-size 16384                 # a bigger pool of pre-rendered images
    shardfc bench --trainer --no-pool --num-workers 4         # the synthetic renderer feeds the loader
    shardfc bench --trainer --dataset recordio --data-root DIR --backbone iresnet50 --batch-size 128 \\
        --num-workers 8

**What feeds the trainer.** On the synthetic set (the default dataset), by default a pool of
:data:`DEFAULT_POOL_SIZE` of its images rendered once, in memory, as uint8
(:class:`~shardfc.data.SyntheticPool`: the set's length, classes and labels, batch for batch, the
pixels repeating): the loader can feed any rate, so the bench measures the trainer, not the
renderer (which fed 1,949 images/s with 4 workers on an H200's host, below the step's ceiling of
2,807: the trainer reached 0.52 of it).
The pool goes through the run's own data path: the DataLoader and its ``--num-workers`` worker
processes, the prefetcher, the normalisation on the device. It is rendered before the start-up's
clock starts (the bench's way of feeding, no part of a run's start-up) and described in the
report: its images, its bytes, its rendering time. ``--no-pool`` feeds the loader from the renderer, per sample, as
``shardfc train`` does; the other datasets ('recordio', 'folder', ...) are always read by their own
loader. Each source's loader-only rate is reported: the run's own, and with the pool the
renderer's beside it (the loader column).

What it runs, after building the run as ``shardfc train`` does (:func:`~shardfc.train.builder.factory.build_run`):

1. **start-up**: from the start of the build to the end of the first real step, phase by phase
   (:class:`~shardfc.train.observe.profile.StartupClock`, what ``--profile`` logs), and by what it
   went to (:func:`startup_split`: data, build, the first step's compile and autotune
   (:class:`StartupCosts`), the rest of the first step); then the **first evaluation** of the run's
   targets, timed apart (the loop pays it at its first evaluation, not before its first step);
2. **train**: ``--warmup`` then ``--steps`` steps of the loop's own step
   (:func:`~shardfc.train.loop.trainer_step`: the stop agreement, :func:`~shardfc.train.step.train_step`,
   the counters and a report at each log point, logged to nowhere) on the real stream
   (:func:`~shardfc.train.loader.data.micro_batches`: loader workers, prefetcher, device-side
   normalisation), with the GPU's utilisation sampled meanwhile (NVML through ``pynvml``; "n/a" on
   the CPU or without it);
3. **ceiling**: the bare step (:func:`~shardfc.train.step.train_step`) on one batch of random
   tensors resident on the device (no loader, no copy), in the run's memory format and precision;
   its steps alternate with the train steps in up to 5 blocks, so that a drifting load (a shared
   machine) weighs on both alike;
4. **phases**: ``--steps`` more train steps split into the phases of
   :mod:`~shardfc.train.observe.phases` (loader wait, h2d, forward, head, backward, optimizer,
   logging/metrics, stop agreement), each followed by a ceiling step split alike; apart from the
   timed blocks, since on a GPU each phase's end synchronises the device;
5. **loader only**: the same stream drained without training, the batches already queued by the
   workers left out first, so the rate is what the loader sustains;
6. **the loader column** (datasets 'recordio' and 'folder'): the loader alone again for the torch
   loader with 0, 2 and N workers and for DALI (``--loader dali``, N threads: decoding on the GPU on
   CUDA, on the CPU otherwise) when installed, each a fresh stream past its start-up batches; with
   the pool, the synthetic renderer with the run's workers, the rate the pool stands in for.

Images/s count the images each step trains on (``batch_size x grad_accum``). The train rate over
the ceiling is what the data path costs; the loader-only rate over the train rate is its headroom.
The phases say where a train step's time goes, and how much of it is spent outside the data path
and the bare step.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from shardfc.outputs import check_outputs, write_atomically

__all__ = ["bench_trainer", "format_report", "main"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Utilisation:
    """The GPU's utilisation (%) sampled every 0.1 s in a thread while the ``with`` runs; None where
    it cannot be read (the CPU, or no ``pynvml``)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.samples, self.why = device, [], ""
        self._stop, self._paused = threading.Event(), threading.Event()
        self._read = None
        if device.type != "cuda":
            self.why = "the CPU"
            return
        try:
            torch.cuda.utilization(device)
            self._read = lambda: torch.cuda.utilization(device)
        except Exception as e:  # no pynvml / NVML: say so, measure the rest
            self.why = f"{type(e).__name__}: {e}"

    def __enter__(self):
        if self._read is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            if not self._paused.is_set():
                self.samples.append(float(self._read()))

    def pause(self) -> None:
        """Stop sampling until :meth:`resume` (the ceiling's steps are not the train steps)."""
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    def __exit__(self, *exc) -> None:
        if self._read is not None:
            self._stop.set()
            self._thread.join()

    @property
    def mean(self) -> Optional[float]:
        return sum(self.samples) / len(self.samples) if self.samples else None


def _timed(device: torch.device, steps: int, step) -> float:
    """Seconds for ``steps`` calls of ``step()`` (device synchronised at both ends)."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return time.perf_counter() - start


#: The pool's images by default: enough that an image repeats once in about 4,096 samples, small
#: enough to render in seconds (4 workers at 112x112) and to hold (154 MB of uint8 at 112x112).
DEFAULT_POOL_SIZE = 4096
#: The most memory the pool may take: its size sets how often an image repeats, not how fast the
#: loader feeds, so a pool past this bound buys nothing a bench needs.
MAX_POOL_BYTES = 8 * 2**30
#: The start-up phases (:func:`~shardfc.train.builder.factory.build_run`'s marks and the bench's)
#: that get the data ready: the dataset, its sampler, the loader's start and first batch.
DATA_PHASES = ("dataset", "sampler", "first batch")


class StartupCosts:
    """Seconds spent inside the ``with`` compiling and autotuning.

    ``compile_s``: TorchDynamo's compilations (``torch.compile``: graph capture and the backend's
    code generation, a lazily compiled backward included), timed between the compile callbacks
    torch runs at the start and the end of each outermost compilation; None where this torch has
    none. ``autotune_s``: the head's ``impl="auto"`` timing of its candidates
    (:meth:`~shardfc.head.impl_select.ImplSelector.choose` of the process's selector), during which
    Triton's autotuner tunes the fused forward under the run's key; a choice read from the cache
    file costs nothing here, and Triton's tuning then falls in the rest of the first step.
    The selector is watched by a wrapper on its instance, removed at the end: the head's code
    knows nothing of the bench.
    """

    def __init__(self) -> None:
        self.compile_s: Optional[float] = None
        self.autotune_s = 0.0

    def __enter__(self) -> "StartupCosts":
        from shardfc.head import impl_select

        try:
            from torch._dynamo.callback import callback_handler
        except ImportError:  # a torch without compile callbacks: compile_s stays None ("n/a")
            self._handler = None
        else:
            self.compile_s, began = 0.0, []

            def start(*_) -> None:  # the callbacks take a CallbackArgs on torch >= 2.6, nothing before
                began.append(time.perf_counter())

            def end(*_) -> None:
                if began:
                    self.compile_s += time.perf_counter() - began.pop()

            self._handler, self._callbacks = callback_handler, (start, end)
            callback_handler.register_start_callback(start)
            callback_handler.register_end_callback(end)
        self._selector = impl_select.default_selector()
        choose = self._selector.choose

        def timed_choose(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return choose(*args, **kwargs)
            finally:
                self.autotune_s += time.perf_counter() - t0

        self._selector.choose = timed_choose
        return self

    def __exit__(self, *exc) -> None:
        vars(self._selector).pop("choose", None)  # the class's method again
        if self._handler is not None:
            start, end = self._callbacks
            self._handler.remove_start_callback(start)
            self._handler.remove_end_callback(end)


def startup_split(phases: List[Tuple[str, float]], costs: StartupCosts) -> Dict[str, Optional[float]]:
    """The start-up to the end of the first step by what it went to: ``data`` (:data:`DATA_PHASES`),
    ``build`` (threads, model, head and optimizers), then the first step's ``compile`` and
    ``autotune`` (``costs``, measured within it) and the ``rest of the first step`` (its own work:
    the first kernels' set-up, the allocator's growth, the step itself). The values add up to the
    start-up (a None compile counts as 0)."""
    data = sum(s for name, s in phases if name in DATA_PHASES)
    first = sum(s for name, s in phases if name == "first step")
    build = sum(s for name, s in phases if name not in DATA_PHASES and name != "first step")
    return {"data": data, "build": build, "compile": costs.compile_s, "autotune": costs.autotune_s,
            "rest of the first step": first - (costs.compile_s or 0.0) - costs.autotune_s}


def resolve_pool_size(cfg, pool_size: Union[int, str, None]) -> Optional[int]:
    """The pool's size for ``cfg``: ``"auto"`` is :data:`DEFAULT_POOL_SIZE` on the synthetic set and
    no pool on the others (their loader is what is asked for); None is no pool (the synthetic set
    rendered by the loader, as ``shardfc train`` does). Raises a ConfigError naming a bad value."""
    from shardfc.train.builder.factory import resolve_image_size
    from shardfc.train.config import ConfigError

    if pool_size is None:
        return None
    if pool_size == "auto":
        return DEFAULT_POOL_SIZE if cfg.dataset == "synthetic" else None
    if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 1:
        raise ConfigError(f"--pool-size must be an int >= 1 (or --no-pool: the renderer feeds the loader), "
                          f"got {pool_size!r}")
    if cfg.dataset != "synthetic":
        raise ConfigError(f"--pool-size {pool_size} pre-renders the synthetic set, but --dataset {cfg.dataset} is "
                          f"read by its own loader: leave --pool-size out")
    h, w = resolve_image_size(cfg)
    images = min(pool_size, cfg.synthetic_identities * cfg.synthetic_images_per_identity)  # SyntheticPool's cap
    if images * 3 * h * w > MAX_POOL_BYTES:
        raise ConfigError(f"--pool-size {pool_size} at {h}x{w} is {images * 3 * h * w / 2**30:.1f} GiB of uint8 images, "
                          f"over the bench's bound of {MAX_POOL_BYTES / 2**30:.0f} GiB: a smaller pool feeds the "
                          f"trainer as fast (its size only sets how often an image repeats)")
    return pool_size


def bench_trainer(cfg, steps: int = 20, warmup: int = 3, progress: bool = True,
                  pool_size: Union[int, str, None] = "auto") -> Dict[str, Any]:
    """Measure start-up, the real train step, the loader alone and the bare-step ceiling of ``cfg``
    in this process; returns the figures (:func:`format_report` prints them).

    ``pool_size``: the synthetic set's images rendered once, in memory, that feed the loader
    (:class:`~shardfc.data.SyntheticPool`, :func:`resolve_pool_size`); None: the dataset itself."""
    from shardfc.data import SyntheticPool
    from shardfc.train.builder.cpu import apply_threads
    from shardfc.train.builder.factory import autocast_factory, build_run, resolve_image_size, run_context
    from shardfc.train.config import ConfigError
    from shardfc.train.loader.data import micro_batches, train_dataset
    from shardfc.train.loop import trainer_step
    from shardfc.train.observe.evaluate import build_targets, run_targets
    from shardfc.train.observe.phases import PhaseClock, summarize_phases
    from shardfc.train.observe.profile import StartupClock
    from shardfc.train.observe.reporting import ReportWindow
    from shardfc.train.observe.runlog import RunLog
    from shardfc.train.state import RunState
    from shardfc.train.step import train_step
    from shardfc.train.stopping import StopAgreement

    for name, value in (("steps", steps), ("warmup", warmup)):
        if not isinstance(value, int) or value < (1 if name == "steps" else 0):
            raise ConfigError(f"--{name} must be an int >= {1 if name == 'steps' else 0}, got {value!r}")
    if cfg.strategy != "ddp":
        raise ConfigError(f"shardfc bench --trainer measures one process of strategy 'ddp'; got strategy={cfg.strategy!r}")

    def say(msg: str) -> None:
        if progress:
            print(f"[bench --trainer] {msg}", file=sys.stderr, flush=True)

    pool_size = resolve_pool_size(cfg, pool_size)
    out = tempfile.mkdtemp(prefix="shardfc-bench-trainer-")
    cfg = dataclasses.replace(cfg, nproc=1, output_dir=out, progress=False, profile=False).validate()
    source: Dict[str, Any] = {"kind": "pool" if pool_size else "renderer" if cfg.dataset == "synthetic" else "loader"}
    rendered = pool = None
    if pool_size:
        # Rendered before the start-up's clock: a bench's way to feed the trainer, no part of a run's start-up.
        started = time.perf_counter()
        rendered = train_dataset(cfg, resolve_image_size(cfg))
        pool = SyntheticPool(rendered, pool_size, cfg.num_workers)
        source.update(pool_images=pool.size, pool_bytes=pool.nbytes, pool_render_s=time.perf_counter() - started,
                      pool_render_workers=pool.num_workers)
        say(f"pool: {pool.size} synthetic images rendered once in {source['pool_render_s']:.2f} s "
            f"({_bytes(pool.nbytes)} of uint8)")
    clock = StartupClock()
    threads = apply_threads(cfg.threads, cfg.strategy, 1)
    ctx = run_context(cfg, None)  # one process, no process group: the device cfg.device asks for
    device = ctx.device
    clock.mark("threads")
    run = build_run(cfg, ctx, clock)
    if pool is not None:  # the run as built, its set's images served from the pool: the same labels and sampler
        run = dataclasses.replace(run, dataset=pool)
    parts = run.parts
    parts.backbone.train()
    parts.head.train()
    autocast = autocast_factory(device, run.amp_dtype)
    state = RunState(batches_per_epoch=len(run.batches))
    phases = PhaseClock(device)  # enabled for the breakdown's steps only
    stream = micro_batches(run.dataset, run.batches, state, cfg, ctx, channels_last=run.channels_last, clock=phases)
    first = next(stream)
    clock.mark("first batch")
    # The loop's own step (trainer_step: stop agreement, step, counters, a report at each log point),
    # logging to nowhere: a RunLog of a process that does not write (the bench saves nothing).
    with RunLog(out, is_main=False) as runlog:
        window, agreement = ReportWindow(state), StopAgreement(ctx)

        def train(batches=stream) -> None:
            trainer_step(run, batches, state, cfg, autocast, agreement, window, runlog, phases)

        with StartupCosts() as costs:
            _timed(device, 1, lambda: train(itertools.chain([first], stream)))
        clock.mark("first step")
        say(f"start-up {clock.line()}")
        # The first evaluation of the run's targets: its own first costs (rendering the synthetic
        # pairs, reading the .bin files, an eval-mode compile), which the loop pays at its first
        # evaluation and the bench reports apart from the start-up.
        targets = build_targets(cfg, run.image_size, device, autocast)
        evaluation: Dict[str, Any] = {"targets": [t.name for t in targets], "s": None, "compile_s": None}
        if targets:
            with StartupCosts() as eval_costs:
                evaluation["s"] = _timed(device, 1, lambda: run_targets(targets, parts.module))
            evaluation["compile_s"] = eval_costs.compile_s
            say(f"first evaluation ({', '.join(evaluation['targets'])}) {evaluation['s']:.2f} s")
        images_per_step = run.batches.batch_size * cfg.grad_accum

        # The ceiling: the bare step (train_step) on one batch of random tensors resident on the device.
        h, w = run.image_size
        g = torch.Generator().manual_seed(cfg.seed)
        images = torch.randn(run.batches.batch_size, 3, h, w, generator=g).clamp_(-1, 1).to(device)
        if run.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        labels = torch.randint(run.num_classes, (run.batches.batch_size,), generator=g).to(device)
        resident = itertools.repeat((images, labels, []))
        ceiling_loss: List[torch.Tensor] = []
        ceiling_phases = PhaseClock(device)

        def ceiling() -> None:
            ceiling_phases.begin_step()
            ceiling_loss[:] = [train_step(parts, resident, state, cfg, ctx, autocast, ceiling_phases)[0]]
            ceiling_phases.end_step()

        # Train and ceiling steps in alternating blocks, so that a load that drifts (a shared machine)
        # weighs on both alike. Each train block first takes, untimed, as many micro-batches as the
        # loader may have queued during the ceiling's block: a head start a steady run does not have.
        queued = cfg.num_workers * 2 + 2  # DataLoader's prefetch_factor 2 per worker, the prefetcher's, one in hand
        catch_up = -(-queued // cfg.grad_accum)
        say(f"train and ceiling: {warmup} warm-up + {steps} timed steps of {images_per_step} images each, "
            f"in alternating blocks ({catch_up} untimed train step(s) before each train block); then "
            f"{steps} more train steps split into phases")
        _timed(device, warmup, train)
        _timed(device, warmup, ceiling)
        blocks = [len(b) for b in torch.arange(steps).chunk(min(5, steps))]
        train_s = ceiling_s = 0.0
        with _Utilisation(device) as util:
            for n in blocks:
                _timed(device, catch_up, train)
                train_s += _timed(device, n, train)
                util.pause()
                ceiling_s += _timed(device, n, ceiling)
                util.resume()
        if not torch.isfinite(ceiling_loss[0]).all():
            raise FloatingPointError(f"the ceiling's loss is {float(ceiling_loss[0])} after {steps} steps: lower --lr")
        train_rate = steps * images_per_step / train_s
        ceiling_rate = steps * images_per_step / ceiling_s

        # Where the train step's time goes: more train steps, split into phases, each followed by a
        # ceiling step split alike (the bare step's phases side by side, under the same load). Apart
        # from the timed blocks: on a GPU each phase's end synchronises the device.
        _timed(device, catch_up, train)
        phases.enabled = ceiling_phases.enabled = True
        for _ in range(steps):
            train()
            ceiling()
        phases.enabled = ceiling_phases.enabled = False
        breakdown = summarize_phases(phases.steps)
        ceiling_breakdown = summarize_phases(ceiling_phases.steps)

    # The loader alone, past what its workers queued while the steps ran.
    loader_batches = max(steps * cfg.grad_accum, 2 * queued, 20)
    say(f"loader only: {queued} queued batches skipped, {loader_batches} timed")
    loader_rate = _drain_rate(stream, device, skip=queued, timed=loader_batches)
    stream.close()
    loaders = []
    for loader, workers in loader_variants(cfg, pooled=pool is not None):
        say(f"loader column: {loader} with {workers} worker(s)/thread(s), {loader_batches} batches timed")
        if loader == "renderer":  # the set the pool was rendered from, rendered per sample by the workers
            dataset, variant = rendered, dataclasses.replace(cfg, num_workers=workers)
        else:
            dataset, variant = run.dataset, dataclasses.replace(cfg, loader=loader, num_workers=workers)
        rate = _loader_rate(variant, dataset, run, ctx, skip=workers * 2 + 2, timed=loader_batches)
        loaders.append({"loader": loader, "workers": workers, "decode": _decode_where(loader, device),
                        "images_per_s": rate, "over_train": rate / train_rate})
    shutil.rmtree(out, ignore_errors=True)  # nothing is saved: the bench builds and steps only

    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {threads}",
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "config": {
            "dataset": cfg.dataset, "data_root": cfg.data_root, "backbone": cfg.backbone,
            "image_size": list(run.image_size), "batch_size": run.batches.batch_size, "grad_accum": cfg.grad_accum,
            "classes": run.num_classes, "embedding_dim": cfg.embedding_dim, "num_workers": cfg.num_workers, "loader": cfg.loader,
            "amp": "fp32" if run.amp_dtype is None else str(run.amp_dtype).replace("torch.", ""),
            "channels_last": run.channels_last, "compile": cfg.compile,
        },
        "source": source,
        "steps": steps,
        "warmup": warmup,
        "ceiling_images_per_s": ceiling_rate,
        "train_images_per_s": train_rate,
        "train_over_ceiling": train_rate / ceiling_rate,
        "loader_images_per_s": loader_rate,
        "loader_over_train": loader_rate / train_rate,
        "loaders": loaders,
        # The figure: a train step's time beyond a ceiling step and a batch of the loader alone,
        # from the three rates (measured apart, so a shared machine's drift lands here too).
        "beyond_ceiling_and_loader_ms": 1e3 * images_per_step * (1 / train_rate - 1 / ceiling_rate - 1 / loader_rate),
        "beyond_ceiling_and_loader_share": 1 - train_rate * (1 / ceiling_rate + 1 / loader_rate),
        "gpu_utilisation_percent": util.mean,
        "gpu_utilisation_why_none": util.why if util.mean is None else None,
        "startup_s": clock.total_s,
        "startup_phases": [[name, s] for name, s in clock.phases],
        "startup_split": startup_split(clock.phases, costs),
        "first_evaluation_s": evaluation["s"],
        "first_evaluation_compile_s": evaluation["compile_s"],
        "first_evaluation_targets": evaluation["targets"],
        "step_phases": breakdown,
        "ceiling_phases": ceiling_breakdown,
    }


def loader_variants(cfg, pooled: bool = False) -> List[Tuple[str, int]]:
    """The loader column's ``(loader, workers)``: for the image datasets ('recordio', 'folder') the
    torch loader with 0, 2 and N workers (N: ``num_workers``, else the cores) and DALI with N threads
    when it is installed; with a pool (``pooled``), the synthetic renderer with the run's workers, the
    rate the pool stands in for; nothing for the others (the renderer alone is the run's own loader)."""
    from shardfc.train.loader.dali_loader import dali_missing

    if pooled:
        return [("renderer", cfg.num_workers)]
    if cfg.dataset not in ("recordio", "folder"):
        return []
    n = cfg.num_workers or os.cpu_count() or 1
    variants = [("torch", w) for w in sorted({0, 2, n})]
    return variants + ([("dali", n)] if dali_missing() is None else [])


def _decode_where(loader: str, device: torch.device) -> str:
    return "GPU" if loader == "dali" and device.type == "cuda" else "CPU"


def _loader_rate(cfg, dataset, run, ctx, skip: int, timed: int) -> float:
    """Images/s of ``cfg``'s loader of ``dataset`` alone (to the device, normalised), past its first
    ``skip`` batches."""
    from shardfc.train.loader.data import micro_batches
    from shardfc.train.state import RunState

    stream = micro_batches(dataset, run.batches, RunState(batches_per_epoch=len(run.batches)), cfg, ctx,
                           channels_last=run.channels_last)
    try:
        return _drain_rate(stream, ctx.device, skip, timed)
    finally:
        stream.close()


def _drain_rate(stream, device: torch.device, skip: int, timed: int) -> float:
    """Images/s of ``stream`` drained without training: ``skip`` batches untimed (what its workers
    had queued), then ``timed`` batches, the device synchronised around them."""
    for _ in range(skip):
        next(stream)
    _sync(device)
    start, n_images = time.perf_counter(), 0
    for _ in range(timed):
        n_images += next(stream)[0].shape[0]
    _sync(device)
    return n_images / (time.perf_counter() - start)


def describe_source(r: Dict[str, Any]) -> str:
    """What fed the trainer, in words: the pool (how many images, their memory, their rendering), the
    renderer or the dataset's loader."""
    c, src = r["config"], r["source"]
    workers = f"{c['num_workers']} loader worker(s)"
    if src["kind"] == "pool":
        return (f"a pool of {src['pool_images']:,} synthetic images rendered once ({_bytes(src['pool_bytes'])} "
                f"of uint8 in memory, rendered in {src['pool_render_s']:.2f} s by {src['pool_render_workers']} "
                f"worker(s); --pool-size N sets it, --no-pool renders per sample instead), read by {workers}")
    if src["kind"] == "renderer":
        return f"the synthetic renderer, per sample in {workers} (--no-pool)"
    return f"the {c['dataset']} loader (--loader {c['loader']}, {workers})"


def _bytes(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):,.1f} {unit}"
    return f"{n} B"


def _seconds(s: Optional[float]) -> str:
    return "n/a" if s is None else f"{s:.2f} s"


def format_report(r: Dict[str, Any]) -> str:
    """The figures as a Markdown table, with what was measured above it, and the step's phases."""
    from shardfc.train.observe.phases import format_phases

    c = r["config"]
    load = r["load_average"]
    util = r["gpu_utilisation_percent"]
    split = ", ".join(f"{name} {_seconds(s)}" for name, s in r["startup_split"].items())
    if r["first_evaluation_s"] is None:
        evaluation = "none: the run has no evaluation target"
    else:
        evaluation = (f"{r['first_evaluation_s']:.2f} s ({', '.join(r['first_evaluation_targets'])}; compile "
                      f"{_seconds(r['first_evaluation_compile_s'])} of it)")
    lines = [
        f"device: {r['device']}" + (f"; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}" if load else ""),
        f"run: {c['dataset']}{' ' + c['data_root'] if c['data_root'] else ''}, {c['backbone']} at "
        f"{c['image_size'][0]}x{c['image_size'][1]}, batch {c['batch_size']} x {c['grad_accum']}, {c['classes']} classes, "
        f"{c['amp']}, {'channels_last' if c['channels_last'] else 'contiguous'}"
        f"{', compiled' if c['compile'] else ''}, --loader {c['loader']} with {c['num_workers']} worker(s); "
        f"{r['steps']} timed steps",
        f"source: {describe_source(r)}",
        "",
        "| what | images/s |",
        "|---|---:|",
        f"| ceiling: the bare step on device-resident random tensors | {r['ceiling_images_per_s']:,.0f} |",
        f"| `shardfc train`'s step on the real stream | {r['train_images_per_s']:,.0f} |",
        f"| train / ceiling | {r['train_over_ceiling']:.2f} |",
        f"| data loader only ({c['dataset'] if r['source']['kind'] == 'loader' else r['source']['kind']}) | "
        f"{r['loader_images_per_s']:,.0f} "
        f"({r['loader_over_train']:.1f}x the train rate) |",
        f"| train step beyond a ceiling step and the loader's batch (from the rates) | "
        f"{r['beyond_ceiling_and_loader_ms']:.2f} ms ({100 * r['beyond_ceiling_and_loader_share']:.0f}% of the step) |",
        f"| GPU utilisation during the train steps | {'n/a' if util is None else f'{util:.0f}%'} |",
        f"| start-up to the end of the first step | {r['startup_s']:.2f} s: {split} |",
        f"| first evaluation (after the start-up, not in it) | {evaluation} |",
        "",
        "start-up by phase: " + ", ".join(f"{name} {s:.2f} s" for name, s in r["startup_phases"]),
        "",
        "where the train step's time goes:",
        "",
        format_phases(r["step_phases"], beside=r["ceiling_phases"], beside_name="ceiling"),
    ]
    if r["loaders"]:
        lines += ["", "| loader only (to the device, normalised) | decode | images/s | / train rate |", "|---|---|---:|---:|"]
        for v in r["loaders"]:
            name = "synthetic renderer" if v["loader"] == "renderer" else v["loader"]
            what = f"{name}, {v['workers']} {'thread(s)' if v['loader'] == 'dali' else 'worker(s)'}"
            lines.append(f"| {what} | {v['decode']} | {v['images_per_s']:,.0f} | {v['over_train']:.2f} |")
    return "\n".join(lines)


#: ``shardfc train`` flags the bench replaces or never reaches: its output folder is a scratch one,
#: it neither saves nor resumes, and it prints its own progress.
UNREAD_TRAIN_FLAGS = ("output_dir", "resume", "ckpt_every", "keep_last", "save_on_signal", "profile", "progress",
                      "print_config")


def main(argv: List[str]) -> int:
    from shardfc.train.config import ConfigError, parse_config

    p = argparse.ArgumentParser(
        prog="shardfc bench --trainer",
        description="The trainer against its ceiling: the real `shardfc train` step and the bare step on "
        "device-resident random tensors, the loader alone, the start-up (data, build, compile, autotune) and the "
        "first evaluation, in one process. The synthetic set feeds it from a pool of pre-rendered images by "
        "default (--pool-size, --no-pool). Every other argument is a `shardfc train` flag.",
        allow_abbrev=False,
    )
    p.add_argument("--trainer", action="store_true", help="this comparison")
    p.add_argument("--steps", type=int, default=20, help="timed steps of each kind (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--pool-size", type=int, default=None, metavar="N",
                   help=f"the synthetic set: feed the trainer from N of its images rendered once, in memory (uint8, "
                   f"N x 3 x H x W bytes), so that the loader is never what limits it (default {DEFAULT_POOL_SIZE}; "
                   f"at most the set's size)")
    p.add_argument("--no-pool", action="store_true",
                   help="the synthetic set rendered per sample by the loader workers, as `shardfc train` does "
                   "(the renderer's rate becomes the run's); other datasets are always read by their own loader")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    try:
        args, rest = p.parse_known_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        if args.no_pool and args.pool_size is not None:
            raise ConfigError(f"--no-pool and --pool-size {args.pool_size} exclude each other")
        check_outputs(json=args.json)  # before the run, not after it
        cfg, given = parse_config(rest)
        # (the namespace holds the flags given, and print_config always)
        unread = [f"--{name.replace('_', '-')}" for name in UNREAD_TRAIN_FLAGS
                  if (given.print_config if name == "print_config" else name in vars(given))]
        if unread:  # replaced or ignored by the bench: refused, as shardfc train refuses a flag its run would not read
            raise ConfigError(f"shardfc bench --trainer saves, resumes and prints nothing of a run: {', '.join(unread)} "
                              "would not be read (it times steps in a scratch folder it removes)")
        if getattr(given, "nproc", 1) != 1:  # was replaced by 1 silently: one process's figure read as several's
            raise ConfigError(f"shardfc bench --trainer measures one process; got --nproc {given.nproc} (time a run of "
                              "several with shardfc train --profile)")
        pool_size = None if args.no_pool else "auto" if args.pool_size is None else args.pool_size
        result = bench_trainer(cfg, steps=args.steps, warmup=args.warmup, progress=not args.quiet, pool_size=pool_size)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"shardfc bench --trainer: error: {e}", file=sys.stderr)
        return 2
    print(format_report(result))
    if args.json:
        write_atomically(Path(args.json), lambda scratch: scratch.write_text(json.dumps(result, indent=1), encoding="utf-8"))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
