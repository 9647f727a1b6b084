"""``shardfc train``: resolve the config, then run on spawned processes, under torchrun or horovodrun, or in-process.

``--strategy ddp`` (the default):

* under ``torchrun`` (RANK/WORLD_SIZE/MASTER_* set): join the env:// group the launcher describes;
* ``--nproc N`` with N > 1 (default 2): spawn N local processes in a 127.0.0.1 group;
* ``--nproc 1``: train in this process without a process group.

gloo on CPU, NCCL when training on CUDA.

``--strategy horovod``: every process ``horovodrun -np N`` starts trains as one Horovod rank (a
world of one outside horovodrun). ``--strategy dp``: this process drives every visible GPU.
Only rank 0 prints.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import signal
import sys
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from shardfc import checkpoint as ckpt
from shardfc.outputs import blocking_file
from shardfc.parallel.launch import StoppedBySignal, WorkerError, init_from_env, launched_by_torchrun, spawn
from shardfc.parallel.lifecycle import die_with_parent, exit_code
from shardfc.parallel.torchrun import warn_if_restarts_unsafe
from shardfc.train.builder.strategy import check_launch, horovod_module
from shardfc.train.config import ConfigError, TrainConfig, absolute_paths, parse_config, to_toml
from shardfc.train.loop import train

__all__ = ["main", "run", "USER_ERRORS"]

#: Errors caused by the input (config, files, checkpoints): reported in one line, without a traceback
#: (rank 0's train.log keeps it).
USER_ERRORS = (ConfigError, ckpt.CheckpointError, FileNotFoundError, NotADirectoryError, ValueError, FloatingPointError)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg, args = parse_config(argv)
    except ConfigError as e:
        print(f"shardfc train: error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(to_toml(cfg))
        return 0
    try:
        summary = run(cfg)
    except USER_ERRORS as e:
        print(f"shardfc train: error: {e}", file=sys.stderr)
        return 2
    except StoppedBySignal as e:  # a signal before the ranks could stop at a step (e.g. while starting)
        print(f"shardfc train: {e}", file=sys.stderr)
        return exit_code(e.signum)
    except KeyboardInterrupt:  # Ctrl-C outside the run's own handling (e.g. while importing)
        print("shardfc train: interrupted", file=sys.stderr)
        return exit_code(signal.SIGINT)
    # After StoppedBySignal (a RuntimeError too): the allocator's failure is one line, any other keeps its traceback.
    except (RuntimeError, MemoryError) as e:
        oom = out_of_memory(e)
        if oom is None:
            raise
        print(f"shardfc train: error: {oom}", file=sys.stderr)
        return 2
    if summary is not None:
        if "step" in summary:
            print_summary(summary)
        if summary.get("stopped_by"):
            return exit_code(signal.Signals[summary["stopped_by"]])
    return 0


def run(cfg: TrainConfig) -> Optional[Dict[str, Any]]:
    """Train with the launch mode ``cfg.strategy``, the environment and ``cfg.nproc`` select.

    Returns rank 0's summary (on the other ranks under torchrun or horovodrun: only ``stopped_by``,
    when a signal stopped the run). Errors of the
    input are raised as themselves in-process, as :class:`ConfigError` with the same message from
    spawned ranks; a spawned rank's unexpected error as :class:`WorkerError` with its traceback.
    """
    cfg = absolute_paths(cfg.validate())
    check_launch(cfg)
    if cfg.strategy == "horovod":
        return _run_horovod(cfg)
    if cfg.strategy == "dp":
        preflight(cfg)
        if cfg.nproc != 1:
            logging.getLogger("shardfc.train").info("strategy='dp' is one process: --nproc %d is not used", cfg.nproc)
        return train(cfg)
    if launched_by_torchrun():
        die_with_parent(os.getppid())  # torchrun's agent: if it is killed outright, stop too
        check_output_dir(cfg)  # every rank, before the group forms: one line each, not a traceback each
        backend = "nccl" if _wants_cuda(cfg) else "gloo"
        rank, _ = init_from_env(backend, timeout_s=cfg.pg_timeout)
        warn_if_restarts_unsafe(rank)
        try:
            summary = train(cfg)
            # Every rank is done with the group before any tears it down: a rank that destroyed
            # its gloo group while rank 0 still wrote its plots aborted at exit now and then
            # ("terminate called without an active exception", about 1 run in 10 under load).
            dist.barrier()
        finally:
            # The run's objects in reference cycles (DDP's reducer, work handles) go now, while the
            # interpreter is whole: left to its finalization, a gloo object freed there takes the
            # GIL and aborts (once in a clean-clone CI run after the barrier above; not reproduced
            # in 42 runs here under load).
            gc.collect()
            dist.destroy_process_group()
        return summary if rank == 0 else _stopped_only(summary)
    preflight(cfg)
    if cfg.nproc == 1:
        return train(cfg)
    if _wants_cuda(cfg) and cfg.nproc > torch.cuda.device_count():
        raise ConfigError(
            f"nproc={cfg.nproc} but only {torch.cuda.device_count()} CUDA device(s) are visible: NCCL needs one "
            "device per rank (lower --nproc, or --device cpu)"
        )
    cores = os.cpu_count() or 1  # None where it cannot be told
    if not _wants_cuda(cfg) and cfg.nproc > cores:
        logging.getLogger("shardfc.train").warning(
            "nproc=%d exceeds the %d CPU core(s) here: processes will share cores", cfg.nproc, cores
        )
    results = spawn(_spawned, cfg.nproc, cfg, backend="nccl" if _wants_cuda(cfg) else "gloo", timeout_s=cfg.pg_timeout)
    failed = [r for r in results if "error" in r]
    if failed:
        # The rank with an input error explains the others' broken collectives.
        first = next((r for r in failed if r["user_error"]), failed[0])
        if first["user_error"]:
            raise ConfigError(first["error"])
        raise WorkerError(f"rank {first['rank']} failed:\n{first['traceback']}")
    return results[0]


def _run_horovod(cfg: TrainConfig) -> Optional[Dict[str, Any]]:
    """This process as one rank of the Horovod world horovodrun started; rank 0's summary."""
    preflight(cfg)
    hvd = horovod_module()
    try:
        summary = train(cfg)
        rank = hvd.rank()
    finally:
        # Also on an error: the other ranks then fail in their next collective instead of waiting.
        hvd.shutdown()
    return summary if rank == 0 else _stopped_only(summary)


def _stopped_only(summary: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """What a rank other than 0 returns: nothing to print, but the signal that stopped it (its exit code)."""
    return {"stopped_by": summary["stopped_by"]} if summary.get("stopped_by") else None


def out_of_memory(error: BaseException) -> Optional[str]:
    """One line for the allocator running out (host or CUDA memory), with what needs less; None for
    any other error. Too large a run for its machine is the input's size, not a fault in shardfc:
    said in a line, as other input errors are, not as an allocator traceback."""
    oom = isinstance(error, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error))
    if not oom:
        return None
    text = " ".join(str(error).split())
    text = re.sub(r"^\[enforce fail at [^\]]*\] err == 0\. ", "", text)  # the CPU allocator's assertion
    asked = re.search(r"you tried to allocate (\d+) bytes", text)
    if asked:
        text = f"{text.split(':')[0]} could not allocate {int(asked.group(1)) / 2**30:,.1f} GiB"
    text = text if len(text) <= 240 else text[:237] + "..."
    return (f"out of memory: {text or type(error).__name__}. `shardfc plan --classes C --dim D --batch B "
            "--world-size N` predicts the head's memory per rank; more ranks (--nproc), Partial FC (--sample-rate), "
            "a bf16 head (--head-dtype bfloat16) or a smaller --batch-size need less")


def _spawned(rank: int, world_size: int, cfg: TrainConfig) -> Dict[str, Any]:
    """Entry point of a spawned rank: its summary, or its error as data for the parent to report."""
    try:
        return train(cfg)
    except Exception as e:  # the parent decides how to report; a raise here would print every rank's traceback
        oom = out_of_memory(e)
        user = isinstance(e, USER_ERRORS) or oom is not None
        return {"error": oom or str(e), "rank": rank, "user_error": user, "traceback": traceback.format_exc()}


def _wants_cuda(cfg: TrainConfig) -> bool:
    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


def check_output_dir(cfg: TrainConfig) -> None:
    """The run folder can be made: no file stands at it or above it (the ranks' ``mkdir`` raised
    ``FileExistsError`` as a traceback, from each rank)."""
    blocking = blocking_file(Path(cfg.output_dir).expanduser().absolute())
    if blocking is not None:
        raise ConfigError(f"output_dir={cfg.output_dir!r}: {str(blocking)!r} is a file, not a folder")


def preflight(cfg: TrainConfig) -> None:
    """Cheap checks of the input before any process starts, so that mistakes fail in a second."""
    cfg.validate()
    check_output_dir(cfg)
    if cfg.dataset == "folder":
        root = Path(cfg.data_root)
        if not root.is_dir():
            raise FileNotFoundError(f"data_root={cfg.data_root!r} does not exist or is not a folder")
    if cfg.dataset == "list" and not Path(cfg.list_file).is_file():
        raise FileNotFoundError(f"list_file={cfg.list_file!r} does not exist")
    if cfg.dataset == "market1501" and not (Path(cfg.data_root) / "bounding_box_train").is_dir():
        raise FileNotFoundError(f"data_root={cfg.data_root!r} holds no bounding_box_train/ folder (dataset='market1501')")
    for path in cfg.val_bins:
        if not Path(path).is_file():
            raise FileNotFoundError(f"val_bins: {path!r} does not exist")
    if cfg.reid_root and not Path(cfg.reid_root).is_dir():
        raise FileNotFoundError(f"reid_root={cfg.reid_root!r} does not exist or is not a folder")


def print_summary(summary: Dict[str, Any]) -> None:
    """What a person wants after a run: where it went and how good it is."""
    print(f"trained {summary['step']} steps in {summary['wall_time_s']:.1f} s; run folder {summary['output_dir']}")
    if summary.get("stopped_by"):
        print(f"stopped at step {summary['step']} by signal {summary['stopped_by']}")
    if summary.get("checkpoint"):
        print(f"checkpoint: {summary['checkpoint']}")
    for name, metrics in summary.get("metrics", {}).items():
        what = summary.get("descriptions", {}).get(name, name)
        if "accuracy" in metrics:
            print(
                f"verification accuracy on {what}: {100 * metrics['accuracy']:.2f}% "
                f"± {100 * metrics.get('accuracy_std', 0.0):.2f} (chance: 50%)"
            )
        else:
            print(f"{what}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
