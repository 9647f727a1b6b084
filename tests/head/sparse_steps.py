"""Training a dense-gradient head and its sparse-gradient twin side by side (shared by the sparse tests)."""

from __future__ import annotations

from typing import Callable, Sequence, Tuple

import torch


def step_both(heads: Sequence, opts: Sequence, batch: Callable[[int, int], Tuple[torch.Tensor, torch.Tensor]],
              rows: int, steps: int = 3, micro_batches: int = 2) -> torch.Tensor:
    """``steps`` optimizer steps of ``micro_batches`` each on every head; ``batch(step, micro)`` gives the
    data. Returns which of the ``rows`` weight rows (all shards, in order) a sparse head sampled."""
    touched = torch.zeros(rows, dtype=torch.bool)
    for step in range(steps):
        for head, opt in zip(heads, opts):
            opt.zero_grad(set_to_none=False)
            for micro in range(micro_batches):
                x, y = batch(step, micro)
                head(x, y).backward()
            if head.sparse_grad:
                offset = 0
                for w, sampled in zip(head.shard_weights, head.sampled_rows):
                    touched[sampled + offset] = True
                    offset += w.shape[0]
            opt.step()
    return touched
