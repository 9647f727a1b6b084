"""``shardfc bench --trainer``: the trainer measured against its own ceiling, in one process.

Every other argument is a ``shardfc train`` flag (``--preset``, ``--config``, ``--dataset``,
``--backbone``, ...), so the bench measures exactly the step a run of those flags takes, on one
process (one device: the rates are per GPU, or per CPU process)::

    shardfc bench --trainer --steps 30                        # the default run (synthetic, tiny, 32x32)
    shardfc bench --trainer --dataset recordio --data-root DIR --backbone iresnet50 --batch-size 128 \\
        --num-workers 8

What it runs, after building the run as ``shardfc train`` does (:func:`~shardfc.train.builder.factory.build_run`):

1. **start-up**: from the start of the build to the end of the first real step, phase by phase
   (:class:`~shardfc.train.observe.profile.StartupClock`, what ``--profile`` logs);
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
   CUDA, on the CPU otherwise) when installed, each a fresh stream past its start-up batches.

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
from typing import Any, Dict, List, Optional, Tuple

import torch

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


def bench_trainer(cfg, steps: int = 20, warmup: int = 3, progress: bool = True) -> Dict[str, Any]:
    """Measure start-up, the real train step, the loader alone and the bare-step ceiling of ``cfg``
    in this process; returns the figures (:func:`format_report` prints them)."""
    from shardfc.train.builder.cpu import apply_threads
    from shardfc.train.builder.factory import autocast_factory, build_run, run_context
    from shardfc.train.config import ConfigError
    from shardfc.train.loader.data import micro_batches
    from shardfc.train.loop import trainer_step
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

    out = tempfile.mkdtemp(prefix="shardfc-bench-trainer-")
    cfg = dataclasses.replace(cfg, nproc=1, output_dir=out, progress=False, profile=False).validate()
    clock = StartupClock()
    threads = apply_threads(cfg.threads, cfg.strategy, 1)
    ctx = run_context(cfg, None)  # one process, no process group: the device cfg.device asks for
    device = ctx.device
    clock.mark("threads")
    run = build_run(cfg, ctx, clock)
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

        _timed(device, 1, lambda: train(itertools.chain([first], stream)))
        clock.mark("first step")
        say(f"start-up {clock.line()}")
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
    for loader, workers in loader_variants(cfg):
        say(f"loader column: {loader} with {workers} worker(s)/thread(s), {loader_batches} batches timed")
        variant = dataclasses.replace(cfg, loader=loader, num_workers=workers)
        rate = _loader_rate(variant, run, ctx, skip=workers * 2 + 2, timed=loader_batches)
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
        "step_phases": breakdown,
        "ceiling_phases": ceiling_breakdown,
    }


def loader_variants(cfg) -> List[Tuple[str, int]]:
    """The loader column's ``(loader, workers)``: for the image datasets ('recordio', 'folder') the
    torch loader with 0, 2 and N workers (N: ``num_workers``, else the cores) and DALI with N threads
    when it is installed; nothing for the others (the synthetic set renders, it does not decode)."""
    from shardfc.train.loader.dali_loader import dali_missing

    if cfg.dataset not in ("recordio", "folder"):
        return []
    n = cfg.num_workers or os.cpu_count() or 1
    variants = [("torch", w) for w in sorted({0, 2, n})]
    return variants + ([("dali", n)] if dali_missing() is None else [])


def _decode_where(loader: str, device: torch.device) -> str:
    return "GPU" if loader == "dali" and device.type == "cuda" else "CPU"


def _loader_rate(cfg, run, ctx, skip: int, timed: int) -> float:
    """Images/s of ``cfg``'s loader alone (to the device, normalised), past its first ``skip`` batches."""
    from shardfc.train.loader.data import micro_batches
    from shardfc.train.state import RunState

    stream = micro_batches(run.dataset, run.batches, RunState(batches_per_epoch=len(run.batches)), cfg, ctx,
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


def format_report(r: Dict[str, Any]) -> str:
    """The figures as a Markdown table, with what was measured above it, and the step's phases."""
    from shardfc.train.observe.phases import format_phases

    c = r["config"]
    load = r["load_average"]
    util = r["gpu_utilisation_percent"]
    lines = [
        f"device: {r['device']}" + (f"; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}" if load else ""),
        f"run: {c['dataset']}{' ' + c['data_root'] if c['data_root'] else ''}, {c['backbone']} at "
        f"{c['image_size'][0]}x{c['image_size'][1]}, batch {c['batch_size']} x {c['grad_accum']}, {c['classes']} classes, "
        f"{c['amp']}, {'channels_last' if c['channels_last'] else 'contiguous'}"
        f"{', compiled' if c['compile'] else ''}, --loader {c['loader']} with {c['num_workers']} worker(s); "
        f"{r['steps']} timed steps",
        "",
        "| what | images/s |",
        "|---|---:|",
        f"| ceiling: the bare step on device-resident random tensors | {r['ceiling_images_per_s']:,.0f} |",
        f"| `shardfc train`'s step on the real stream | {r['train_images_per_s']:,.0f} |",
        f"| train / ceiling | {r['train_over_ceiling']:.2f} |",
        f"| data loader only | {r['loader_images_per_s']:,.0f} ({r['loader_over_train']:.1f}x the train rate) |",
        f"| train step beyond a ceiling step and the loader's batch (from the rates) | "
        f"{r['beyond_ceiling_and_loader_ms']:.2f} ms ({100 * r['beyond_ceiling_and_loader_share']:.0f}% of the step) |",
        f"| GPU utilisation during the train steps | {'n/a' if util is None else f'{util:.0f}%'} |",
        f"| start-up to the end of the first step | {r['startup_s']:.2f} s |",
        "",
        "start-up: " + ", ".join(f"{name} {s:.2f} s" for name, s in r["startup_phases"]),
        "",
        "where the train step's time goes:",
        "",
        format_phases(r["step_phases"], beside=r["ceiling_phases"], beside_name="ceiling"),
    ]
    if r["loaders"]:
        lines += ["", "| loader only (to the device, normalised) | decode | images/s | / train rate |", "|---|---|---:|---:|"]
        for v in r["loaders"]:
            what = f"{v['loader']}, {v['workers']} {'thread(s)' if v['loader'] == 'dali' else 'worker(s)'}"
            lines.append(f"| {what} | {v['decode']} | {v['images_per_s']:,.0f} | {v['over_train']:.2f} |")
    return "\n".join(lines)


def main(argv: List[str]) -> int:
    from shardfc.train.config import ConfigError, parse_config

    p = argparse.ArgumentParser(
        prog="shardfc bench --trainer",
        description="The trainer against its ceiling: the real `shardfc train` step and the bare step on "
        "device-resident random tensors, the loader alone and the start-up, in one process. Every other "
        "argument is a `shardfc train` flag.",
        allow_abbrev=False,
    )
    p.add_argument("--trainer", action="store_true", help="this comparison")
    p.add_argument("--steps", type=int, default=20, help="timed steps of each kind (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    try:
        args, rest = p.parse_known_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        cfg, _ = parse_config(rest)
        result = bench_trainer(cfg, steps=args.steps, warmup=args.warmup, progress=not args.quiet)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"shardfc bench --trainer: error: {e}", file=sys.stderr)
        return 2
    print(format_report(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
