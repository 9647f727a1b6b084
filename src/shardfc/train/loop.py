"""The training loop of ``shardfc train``, read top to bottom in :func:`train`: build, resume, loop, save.

One process per rank (ddp, horovod) or one process for all GPUs (dp): see
:mod:`~shardfc.train.builder.strategy`. Every rank holds a replica of the backbone (in DDP, or with
Horovod's averaging optimizer, when there are several ranks) and one class shard of the
:class:`~shardfc.ShardedMarginHead` (never in DDP: its embedding gradient is already scaled so that
the backbone's averaging gives it exact gradients). Under the pipeline strategy a rank holds one
stage of one replica instead, and the head only on the last stage
(:mod:`~shardfc.train.builder.pipeline_train`). What a step does is in
:mod:`~shardfc.train.step`; building in :mod:`~shardfc.train.builder.factory`; checkpoints in
:mod:`~shardfc.train.checkpointing.resume`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from shardfc.head.validation import NonFiniteEmbeddingsError
from shardfc.outputs import write_atomically
from shardfc.parallel.lifecycle import record_stop_signals, signal_name
from shardfc.seeding import seed_all
from shardfc.train.builder.cpu import apply_threads
from shardfc.train.builder.factory import autocast_factory, build_run, rank_seed, run_context
from shardfc.train.builder.pipeline_train import evaluate_through_pipeline, pipeline_step, stage_stream
from shardfc.train.builder.strategy import signal_deadline_note, sync_after_restore
from shardfc.train.checkpointing.fine_tune import init_from, resolve_init_from
from shardfc.train.checkpointing.resume import restore, resume_path, save, step_of
from shardfc.train.config import TrainConfig, absolute_paths, to_toml
from shardfc.train.config.fields import CHECKPOINT_SETTINGS, FIELDS
from shardfc.train.loader.data import micro_batches
from shardfc.train.observe.evaluate import build_targets
from shardfc.train.observe.memory_phases import MemoryPhases
from shardfc.train.observe.phases import OFF, PhaseClock, format_phases, summarize_phases
from shardfc.train.observe.profile import StartupClock, StepProfiler, count_ddp_traffic, profile_path
from shardfc.train.observe.reporting import ReportWindow, diverged, evaluate_targets, log_setup, report
from shardfc.train.observe.runlog import RunLog
from shardfc.train.run_lock import run_folder_lock
from shardfc.train.state import Parts, RunState
from shardfc.train.step import apply_gradients, train_step
from shardfc.train.stopping import StopAgreement, crash_if_asked

__all__ = ["load_parts", "train", "trainer_step"]

logger = logging.getLogger("shardfc.train")


def train(cfg: TrainConfig, group: Optional[dist.ProcessGroup] = None) -> Dict[str, Any]:
    """Train as ``cfg`` says; collective over ``group`` when torch.distributed is initialised
    (``cfg.strategy`` 'ddp'), over Horovod's world ('horovod'), or in one process ('dp').

    Returns a summary: ``step``, ``wall_time_s``, ``checkpoint``, ``stopped_by`` (the name of the
    signal that stopped the run early, else None) and (rank 0) the last evaluation's ``metrics``
    (``{target: {metric: value}}``) with their ``descriptions``.

    SIGINT / SIGTERM stop every rank after the same step (see :mod:`~shardfc.train.stopping`);
    the run then saves a checkpoint (unless ``cfg.save_on_signal`` is off) and skips the final
    evaluation.
    """
    started = time.time()
    startup = StartupClock() if cfg.profile else None  # --profile: where the start-up went
    cfg = absolute_paths(cfg.validate())  # stored in checkpoints: readable from any folder
    ctx = run_context(cfg, group)
    out = Path(cfg.output_dir)
    # One run per folder (a second is refused before it reads or writes there), then the logs
    with run_folder_lock(out, ctx), record_stop_signals(), RunLog(out, ctx.is_main, cfg.progress) as runlog:
        threads = apply_threads(cfg.threads, cfg.strategy, ctx.world_size)  # before any work, in every process
        mark = startup.mark if startup is not None else (lambda name: None)
        mark("process group and threads")
        # ---- build: data, model and optimizers (the same initialisation on every rank), evaluation;
        # the checkpoint the run starts from says which head row each identity has
        resume_from = resume_path(cfg, ctx)
        init_path = resolve_init_from(cfg.init_from) if cfg.init_from and resume_from is None else None
        if cfg.init_from and resume_from is not None and ctx.is_main:
            logger.info("init_from=%s ignored: this run resumes from its own checkpoint %s", cfg.init_from, resume_from)
        start_from = (resume_from, False) if resume_from is not None else (init_path, True) if init_path else None
        if start_from is None and ctx.is_main:
            _warn_unread_class_settings(cfg)
        run = build_run(cfg, ctx, startup, classes_from=start_from)
        parts = run.parts
        seed_all(rank_seed(cfg.seed, run.data_ctx.rank, 0))  # then per-replica augmentation / dropout streams
        autocast = autocast_factory(ctx.device, run.amp_dtype)
        targets = build_targets(cfg, run.image_size, ctx.device, autocast) if ctx.is_main else []
        mark("evaluation targets")
        if ctx.is_main:
            log_setup(cfg, ctx, run)
            logger.info("%s", threads)

        # ---- resume: the newest complete checkpoint, saved on any number of ranks
        state = RunState(batches_per_epoch=len(run.batches))
        if resume_from is not None:
            state = _restore(run, resume_from, cfg)
        elif init_path is not None:  # a trained model on this run's classes: step 0, fresh optimizers
            init_from(run, init_path, cfg)
            sync_after_restore(run.ctx, run.parts)
        if ctx.is_main:  # only now: a refused resume leaves the earlier run's config.toml alone
            text = to_toml(cfg)  # whole or not at all: a crash mid-write left the earlier run's config half-written
            write_atomically(out / "config.toml", lambda scratch: scratch.write_text(text, encoding="utf-8"))
        runlog.start_at(state.step)
        mark("resume")
        profiler = _profiler(cfg, ctx, parts)
        clock = profiler.phases if profiler else OFF
        if run.pipeline is None:
            stream = micro_batches(run.dataset, run.batches, state, cfg, run.data_ctx, channels_last=run.channels_last,
                                   clock=clock)
        else:  # pipeline: only the first stage reads and decodes images
            stream = stage_stream(run.dataset, run.batches, state, cfg, run.data_ctx, run.pipeline.layout, clock)
        batches = stream
        if startup is not None and state.step < run.total_steps:
            batches = itertools.chain([next(stream)], stream)  # the loader's start and first batch, timed apart
            mark("first batch")
        memory = MemoryPhases(ctx.device) if profiler else None
        if profiler:
            profiler.startup = startup
            memory.mark("build and resume")

        # ---- loop
        metrics: Dict[str, Dict[str, float]] = {}
        last_saved = resume_from
        window = ReportWindow(state, cfg.max_corrupt_images)
        runlog.open_bar(state.step, run.total_steps)
        parts.backbone.train()
        if parts.head is not None:  # a pipeline rank before the last stage holds none
            parts.head.train()
        stop = 0
        agreed_stop = StopAgreement(ctx)  # on CUDA without a host sync per step
        while state.step < run.total_steps:
            stop = trainer_step(run, batches, state, cfg, autocast, agreed_stop, window, runlog, clock, profiler)
            if stop:
                break
            if startup is not None and startup.phases[-1][0] != "first step":  # once, after the first step
                mark("first step")
                if ctx.is_main:
                    logger.info("start-up (to the end of the first step) %s", startup.line())
            last = state.step == run.total_steps
            saving = cfg.ckpt_every and state.step % cfg.ckpt_every == 0 and not last
            evaluating = cfg.eval_every and state.step % cfg.eval_every == 0 and not last
            if saving or evaluating:
                _mark(memory, f"training to step {state.step}")
            if saving:
                last_saved = save(run, state, cfg)
                _mark(memory, f"save at step {state.step}")
            if evaluating:
                metrics = _evaluate(run, targets, state.step, runlog, autocast)
                _mark(memory, f"evaluation at step {state.step}")
        runlog.close_bar()
        if parts.head is not None:  # the last batch's deferred input checks (one process on CUDA): read now
            parts.head.check_pending()
        if parts.head_step is not None:  # ... and the captured step's, which checks its batches itself
            parts.head_step.check_pending()
        stream.close()  # the loader's workers end now, not whenever the generator is collected

        # ---- save: a final checkpoint (unless nothing was trained) and a final evaluation
        trained = state.step > (step_of(resume_from) if resume_from is not None else 0)
        saved_here = last_saved is not None and step_of(last_saved) == state.step  # a signal right after a periodic save
        _mark(memory, f"training to step {state.step}")
        if trained and (not stop or cfg.save_on_signal) and not saved_here:
            last_saved = save(run, state, cfg)
            _mark(memory, f"save at step {state.step}")
        elif ctx.is_main and not stop:
            logger.info("%s is at step %d; max %d steps: nothing to train", resume_from, state.step, run.total_steps)
        if stop:
            if signal_deadline_note() is not None:  # horovodrun: a few seconds before SIGKILL
                runlog.skip_curves(signal_deadline_note())
            if ctx.is_main:
                saved = last_saved if trained and cfg.save_on_signal else "not saved (save_on_signal is off)"
                if not trained:
                    saved = f"{last_saved} (nothing trained since)" if last_saved else "none (nothing trained)"
                logger.info("stopped at step %d by signal %s; checkpoint %s", state.step, signal_name(stop), saved)
        else:
            # Re-evaluated when nothing was trained (the summary reports it), but not logged twice in metrics.csv.
            metrics = _evaluate(run, targets, state.step, runlog, autocast, record=trained)
            _mark(memory, f"evaluation at step {state.step}")
        ctx.barrier()  # leave together: no rank tears the group down under another
        wall = time.time() - started
        if profiler:
            summary = profiler.summary(
                rank=ctx.rank, world_size=ctx.world_size, cfg=cfg, backbone=parts.module, amp_dtype=run.amp_dtype
            )
            summary["memory_phases"] = memory.as_dict(parts)
            profiler.write(profile_path(out, ctx.rank), summary)
            if ctx.is_main and profiler.phases.steps:
                logger.info("where a step's time went (rank 0):\n%s",
                            format_phases(summarize_phases(profiler.phases.steps)))
        if ctx.is_main:
            logger.info("done: step %d in %.1f s; checkpoint %s", state.step, wall, last_saved)
    return {
        "step": state.step,
        "wall_time_s": wall,
        "checkpoint": str(last_saved) if last_saved else None,
        "stopped_by": signal_name(stop) if stop else None,
        "metrics": metrics,
        "descriptions": {t.name: t.description for t in targets},
        "output_dir": str(out),
    }


def trainer_step(run, batches, state: RunState, cfg: TrainConfig, autocast, stop_agreement: StopAgreement,
                 window: ReportWindow, runlog: RunLog, clock: PhaseClock = OFF,
                 profiler: Optional[StepProfiler] = None) -> int:
    """One turn of the loop up to its log line: agree on stopping, train one optimizer step, count it,
    report it at a log point. Returns the agreed stop signal (0: a step was trained).

    :func:`train` calls it, and ``shardfc bench --trainer`` times it: the bench measures the loop's own
    step. ``clock`` splits it into phases (:mod:`~shardfc.train.observe.phases`); ``profiler`` (``--profile``)
    times the optimizer step within it.
    """
    ctx, parts = run.ctx, run.parts
    clock.begin_step()
    stop = stop_agreement()  # every rank leaves after the same step, or none does
    clock.lap("stop agreement")
    if stop:
        clock.drop_step()
        return stop
    crash_if_asked(ctx.rank, state.step)
    frozen = state.step < cfg.head_warmup_steps  # head-only warm-up: the backbone frozen
    if frozen or state.step == cfg.head_warmup_steps:
        parts.backbone.train(not frozen)
    with profiler.step(state) if profiler else contextlib.nullcontext(), _divergence_named(state):
        if run.pipeline is None:
            loss, corrupt = train_step(parts, batches, state, cfg, ctx, autocast, clock, frozen=frozen)
        else:
            # A head-only warm-up still runs the whole schedule: the stages' gradients are wasted work, but
            # the head's are exact and no stage needs another code path; the stages are in eval mode (above,
            # BatchNorm statistics frozen) and their optimizer does not step.
            loss, corrupt = pipeline_step(parts, run.pipeline, batches, state, cfg, ctx, autocast)
            clock.lap("pipeline schedule")
            apply_gradients(parts, cfg.grad_clip, ctx, run.pipeline, frozen=frozen, head_grad_clip=cfg.head_grad_clip)
            clock.lap("optimizer")
    state.step += 1
    window.add(loss, corrupt)
    runlog.advance()
    if state.step % cfg.log_every == 0 or state.step == run.total_steps:
        report(runlog, window, parts, state, run.total_steps, ctx)
    clock.end_step("logging/metrics")
    return 0


@contextlib.contextmanager
def _divergence_named(state: RunState):
    """The head's refusal of non-finite embeddings, after the run's first step, as what it is: the
    backbone diverged (before any step of this run, the data or the starting weights are to blame, and
    the head's own error stands)."""
    try:
        yield
    except NonFiniteEmbeddingsError as e:
        if state.step == 0:
            raise
        raise diverged("the backbone's embeddings are not finite", state.step + 1) from e  # the head's: the cause


def _warn_unread_class_settings(cfg: TrainConfig) -> None:
    """A fresh run (``--resume auto`` found nothing, no ``--init-from``) does not read what says how a
    checkpoint's classes meet the dataset's: say so rather than ignore it (the flag parser refuses them
    outright with ``--resume none``)."""
    unread = [f"{name}={getattr(cfg, name)!r}" for name in CHECKPOINT_SETTINGS
              if getattr(cfg, name) != FIELDS[name].default]
    if unread:
        logger.warning("%s: read only when the run starts from a checkpoint (--init-from, or a resume); this run "
                       "starts fresh, so %s unused", ", ".join(unread), "it is" if len(unread) == 1 else "they are")


def _mark(memory: Optional[MemoryPhases], phase: str) -> None:
    if memory is not None:
        memory.mark(phase)


def _profiler(cfg: TrainConfig, ctx, parts) -> Optional[StepProfiler]:
    """``--profile``: a StepProfiler, with DDP's own traffic counted too (its hooks go in before the first step)."""
    if not cfg.profile:
        return None
    if isinstance(parts.backbone, DDP):
        count_ddp_traffic(parts.backbone, ctx.group)
    return StepProfiler(ctx.device)


def load_parts(cfg: TrainConfig, path: Path, group: Optional[dist.ProcessGroup] = None) -> Tuple[Parts, RunState]:
    """Build the parts of a run as :func:`train` does and load checkpoint ``path`` into them.

    For inspecting a checkpoint on any number of ranks; each rank gets its own head rows.
    Collective over ``group`` (DDP's construction broadcasts the backbone): call it on every rank.
    """
    cfg.validate()
    run = build_run(cfg, run_context(cfg, group), classes_from=(Path(path), False))
    return run.parts, _restore(run, Path(path), cfg)


def _evaluate(run, targets, step: int, runlog: RunLog, autocast, record: bool = True) -> Dict[str, Dict[str, float]]:
    """Rank 0 evaluates the backbone (a pipeline's through its stages, which serve it: collective)."""
    if run.pipeline is None:
        return evaluate_targets(targets, run.parts, step, runlog, record=record)

    def evaluate(backbone):
        parts = Parts(backbone, None, None, None, [], run.parts.scaler)
        return evaluate_targets(targets, parts, step, runlog, record=record)

    return evaluate_through_pipeline(run, evaluate, autocast)


def _restore(run, path: Path, cfg: TrainConfig) -> RunState:
    """:func:`~shardfc.train.checkpointing.resume.restore`, then what the strategy synchronises after one."""
    state = restore(run, path, cfg)
    sync_after_restore(run.ctx, run.parts)
    return state
