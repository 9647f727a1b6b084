"""``shardfc demo``: a sharded ArcFace head trained on 2 spawned CPU processes, loss printed.

Each rank holds half of the classes; a small MLP backbone runs in DDP on each rank's half of the
batch. Features are synthetic (a random prototype per class plus noise), so it needs no data.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import List, Optional

import torch
from torch import nn

from shardfc.head import margins
from shardfc.head.module import ShardedMarginHead
from shardfc.head.partial_fc import head_optimizer
from shardfc.parallel.launch import spawn


def _train(rank: int, world: int, args) -> List[float]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    prototypes = torch.randn(args.classes, 64, generator=g)
    backbone = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, args.dim)))
    head = ShardedMarginHead(args.dim, args.classes, margin=margins.ArcFace(32.0, 0.3))
    opt = torch.optim.SGD(backbone.parameters(), lr=0.05, momentum=0.9)
    opt_head = head_optimizer(head, "sgd", lr=0.05, momentum=0.9, weight_decay=0.0)
    if rank == 0:
        print(f"{world} ranks; rank 0 holds classes {head.class_range.start}..{head.class_range.stop - 1} of {args.classes}")
    losses = []
    for step in range(args.steps):
        labels = torch.randint(0, args.classes, (args.batch,), generator=g)
        feats = prototypes[labels] + 0.5 * torch.randn(args.batch, 64, generator=g)
        local = slice(rank * args.batch // world, (rank + 1) * args.batch // world)
        loss = head(backbone(feats[local]), labels[local])
        opt.zero_grad()
        opt_head.zero_grad()
        loss.backward()
        opt.step()
        opt_head.step()
        losses.append(loss.item())
        if rank == 0 and (step % 20 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():8.4f}", flush=True)
    return losses


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="shardfc demo", description=__doc__)
    p.add_argument("--nproc", type=int, default=2, help="processes to spawn (gloo on CPU; default: 2)")
    p.add_argument("--classes", type=int, default=2_000, help="number of classes, sharded over the processes (default: 2000)")
    p.add_argument("--dim", type=int, default=64, help="embedding width (default: 64)")
    p.add_argument("--batch", type=int, default=256, help="global batch size (default: 256)")
    p.add_argument("--steps", type=int, default=100, help="training steps (default: 100)")
    args = p.parse_args(argv)
    for name in ("nproc", "classes", "dim", "batch", "steps"):  # one line each, before any process starts
        if getattr(args, name) < 1:
            print(f"shardfc demo: error: --{name} must be >= 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    start = time.time()
    losses = spawn(_train, args.nproc, args, backend="gloo")[0]
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {time.time() - start:.1f}s")
    return 0 if losses[-1] < losses[0] else 1
