"""Forward only through 3 pipeline stages (gloo, 3 ranks): the unsplit model's outputs, any row count."""

from __future__ import annotations

import torch
from torch import nn

from shardfc.parallel.context import DistContext
from shardfc.parallel.launch import spawn
from shardfc.parallel.pipeline import activation_specs, create_layout
from shardfc.parallel.pipeline_forward import PipelinedForward, micro_batch_sizes, serve_forward

ROWS = (7, 1, 3)  # 7 rows in 3 micro-batches of 3, 3, 1; a single row; as many rows as micro-batches


def _stages():
    torch.manual_seed(0)
    # Dropout: a stage left in training mode would change the outputs
    return [nn.Sequential(nn.Linear(5, 6), nn.Dropout(0.5), nn.ReLU()), nn.Sequential(nn.Linear(6, 4), nn.Dropout(0.5)),
            nn.Linear(4, 3)]


def _images(rows: int) -> torch.Tensor:
    return torch.randn(rows, 5, generator=torch.Generator().manual_seed(rows), dtype=torch.float64)


def _worker(rank: int, world: int):
    layout = create_layout(DistContext.resolve(), 3)
    stages = [s.double() for s in _stages()]
    specs = activation_specs(stages, _images(2))
    mine = stages[layout.stage].train()
    if layout.stage != 0:
        served = serve_forward(mine, layout, specs, torch.device("cpu"), micro_batches=3)
        return {"served": served, "training": mine.training}
    forward = PipelinedForward(mine, layout, specs, torch.device("cpu"), micro_batches=3).eval()
    outputs = [forward(_images(rows)) for rows in ROWS]
    errors = []
    try:
        forward(torch.zeros(2, 4, dtype=torch.float64))  # another input shape: refused before any message
    except ValueError as e:
        errors.append(str(e))
    forward.close()
    try:
        forward(_images(2))
    except RuntimeError as e:
        errors.append(str(e))
    return {"outputs": outputs, "errors": errors}


def test_forward_through_the_stages_is_the_unsplit_forward():
    assert micro_batch_sizes(7, 3) == [3, 3, 1] and micro_batch_sizes(1, 3) == [1] and micro_batch_sizes(3, 3) == [1, 1, 1]
    results = spawn(_worker, 3, backend="gloo", timeout_s=120)
    whole = nn.Sequential(*_stages()).double().eval()
    with torch.no_grad():
        for rows, out in zip(ROWS, results[0]["outputs"]):
            torch.testing.assert_close(out, whole(_images(rows)), rtol=1e-12, atol=1e-12)
    assert "take images of shape [N, 5]" in results[0]["errors"][0] and "closed" in results[0]["errors"][1]
    assert [r["served"] for r in results[1:]] == [len(ROWS)] * 2  # the refused call sent nothing
    assert all(r["training"] for r in results[1:])  # each stage's mode restored after serving
