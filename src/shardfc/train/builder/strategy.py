"""How a run spreads over processes and devices: ``--strategy ddp | dp | horovod | pipeline``.

    ddp      one process per rank (spawned with --nproc, or torchrun's): the backbone in
             DistributedDataParallel, one class shard of the head per rank (torch.distributed)
    dp       one process: the backbone in nn.DataParallel over every visible CUDA device, the head in
             devices mode, one class shard per device (needs >= 2 CUDA devices)
    horovod  one process per rank under ``horovodrun -np N``: the backbone's optimizer in
             hvd.DistributedOptimizer, one class shard of the head per rank over Horovod's collectives
    pipeline one process per rank (as ddp), ``nproc = pipeline_stages x R``: the backbone cut into
             stages (torch.distributed.pipelining, GPipe or 1F1B), each stage's gradients averaged
             over its R replicas, the head sharded over the last stage's R ranks
             (:mod:`~shardfc.train.builder.pipeline_train`, :mod:`~shardfc.parallel.pipeline`)

Every strategy trains the same model on the same global batch with the same loss: the head is
exact in all four layouts, and its embedding gradient is scaled by the world size for the
averaging data-parallel backbone (DDP and Horovod's DistributedOptimizer both average; under dp
there is one process and nothing to scale). :mod:`~shardfc.train.builder.factory`, :mod:`~shardfc.train.loop`
and :mod:`~shardfc.train.step` ask this module the few questions whose answers differ: the run's
:class:`DistContext`, how the backbone and its optimizer are wrapped, where the head's shards live,
how big one process's loader batch is, and what to synchronise after a restore.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from shardfc.parallel.comm import import_horovod, launched_by_horovodrun
from shardfc.parallel.context import DistContext
from shardfc.parallel.launch import launched_by_torchrun
from shardfc.train.config import STRATEGIES, ConfigError, TrainConfig

logger = logging.getLogger("shardfc.train")

# ---------------------------------------------------------------------- launch checks


def check_launch(cfg: TrainConfig) -> None:
    """Refuse, before any process starts, a strategy this machine or launcher cannot run."""
    if launched_by_torchrun() and cfg.strategy in ("ddp", "pipeline"):
        # torchrun's --nproc-per-node and --nnodes make the ranks: an --nproc that disagrees would be
        # dropped (its default, 2, cannot be told from one given, and is let through)
        world = int(os.environ["WORLD_SIZE"])
        if cfg.nproc not in (TrainConfig.nproc, world):
            raise ConfigError(
                f"--nproc {cfg.nproc} under torchrun, which started {world} process(es) (WORLD_SIZE): torchrun's "
                "--nproc-per-node and --nnodes set the ranks; leave --nproc out"
            )
    if cfg.strategy == "dp":
        if launched_by_torchrun() or launched_by_horovodrun():
            raise ConfigError(
                "strategy='dp' is one process driving every GPU; do not start it under torchrun or horovodrun "
                "(use --strategy ddp under torchrun, --strategy horovod under horovodrun)"
            )
        _dp_device_list(cfg)  # raises when there are not >= 2 CUDA devices
    elif cfg.strategy == "pipeline":
        if launched_by_horovodrun():
            raise ConfigError("strategy='pipeline' runs over torch.distributed: launch it with --nproc or torchrun")
        if not launched_by_torchrun():  # else the world size is checked when the ranks form the layout
            from shardfc.train.builder.pipeline_train import check_pipeline_config

            check_pipeline_config(cfg, cfg.nproc)
    elif cfg.strategy == "horovod":
        if launched_by_torchrun():
            raise ConfigError(
                "strategy='horovod' under torchrun: launch it with `horovodrun -np N --gloo shardfc train "
                "--strategy horovod ...`, or use --strategy ddp under torchrun"
            )
        horovod_module()
        if not launched_by_horovodrun():
            logger.warning(
                "strategy='horovod' outside horovodrun: training as a world of one process (--nproc is not used). "
                "For N processes: horovodrun -np N --gloo shardfc train --strategy horovod ..."
            )


def horovod_module():
    """``horovod.torch``, or a ConfigError that says how to install it."""
    try:
        return import_horovod()
    except ImportError as e:
        raise ConfigError(f"strategy='horovod' needs Horovod: {e}") from None


def dp_devices(cfg: TrainConfig) -> List[torch.device]:
    """The CUDA devices a dp run replicates over (every visible one); a ConfigError unless >= 2."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cfg.device == "cpu" or count < 2:
        where = "device='cpu' was asked for" if cfg.device == "cpu" else (
            f"this machine has {count} CUDA device(s)" if count else "CUDA is not available here"
        )
        raise ConfigError(
            f"strategy='dp' replicates the backbone over CUDA devices with nn.DataParallel in one process and "
            f"shards the head over them, but {where}: on the CPU or a single device DataParallel replicates "
            "nothing. Use --strategy ddp (one process per device or CPU share: --nproc N, or torchrun), or "
            "--strategy horovod under horovodrun"
        )
    return [torch.device("cuda", i) for i in range(count)]


# ---------------------------------------------------------------------- context


def wants_cuda(cfg: TrainConfig) -> bool:
    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


def run_context(cfg: TrainConfig, group: Optional[dist.ProcessGroup]) -> DistContext:
    """The run's :class:`DistContext` for ``cfg.strategy``, on the device ``cfg.device`` asks for."""
    cuda = wants_cuda(cfg)
    if cuda and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but CUDA is not available here; use --device cpu or auto")
    if cuda:
        torch.backends.cudnn.benchmark = True
    if cfg.strategy == "dp":
        if dist.is_available() and dist.is_initialized():
            raise ConfigError("strategy='dp' is one process; torch.distributed is initialised here (use --strategy ddp)")
        return DistContext(device=_dp_device_list(cfg)[0])
    if cfg.strategy == "horovod":
        if group is not None or (dist.is_available() and dist.is_initialized()):
            raise ConfigError("strategy='horovod' but a torch.distributed group is in use; use --strategy ddp with it")
        hvd = horovod_module()
        if not hvd.is_initialized():
            hvd.init()
        device = None
        if cuda:
            torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
            device = torch.device("cuda", torch.cuda.current_device())
        return DistContext.horovod(device or torch.device("cpu"))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    ctx = DistContext.resolve(group, device)
    if ctx.backend == "nccl" and device.type == "cpu":
        raise ConfigError("the process group uses NCCL but device is the CPU; use gloo for CPU runs")
    return ctx


def _dp_device_list(cfg: TrainConfig) -> List[torch.device]:
    # One indirection so tests can put dp's devices on the CPU (DataParallel is then a pass-through).
    return dp_devices(cfg)


def loader_batch_size(cfg: TrainConfig) -> int:
    """Images per micro-batch of one process: batch_size per device, so dp loads one per GPU."""
    return cfg.batch_size * (len(_dp_device_list(cfg)) if cfg.strategy == "dp" else 1)


# ---------------------------------------------------------------------- model and optimizer


def wrap_backbone(cfg: TrainConfig, ctx: DistContext, backbone: nn.Module) -> nn.Module:
    """The backbone as the strategy trains it (already on ``ctx.device``)."""
    if cfg.strategy == "dp":
        devices = _dp_device_list(cfg)
        ids = [d.index for d in devices] if all(d.type == "cuda" for d in devices) else None
        return AutocastDataParallel(backbone, device_ids=ids, output_device=ids[0] if ids else None)
    if cfg.strategy == "horovod":
        hvd = horovod_module()
        # Every rank seeded the same initialisation; rank 0's is broadcast all the same (buffers too).
        hvd.broadcast_parameters(backbone.state_dict(), root_rank=0)
        return backbone
    if ctx.distributed and ctx.world_size > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        # Frozen BN weights (requires_grad=False) are simply not reduced; no parameter goes unused.
        return DDP(backbone, device_ids=[ctx.device] if ctx.device.type == "cuda" else None, process_group=ctx.group)
    return backbone


class AutocastDataParallel(nn.DataParallel):
    """``nn.DataParallel`` whose replicas run under the caller's autocast *dtype*.

    DataParallel runs each replica in its own thread and re-enters autocast there with only the
    caller's on/off flag; the autocast dtype is thread-local, so a bf16 run's replicas would compute
    in fp16 (the CUDA default), without the loss scaling fp16 needs. Each replica is called inside
    an autocast with the caller's dtype instead.
    """

    def parallel_apply(self, replicas, inputs, kwargs):
        device_type = self.src_device_obj.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            replicas = [_UnderAutocast(r, device_type, dtype) for r in replicas]
        return super().parallel_apply(replicas, inputs, kwargs)


class _UnderAutocast:
    """Calls ``module`` inside ``torch.autocast(device_type, dtype)``."""

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
        self.module, self.device_type, self.dtype = module, device_type, dtype

    def __call__(self, *args, **kwargs):
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.module(*args, **kwargs)


def head_placement(cfg: TrainConfig, ctx: DistContext) -> Dict[str, Any]:
    """Keyword arguments of :class:`~shardfc.ShardedMarginHead` that say where its shards live."""
    if cfg.strategy == "dp":
        return {"devices": _dp_device_list(cfg)}
    return {"context": ctx}


def wrap_backbone_optimizer(
    cfg: TrainConfig, ctx: DistContext, backbone: nn.Module, opt: torch.optim.Optimizer
) -> torch.optim.Optimizer:
    """Horovod: the optimizer in hvd.DistributedOptimizer, which averages the gradients over ranks
    (op=Average: the convention the head's W-scaled embedding gradient expects), once per
    ``grad_accum`` backward passes. The other strategies reduce in the backbone wrapper."""
    if cfg.strategy != "horovod":
        return opt
    hvd = horovod_module()
    return hvd.DistributedOptimizer(
        opt, named_parameters=backbone.named_parameters(), op=hvd.Average, backward_passes_per_step=cfg.grad_accum
    )


#: Seconds horovodrun gives a worker between passing on a stop signal (SIGTERM) and SIGKILL
#: (``horovod.runner.common.util.safe_shell_exec.GRACEFUL_TERMINATION_TIME_S``, not configurable).
HOROVODRUN_GRACE_S = 5


def signal_deadline_note() -> Optional[str]:
    """Under horovodrun: why a run stopped by a signal should do no more than finish its step and
    save (horovodrun kills its workers :data:`HOROVODRUN_GRACE_S` seconds after passing the signal
    on); None elsewhere (spawn and torchrun wait for their workers)."""
    if not launched_by_horovodrun():
        return None
    return (f"horovodrun kills its workers {HOROVODRUN_GRACE_S} s after passing a stop signal on, and the "
            "checkpoint comes first (metrics.csv holds every value: shardfc.train.observe.runlog.plot_metrics draws it)")


def is_horovod_optimizer(opt: torch.optim.Optimizer) -> bool:
    """``opt`` is a Horovod DistributedOptimizer (its gradients are averaged by ``synchronize()``)."""
    return callable(getattr(opt, "synchronize", None)) and callable(getattr(opt, "skip_synchronize", None))


def sync_after_restore(ctx: DistContext, parts) -> None:
    """Horovod: rank 0's backbone and backbone optimizer state on every rank after a restore.

    Every rank restored the same checkpoint, so this only guards against drift. The optimizer is
    broadcast only once it has state: on an empty one Horovod runs a step with zero gradients to
    create the state, which with weight decay would move the weights and start the momentum
    where DDP's does not.
    """
    if not ctx.is_horovod:
        return
    hvd = horovod_module()
    hvd.broadcast_parameters(parts.module.state_dict(), root_rank=0)
    if len(parts.opt_backbone.state_dict()["state"]):
        hvd.broadcast_optimizer_state(parts.opt_backbone, root_rank=0)


__all__ = [
    "AutocastDataParallel",
    "STRATEGIES",
    "check_launch",
    "dp_devices",
    "head_placement",
    "HOROVODRUN_GRACE_S",
    "is_horovod_optimizer",
    "signal_deadline_note",
    "loader_batch_size",
    "run_context",
    "sync_after_restore",
    "wants_cuda",
    "wrap_backbone",
    "wrap_backbone_optimizer",
]
