"""``--profile``: what one process measured of its run, written to ``profile/rank<R>.json`` at the end.

Per step (the optimizer step, from its first micro-batch to both optimizers' update; logging,
checkpoints and evaluation are outside it): its wall time (``time.perf_counter``, after a CUDA
synchronise when the run is on CUDA), the images it trained on over all ranks, and the bytes this
process communicated, counted with :func:`~shardfc.parallel.collectives.count_comm` by its
convention (the gathered output of an all-gather, the input of a reduce-scatter, the tensor of an
all-reduce or broadcast). Besides the head's counted collectives that includes

* DDP: every gradient bucket it all-reduces (a comm hook that counts, then runs torch's default
  all-reduce hook) and the module buffers it broadcasts from rank 0 before a forward (DDP does
  so after a synchronised backward: once per step with gradient accumulation);
* Horovod: the backbone gradients its DistributedOptimizer all-reduces (counted at ``synchronize()``);
* pipeline: each stage's gradient average over its replicas, and the stage-to-stage traffic that
  torch.distributed.pipelining sends point to point, counted where it is sent
  (:class:`~shardfc.parallel.pipeline.PipelineRunner`): ``pipeline_activations`` (a stage's output,
  to the next stage) and ``pipeline_activation_grads`` (the gradient of its input, to the previous);
* dp: nothing of DataParallel's own traffic (its replicate / scatter / gather copies are not
  collectives).

``backbone_traffic_counted`` is False for dp. ``comm_bytes_by_kind_per_step`` has each step's
bytes by kind (``comm_bytes_by_kind`` their sums over the run).

Per step too, where its time went (``step_phases_s``: seconds by phase, the loop's whole step from
its stop agreement to its log line; :mod:`~shardfc.train.observe.phases`); rank 0 logs their means as a table
at the end of the run.

Per process: the peak resident set size (``ru_maxrss``, the whole life of the process, imports
included) and, on CUDA, ``max_memory_allocated``.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardfc.outputs import write_atomically
from shardfc.parallel.collectives import count_comm, record_comm_bytes
from shardfc.parallel.comm import launched_by_horovodrun
from shardfc.parallel.launch import launched_by_torchrun
from shardfc.train.observe.phases import PhaseClock

__all__ = ["StartupClock", "StepProfiler", "count_ddp_traffic", "count_horovod_gradients", "peak_rss_bytes",
           "profile_path"]


def profile_path(output_dir: Path, rank: int) -> Path:
    return Path(output_dir) / "profile" / f"rank{rank}.json"


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def count_ddp_traffic(ddp: DDP, group) -> None:
    """Count what ``ddp`` communicates per step: its gradient buckets and its buffer broadcasts.

    Registers a comm hook (before the first backward) that records each bucket, then runs torch's
    default all-reduce hook, so the gradients are the same as without it.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def counting_allreduce(state, bucket):
        record_comm_bytes("ddp_gradients", _nbytes(bucket.buffer()))
        return allreduce_hook(state, bucket)

    def count_buffer_broadcast(module, args):
        # DDP broadcasts rank 0's buffers (BatchNorm statistics) in its forward when this holds.
        if module.will_sync_module_buffers():
            record_comm_bytes("ddp_buffers", sum(_nbytes(b) for b in module.modules_buffers))

    ddp.register_comm_hook(group, counting_allreduce)
    ddp.register_forward_pre_hook(count_buffer_broadcast)


def count_horovod_gradients(opt: torch.optim.Optimizer) -> None:
    """Record the gradients a Horovod DistributedOptimizer has just all-reduced (after ``synchronize()``)."""
    nbytes = sum(_nbytes(p.grad) for g in opt.param_groups for p in g["params"] if p.grad is not None)
    record_comm_bytes("horovod_gradients", nbytes)


def _launcher(world_size: int) -> str:
    """What started this process: torchrun, horovodrun, ``shardfc train``'s own spawn (ddp or pipeline
    over several processes) or nothing (one process, dp included)."""
    if launched_by_torchrun():
        return "torchrun"
    if launched_by_horovodrun():
        return "horovodrun"
    return "spawn" if world_size > 1 else "one process"


class StartupClock:
    """Where a process's start-up went: :meth:`mark` ends a phase (named) that began at the last mark.

    ``started``: a ``time.perf_counter()`` value (default: now). :meth:`line` is what ``--profile``
    logs; :meth:`as_dict` what it writes.
    """

    def __init__(self, started: "float | None" = None) -> None:
        self.started = time.perf_counter() if started is None else started
        self._last = self.started
        self.phases: List[tuple] = []

    def mark(self, name: str) -> float:
        """End phase ``name`` now; returns its seconds."""
        now = time.perf_counter()
        spent, self._last = now - self._last, now
        self.phases.append((name, spent))
        return spent

    @property
    def total_s(self) -> float:
        return self._last - self.started

    def line(self) -> str:
        parts = ", ".join(f"{name} {spent:.2f} s" for name, spent in self.phases)
        return f"{self.total_s:.2f} s: {parts}"

    def as_dict(self) -> Dict[str, Any]:
        return {"total_s": self.total_s, "phases": [[name, spent] for name, spent in self.phases]}


class StepProfiler:
    """Times and counts each optimizer step of one process; :meth:`write` dumps it as JSON."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.step_s: List[float] = []
        self.samples: List[int] = []
        self.comm_bytes: List[int] = []
        self.comm_by_kind: Dict[str, int] = {}
        self.startup: "StartupClock | None" = None
        self.comm_by_kind_per_step: List[Dict[str, int]] = []
        self.phases = PhaseClock(device, enabled=True)
        """Where each step's time went, phase by phase."""

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def step(self, state) -> Iterator[None]:
        """Measure the optimizer step run inside the ``with`` (``state``: the run's RunState)."""
        self._sync()
        samples0 = state.samples_seen
        with count_comm() as counter:
            start = time.perf_counter()
            yield
            self._sync()
            self.step_s.append(time.perf_counter() - start)
        self.samples.append(state.samples_seen - samples0)
        self.comm_bytes.append(counter.total_bytes)
        self.comm_by_kind_per_step.append(dict(counter.bytes))
        for kind, n in counter.bytes.items():
            self.comm_by_kind[kind] = self.comm_by_kind.get(kind, 0) + n

    def summary(self, *, rank: int, world_size: int, cfg, backbone: nn.Module, amp_dtype) -> Dict[str, Any]:
        cuda_peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        return {
            "rank": rank,
            "world_size": world_size,
            "strategy": cfg.strategy,
            "launcher": _launcher(world_size),
            "device": str(self.device),
            "amp": "fp32" if amp_dtype is None else str(amp_dtype).replace("torch.", ""),
            "backbone": cfg.backbone,
            "step_s": self.step_s,
            "samples": self.samples,
            "comm_bytes": self.comm_bytes,
            "comm_bytes_by_kind": self.comm_by_kind,
            "comm_bytes_by_kind_per_step": self.comm_by_kind_per_step,
            "backbone_traffic_counted": cfg.strategy != "dp",
            "peak_rss_bytes": peak_rss_bytes(),
            "cuda_peak_bytes": cuda_peak,
            "pid": os.getpid(),
            "startup": self.startup.as_dict() if self.startup is not None else None,
            "step_phases_s": self.phases.steps,
        }

    def write(self, path: Path, summary: Dict[str, Any]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(summary, indent=1) + "\n"
        write_atomically(path, lambda scratch: scratch.write_text(text, encoding="utf-8"))  # never half a file
