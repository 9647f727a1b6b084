"""Forward only through the pipeline: evaluate a backbone that no rank holds whole.

Evaluation runs on world rank 0 (stage 0 of replica 0), with the same code as under every other
strategy: a module mapping images to embeddings. Under the pipeline strategy that module is a
:class:`PipelinedForward`: each call cuts its batch into micro-batches and sends them through
replica 0's stages, point to point, while the other ranks of that pipeline run
:func:`serve_forward` (each receives a micro-batch from the previous stage, runs its stage, and
passes the result on; the last stage returns the embeddings to rank 0). So no rank holds more
than its stage, and stage ``k`` works on micro-batch ``i`` while stage ``k - 1`` works on ``i + 1``.

Every call starts with a one-integer broadcast over the pipeline group (the batch's row count,
from which every stage derives the same micro-batch sizes); :meth:`PipelinedForward.close`
broadcasts -1, which ends the other ranks' :func:`serve_forward`. The shapes and dtypes between
stages are the training's (:func:`~shardfc.parallel.pipeline.chained_activation_specs`), so the
images must have the training's size. The other replicas take no part.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, List, Sequence

import torch
import torch.distributed as dist
from torch import nn

from shardfc.checks import check_positive_int
from shardfc.parallel.pipeline import ActivationSpec, PipelineLayout

__all__ = ["PipelinedForward", "serve_forward"]

#: the row count :meth:`PipelinedForward.close` broadcasts: no more batches
STOP = -1


def micro_batch_sizes(rows: int, micro_batches: int) -> List[int]:
    """``rows`` cut into at most ``micro_batches`` near-equal parts (what every stage computes alike)."""
    size = -(-rows // micro_batches)
    return [min(size, rows - start) for start in range(0, rows, size)]


def _header(layout: PipelineLayout, rows: int = 0) -> int:
    """Broadcast ``rows`` from stage 0 over replica 0's pipeline group; every rank returns it."""
    header = torch.tensor([rows], dtype=torch.int64, device=layout.pipe_ctx.comm_device)
    dist.broadcast(header, src=layout.rank_of(0, 0), group=layout.pipe_group)
    return int(header.item())


class PipelinedForward(nn.Module):
    """The whole backbone's forward on stage 0 of replica 0, computed by replica 0's stages.

    Args:
        stage: This rank's stage module (stage 0): registered as a child, so ``eval()`` and
            ``train()`` reach it, and its parameters tell the evaluation the device.
        layout: This rank's place (stage 0 of replica 0).
        specs: Every stage's input and the last output, as :data:`ActivationSpec` (``stages + 1``).
        device: Where the stages compute.
        micro_batches: How many micro-batches each call's batch is cut into.
    """

    def __init__(
        self, stage: nn.Module, layout: PipelineLayout, specs: Sequence[ActivationSpec], device: torch.device,
        micro_batches: int,
    ) -> None:
        super().__init__()
        if layout.stage != 0 or layout.replica != 0:
            raise ValueError(f"PipelinedForward runs on stage 0 of replica 0, not stage {layout.stage} of "
                             f"replica {layout.replica} (the other ranks run serve_forward)")
        self.stage, self.layout, self.specs, self.device = stage, layout, list(specs), torch.device(device)
        self.micro_batches = check_positive_int("micro_batches", micro_batches)
        self._closed = False

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self._closed:
            raise RuntimeError("PipelinedForward is closed: the other stages no longer serve")
        expected = tuple(self.specs[0][0])
        if tuple(images.shape[1:]) != expected:  # checked before any message: the other ranks keep waiting
            raise ValueError(f"the pipeline's stages take images of shape [N, {', '.join(map(str, expected))}] (the "
                             f"training's), got {list(images.shape)}")
        rows = images.shape[0]
        _header(self.layout, rows)
        last = self.layout.rank_of(self.layout.stages - 1, 0)
        out_shape, out_dtype = self.specs[-1]
        sent, works, outputs = [], [], []
        # All micro-batches out first (non-blocking), then the embeddings back: the stages overlap.
        for chunk in images.split(micro_batch_sizes(rows, self.micro_batches)):
            sent.append(self.stage(chunk.to(self.device)).to(self.specs[1][1]).contiguous())  # alive until sent
            works.append(dist.isend(sent[-1], dst=self.layout.rank_of(1, 0), group=self.layout.pipe_group))
        for size in micro_batch_sizes(rows, self.micro_batches):
            out = torch.empty((size, *out_shape), dtype=out_dtype, device=self.device)
            dist.recv(out, src=last, group=self.layout.pipe_group)
            outputs.append(out)
        for work in works:
            work.wait()
        return torch.cat(outputs)

    def close(self) -> None:
        """End the other ranks' :func:`serve_forward` (once; a no-op afterwards)."""
        if not self._closed:
            self._closed = True
            _header(self.layout, STOP)


def serve_forward(
    stage: nn.Module, layout: PipelineLayout, specs: Sequence[ActivationSpec], device: torch.device,
    micro_batches: int, autocast: Callable[[], Any] = contextlib.nullcontext,
) -> int:
    """On replica 0's stages after the first: run this stage's forward for every batch stage 0's
    :class:`PipelinedForward` sends, until it is closed (eval mode, no gradients, under ``autocast``;
    the module's modes are restored afterwards). Returns the batches served."""
    if layout.replica != 0 or layout.stage == 0:
        raise ValueError(f"serve_forward runs on replica 0's stages after the first, not stage {layout.stage} of "
                         f"replica {layout.replica}")
    modes = [(m, m.training) for m in stage.modules()]
    stage.eval()
    source = layout.rank_of(layout.stage - 1, 0)
    target = layout.rank_of(0 if layout.is_last else layout.stage + 1, 0)  # the last stage answers stage 0
    (in_shape, in_dtype), out_dtype = specs[layout.stage], specs[layout.stage + 1][1]
    served = 0
    try:
        with torch.no_grad(), autocast():
            while (rows := _header(layout)) != STOP:
                for size in micro_batch_sizes(rows, micro_batches):
                    x = torch.empty((size, *in_shape), dtype=in_dtype, device=device)
                    dist.recv(x, src=source, group=layout.pipe_group)
                    dist.send(stage(x).to(out_dtype).contiguous(), dst=target, group=layout.pipe_group)
                served += 1
    finally:
        for m, mode in modes:
            m.training = mode
    return served
