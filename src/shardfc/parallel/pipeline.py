"""Pipeline parallelism over processes, combined with data parallelism: a 2-D layout of ranks.

A world of ``S x R`` ranks runs ``S`` pipeline stages of the backbone, each replicated over ``R``
data-parallel replicas. Rank ``r`` holds stage ``r // R`` of replica ``r % R`` (stage-major), so

* the *pipeline group* of replica ``j`` is ``{j, R + j, 2R + j, ...}``: its ranks pass
  activations forward and their gradients backward, point to point
  (:mod:`torch.distributed.pipelining`, GPipe or 1F1B schedule over ``M`` micro-batches);
* the *replica group* of stage ``s`` is ``{sR, ..., sR + R - 1}``: its ranks average the
  gradients of the stage's parameters after the step (the data-parallel all-reduce);
* the replica group of the last stage also holds the sharded head: each of its ``R`` ranks owns
  one class shard and the head's collectives run over that group only. The embeddings are
  produced there, so no embedding crosses the pipeline, and the head's memory is spread over the
  ranks that would otherwise idle least in the pipeline bubble (the last stage).

Every group is created once, in :func:`create_layout`, on every rank in the same order (as
``torch.distributed.new_group`` requires); everything else takes the :class:`PipelineLayout`.
The stage modules are cut by :func:`shardfc.parallel.model_split.stages` at named split points.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from shardfc.checks import check_int, check_positive_int
from shardfc.parallel.context import DistContext
from shardfc.parallel.model_split import batch_stats_module, model_segments, split_units
from shardfc.parallel.partition import linear_partition

__all__ = [
    "SCHEDULES",
    "ActivationSpec",
    "PipelineLayout",
    "PipelineRunner",
    "activation_specs",
    "chained_activation_specs",
    "average_gradients_",
    "balanced_split_points",
    "check_stage_count",
    "create_layout",
    "gather_object_to",
    "replicas_for",
]

#: ``--pipeline-schedule`` values: torch.distributed.pipelining's single-stage-per-rank schedules.
SCHEDULES = ("gpipe", "1f1b")


def check_stage_count(stages: int, n_split_points: Optional[int] = None) -> int:
    """``stages`` if a backbone with ``n_split_points`` split points can be cut into that many stages."""
    check_int("pipeline_stages", stages, 1)
    if stages < 2:
        raise ValueError(f"pipeline_stages must be >= 2 (one stage is plain data parallelism: use ddp), got {stages}")
    if n_split_points is not None and stages > n_split_points + 1:
        raise ValueError(
            f"pipeline_stages={stages} but the backbone has {n_split_points} split point(s), so it can be cut into "
            f"at most {n_split_points + 1} stages"
        )
    return stages


def replicas_for(world_size: int, stages: int, n_split_points: Optional[int] = None) -> int:
    """``R = world_size / stages``; ValueError naming the value when the layout is impossible."""
    check_stage_count(stages, n_split_points)
    if world_size % stages:
        raise ValueError(
            f"world size {world_size} is not divisible by pipeline_stages={stages}: the ranks form "
            "pipeline_stages x replicas; use a multiple of the stage count (--nproc)"
        )
    return world_size // stages


@dataclass(frozen=True)
class PipelineLayout:
    """This rank's place in the ``stages x replicas`` grid and its two groups."""

    stages: int
    replicas: int
    stage: int
    replica: int
    pipe_group: Optional[dist.ProcessGroup]
    """The ranks of this replica's pipeline, in stage order (group rank == stage index)."""
    replica_ctx: DistContext
    """The ranks holding this stage: the data-parallel group (the head's group on the last stage)."""
    pipe_ctx: DistContext
    """``pipe_group`` as a context (for collectives over the stages, e.g. a gradient norm)."""

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def rank_of(self, stage: int, replica: int) -> int:
        """World rank of ``stage`` of ``replica``."""
        return stage * self.replicas + replica


def create_layout(world: DistContext, stages: int, n_split_points: Optional[int] = None) -> PipelineLayout:
    """Create every pipeline and replica group (collective over the world: every rank, same order)."""
    replicas = replicas_for(world.world_size, stages, n_split_points)
    if not world.distributed or world.is_horovod:
        raise ValueError("the pipeline strategy needs torch.distributed to be initialised (spawn or torchrun)")
    if world.group is not None:  # the grid below is laid out in global ranks
        raise ValueError("the pipeline strategy runs over torch's default group; a sub-group was given")
    stage, replica = divmod(world.rank, replicas)
    pipe_group = replica_group = None
    for j in range(replicas):
        g = dist.new_group([s * replicas + j for s in range(stages)])
        if j == replica:
            pipe_group = g
    for s in range(stages):
        g = dist.new_group([s * replicas + j for j in range(replicas)])
        if s == stage:
            replica_group = g
    replica_ctx = DistContext.resolve(replica_group, world.device)
    pipe_ctx = DistContext.resolve(pipe_group, world.device)
    return PipelineLayout(stages, replicas, stage, replica, pipe_group, replica_ctx, pipe_ctx)


def balanced_split_points(model: nn.Module, stages: int) -> List[str]:
    """The ``stages - 1`` split points that minimise the largest stage's parameter count.

    Cuts go between segments and, in a model's ``block_segments``, between blocks
    (:func:`shardfc.parallel.model_split.available_split_points` with ``blocks=True``): iresnet100
    in 4 stages gets about a quarter of its parameters per stage, which no cut between whole
    segments gives (its ``layer3`` alone is more than half). Exact (a linear partition: the best
    largest stage, then the earliest cuts that reach it); parameter count stands in for both
    memory and compute. Works on a model built on the meta device.
    """
    decl = model_segments(model)
    units = split_units(model, decl)
    check_stage_count(stages, len(units) - 1)
    children = dict(model.named_children())

    def unit_size(u) -> int:
        items = decl[u.segment][1]
        if u.block is not None:
            return sum(p.numel() for p in children[items[0]][u.block].parameters())
        return sum(p.numel() for item in items if item in children for p in children[item].parameters())

    cuts = linear_partition([unit_size(u) for u in units], stages)
    return [units[c].point for c in cuts]


#: an activation crossing a stage boundary, per row: ``(shape without the batch dim, dtype)``
ActivationSpec = Tuple[Tuple[int, ...], torch.dtype]


def activation_specs(
    stage_list: Sequence[nn.Module], sample: torch.Tensor, autocast: Callable[[], Any] = contextlib.nullcontext
) -> List[ActivationSpec]:
    """The input of every stage and the last output, as :data:`ActivationSpec` (``len(stage_list) + 1``).

    Run once on ``sample`` (a couple of rows, on the stages' device) in eval mode without
    gradients, under ``autocast`` (which decides the activations' dtypes): no running statistic
    moves. The pipeline's schedules use these to size their buffers (static mode: no shape
    exchange between the ranks at the first step).
    """
    modes = [m.training for s in stage_list for m in s.modules()]
    specs: List[ActivationSpec] = [(tuple(sample.shape[1:]), sample.dtype)]
    try:
        for s in stage_list:
            s.eval()
        with torch.no_grad(), autocast():
            x = sample
            for s in stage_list:
                x = s(x)
                specs.append((tuple(x.shape[1:]), x.dtype))
    finally:
        for m, mode in zip((m for s in stage_list for m in s.modules()), modes):
            m.training = mode
    return specs


def chained_activation_specs(
    module: nn.Module, layout: "PipelineLayout", input_spec: ActivationSpec, device: torch.device,
    autocast: Callable[[], Any] = contextlib.nullcontext,
) -> List[ActivationSpec]:
    """Every stage's input and the last output (as :func:`activation_specs`), when each rank holds
    only its own stage: stage ``k`` runs its module on two rows of stage ``k - 1``'s output spec and
    passes its own on (``stages`` tiny gathers over this replica's pipeline group, in order)."""
    specs: List[ActivationSpec] = [input_spec]
    for k in range(layout.stages):
        mine: Any = None
        if k == layout.stage:
            shape, dtype = specs[-1]
            sample = torch.zeros((2, *shape), dtype=dtype, device=device)
            try:
                mine = activation_specs([module], sample, autocast)[-1]
            except Exception as e:  # noqa: BLE001 - raised on every rank below, so none waits for it
                mine = f"{type(e).__name__}: {e}"
        found = layout.pipe_ctx.all_gather_object(mine)[k]
        if isinstance(found, str):
            raise RuntimeError(
                f"pipeline stage {k} fails on an input of shape {[2, *specs[-1][0]]} ({specs[-1][1]}): {found}"
            )
        specs.append(found)
    return specs


class PipelineRunner:
    """One stage's torch.distributed.pipelining schedule, fed whole local batches.

    ``loss_fn(embeddings, labels)`` runs on the last stage for each micro-batch; its values are
    summed by autograd, so it must already carry the ``1 / micro_batches`` weight (gradients are
    not rescaled by the schedule: the head's parameters are not the stage's). Micro-batches have
    a fixed shape (the schedule's buffers are sized once, from ``specs``, this stage's input and
    output :data:`ActivationSpec`), so every step's local batch must be ``local_batch`` rows,
    divisible by ``micro_batches``. BatchNorm with batch statistics raises unless
    ``allow_micro_batch_stats`` (each micro-batch is then normalised on its own, as under
    gradient accumulation over micro-batches).
    """

    def __init__(
        self,
        module: nn.Module,
        layout: PipelineLayout,
        device: torch.device,
        *,
        schedule: str,
        micro_batches: int,
        local_batch: int,
        specs: Tuple[ActivationSpec, ActivationSpec],
        loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
        allow_micro_batch_stats: bool = False,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        if schedule not in SCHEDULES:
            raise ValueError(f"pipeline_schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
        self.micro_batches = check_positive_int("micro_batches", micro_batches)
        self.local_batch = check_positive_int("local_batch", local_batch)
        if local_batch % micro_batches:
            raise ValueError(
                f"the local batch of {local_batch} rows is not divisible by micro_batches={micro_batches}: "
                "pipeline micro-batches have a fixed shape (choose a batch size that is a multiple of it)"
            )
        if schedule == "1f1b" and micro_batches < layout.stages:
            raise ValueError(
                f"pipeline_schedule='1f1b' needs micro_batches >= pipeline_stages, got micro_batches={micro_batches} "
                f"for {layout.stages} stages (use more micro-batches, or gpipe)"
            )
        if layout.is_last and loss_fn is None:
            raise ValueError("the last stage needs a loss_fn")
        self.module, self.layout = module, layout
        self.allow_micro_batch_stats = bool(allow_micro_batch_stats)
        rows = local_batch // micro_batches
        (in_shape, in_dtype), (out_shape, out_dtype) = specs
        # requires_grad is part of the metadata: a received activation must carry its gradient back.
        example_in = torch.empty((rows, *in_shape), dtype=in_dtype, device="meta", requires_grad=not layout.is_first)
        example_out = torch.empty((rows, *out_shape), dtype=out_dtype, device="meta", requires_grad=True)
        stage = PipelineStage(module, layout.stage, layout.stages, device, input_args=example_in,
                              output_args=example_out, group=layout.pipe_group)
        _count_sends(stage)
        kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        # Every stage's schedule needs a loss_fn, else it runs no backward; only the last calls it.
        self.schedule = kind(stage, micro_batches, loss_fn=loss_fn or _no_loss_here, scale_grads=False)

    def _check_batch(self, rows: int) -> None:
        if rows != self.local_batch:
            raise ValueError(
                f"pipeline: a local batch of {rows} rows, but the schedule was built for local_batch="
                f"{self.local_batch} (micro-batches have a fixed shape: every step needs the same batch)"
            )
        if self.micro_batches > 1 and not self.allow_micro_batch_stats:
            found = batch_stats_module(self.module)
            if found is not None:
                name, m = found
                raise RuntimeError(
                    f"pipeline: {type(m).__name__} {name!r} normalises with batch statistics, and "
                    f"micro_batches={self.micro_batches} would normalise each micro-batch on its own, unlike an "
                    "unpipelined step; opt in with allow_micro_batch_stats (--micro-batch-stats: the semantics "
                    "of gradient accumulation over micro-batches), use micro_batches=1, or eval-mode BatchNorm"
                )

    def step(self, images: Optional[torch.Tensor], labels: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Forward and backward of one local batch (collective over the pipeline group).

        The first stage passes ``images``, the last ``labels`` (both rows of the same batch);
        returns the sum of the micro-batch losses on the last stage, else None. Gradients are
        accumulated into the stage's ``.grad`` (and the head's, through ``loss_fn``).
        """
        first, last = self.layout.is_first, self.layout.is_last
        self._check_batch((images if first else labels).shape[0] if (first or last) else self.local_batch)
        if first:
            self.schedule.step(images)
            return None
        if last:
            losses: List[torch.Tensor] = []
            self.schedule.step(target=labels, losses=losses, return_outputs=False)
            return torch.stack([x.detach() for x in losses]).sum()
        self.schedule.step()
        return None


#: ``count_comm`` kinds of the pipeline's point-to-point traffic, counted where it is sent
STAGE_ACTIVATIONS = "pipeline_activations"
STAGE_GRADIENTS = "pipeline_activation_grads"


def _count_sends(stage: Any) -> None:
    """Count (:func:`~shardfc.parallel.collectives.record_comm_bytes`) the bytes this stage sends:
    each micro-batch's output activation to the next stage, and the gradient of its input to the
    previous one, as the schedule issues the sends (what a rank receives, its neighbour counts)."""
    from shardfc.parallel.collectives import record_comm_bytes

    def counted(get_ops: Callable[[int], list], kind: str) -> Callable[[int], list]:
        def get(chunk: int) -> list:
            ops = get_ops(chunk)
            nbytes = sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
            if nbytes:
                record_comm_bytes(kind, nbytes)
            return ops

        return get

    stage.get_fwd_send_ops = counted(stage.get_fwd_send_ops, STAGE_ACTIVATIONS)
    stage.get_bwd_send_ops = counted(stage.get_bwd_send_ops, STAGE_GRADIENTS)


def _no_loss_here(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("the loss is computed on the last pipeline stage only")


def average_gradients_(params: Sequence[nn.Parameter], ctx: DistContext) -> None:
    """Average the parameters' gradients over ``ctx``'s ranks in one flat all-reduce (in place).

    Every rank must hold the same parameters with gradients (replicas of one stage do).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if ctx.world_size == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    ctx.all_reduce_(flat)
    flat.div_(ctx.world_size)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def gather_object_to(layout: PipelineLayout, obj: Any, dst_stage: int) -> Optional[List[Any]]:
    """Replica 0's pipeline: every stage's ``obj`` (in stage order) on stage ``dst_stage``, None elsewhere.

    Collective over replica 0's pipeline group; the ranks of the other replicas return None at once.
    """
    if layout.replica != 0:
        return None
    out: Optional[List[Any]] = [None] * layout.stages if layout.stage == dst_stage else None
    dist.gather_object(obj, out, dst=layout.rank_of(dst_stage, 0), group=layout.pipe_group)
    return out
