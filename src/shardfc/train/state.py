"""What a run is made of (:class:`Parts`) and where it stands (:class:`RunState`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardfc.head import ShardedMarginHead
from shardfc.head.capture import CapturedHeadStep
from shardfc.head.triplet import BatchHardTripletLoss


@dataclass
class RunState:
    """Where training stands; saved in every checkpoint."""

    step: int = 0
    """Optimizer steps completed."""
    epoch: int = 0
    """Current pass over the data (the DistributedSampler's epoch)."""
    batch_in_epoch: int = 0
    """Micro-batches of ``epoch`` this rank has consumed."""
    batches_per_epoch: int = 0
    """Micro-batches per epoch per rank for the world size and batch size that saved this."""
    samples_seen: int = 0
    """Training images consumed over all ranks."""


@dataclass
class Parts:
    """The trainable parts of a run and their optimizers."""

    backbone: nn.Module
    """The backbone as the strategy trains it: in DDP (ddp, several ranks), in DataParallel (dp), plain, or
    (pipeline) this rank's stage of it."""
    head: Optional[ShardedMarginHead]
    """This rank's class shard of the margin head (None on a pipeline rank before the last stage)."""
    opt_backbone: torch.optim.Optimizer
    """torch SGD/AdamW over the backbone's trainable parameters (in hvd.DistributedOptimizer under horovod)."""
    opt_head: Optional[torch.optim.Optimizer]
    """:func:`shardfc.head.partial_fc.head_optimizer` over the head shard (None where ``head`` is)."""
    schedulers: List[torch.optim.lr_scheduler.LambdaLR]
    """Warm-up + decay schedule of each optimizer (backbone first; the head's where it has one)."""
    scaler: torch.amp.GradScaler
    """fp16 loss scaler (disabled for other precisions)."""
    triplet: Optional[BatchHardTripletLoss] = None
    """The global-batch triplet loss on the features before the neck (triplet_weight > 0), else None."""
    head_step: Optional[CapturedHeadStep] = None
    """The head's training step as a CUDA graph (``cuda_graph='head'``), else None: the head runs eagerly."""

    @property
    def module(self) -> nn.Module:
        """The plain backbone (unwrapped from DDP / DataParallel; a pipeline rank's stage): what is evaluated,
        saved and exported."""
        return self.backbone.module if isinstance(self.backbone, (DDP, nn.DataParallel)) else self.backbone
