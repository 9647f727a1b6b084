"""One rank of ``test_module_horovod``: run under ``horovodrun -np 2 --gloo python horovod_worker.py OUT``.

Runs the cases of ``test_module_distributed`` (whose heads are built without a group, so they find
Horovod's world through ``DistContext.resolve``) plus Horovod's own: an explicit ``context=``, a
backbone under ``hvd.DistributedOptimizer``, Partial FC, communication counts. Each rank writes
``OUT/rank<r>.pt``; the test asserts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

# This folder (the cases) and the tests' root (their helpers, as pytest's rootdir conftest puts it).
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import horovod.torch as hvd  # noqa: E402
import test_module_distributed as tmd  # noqa: E402

import shardfc  # noqa: E402
from shardfc import margins as M  # noqa: E402
from shardfc.head.module import init_rows  # noqa: E402
from shardfc.parallel import count_comm  # noqa: E402
from shardfc.parallel.context import DistContext  # noqa: E402

#: Cases repeated with equal local batches: the reduce-scatter then runs as hvd.reducescatter.
EQUAL_SIZE_CASES = ("margin=arcface", "margin=sphereface", "reduction=none", "chunked+none+ignore")


def explicit_context_case(rank, world):
    """``ShardedMarginHead(context=DistContext.horovod())`` is the same head as the default one."""
    ctx = DistContext.horovod()
    B, lo, hi = tmd._rows(rank, world)
    x, y, _ = tmd._global_data(B)
    head = shardfc.ShardedMarginHead(tmd.D, tmd.C, margin=tmd.MARGINS["cosface"], context=ctx, dtype=torch.float64)
    xr = x[lo:hi].clone().requires_grad_()
    loss = head(xr, y[lo:hi])
    loss.backward()
    W_full = init_rows(0, tmd.C, tmd.D, 0).double().requires_grad_()
    x_ref = x.clone().requires_grad_()
    ref = shardfc.reference_loss(x_ref, W_full, y, tmd.MARGINS["cosface"])
    ref.backward()
    r = head.class_range
    return {
        "mode": head.mode,
        "backend": head.ctx.backend,
        "range": (r.start, r.stop),
        "loss": tmd._rel(loss.detach(), ref.detach()),
        "grad_embeddings": tmd._rel(xr.grad, world * x_ref.grad[lo:hi]),
        "grad_weight": tmd._rel(head.weight.grad, W_full.grad[r.start : r.stop]),
    }


def distributed_optimizer_case(rank, world):
    """A backbone under hvd.DistributedOptimizer (op=Average) + the head: one process's gradients."""
    B, lo, hi = tmd._rows(rank, world)
    g = torch.Generator().manual_seed(7)
    inputs = torch.randn(B, 10, generator=g, dtype=torch.float64)
    labels = torch.randint(0, tmd.C, (B,), generator=g)

    def make_backbone():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, tmd.D)).double()

    backbone = make_backbone()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(backbone.parameters(), lr=0.1), named_parameters=backbone.named_parameters(), op=hvd.Average
    )
    head = shardfc.ShardedMarginHead(tmd.D, tmd.C, margin=M.ArcFace(64.0, 0.5), dtype=torch.float64)
    loss = head(backbone(inputs[lo:hi]), labels[lo:hi])
    loss.backward()
    opt.synchronize()  # the averaged backbone gradients

    ref_backbone = make_backbone()
    W_full = init_rows(0, tmd.C, tmd.D, 0).double().requires_grad_()
    ref = shardfc.reference_loss(ref_backbone(inputs), W_full, labels, M.ArcFace(64.0, 0.5))
    ref.backward()
    r = head.class_range
    errs = [tmd._rel(p.grad, q.grad) for p, q in zip(backbone.parameters(), ref_backbone.parameters())]
    with opt.skip_synchronize():
        opt.step()
    return {"backbone": max(errs), "head": tmd._rel(head.weight.grad, W_full.grad[r.start : r.stop]),
            "loss": tmd._rel(loss.detach(), ref.detach())}


def apply_gradients_case(rank, world):
    """The trainer's step end under Horovod: gradients averaged *before* clipping, as DDP's are.

    Clipping is made active (max norm far below the gradients'); the backbone and head after one
    SGD step must equal a single process's: the exact gradient, clipped, applied.
    """
    from shardfc.train.state import Parts
    from shardfc.train.step import apply_gradients

    B, lo, hi = tmd._rows(rank, world)
    g = torch.Generator().manual_seed(11)
    inputs = torch.randn(B, 10, generator=g, dtype=torch.float64)
    labels = torch.randint(0, tmd.C, (B,), generator=g)
    max_norm, lr = 1e-3, 0.5

    def make_backbone():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, tmd.D)).double()

    backbone = make_backbone()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(backbone.parameters(), lr=lr), named_parameters=backbone.named_parameters(), op=hvd.Average
    )
    head = shardfc.ShardedMarginHead(tmd.D, tmd.C, dtype=torch.float64)
    parts = Parts(backbone, head, opt, torch.optim.SGD(head.parameters(), lr=lr), [],
                  torch.amp.GradScaler("cpu", enabled=False))
    head(backbone(inputs[lo:hi]), labels[lo:hi]).backward()
    apply_gradients(parts, max_norm, head.ctx, head_grad_clip=max_norm)

    ref_backbone = make_backbone()
    W_full = init_rows(0, tmd.C, tmd.D, 0).double().requires_grad_()
    shardfc.reference_loss(ref_backbone(inputs), W_full, labels, M.ArcFace()).backward()
    with torch.no_grad():
        torch.nn.utils.clip_grad_norm_(list(ref_backbone.parameters()), max_norm)
        torch.nn.utils.clip_grad_norm_([W_full], max_norm)
        for p in [*ref_backbone.parameters(), W_full]:
            p -= lr * p.grad
    r = head.class_range
    return {
        "backbone": max(tmd._rel(p.detach(), q.detach()) for p, q in zip(backbone.parameters(), ref_backbone.parameters())),
        "head": tmd._rel(head.weight.detach(), W_full.detach()[r.start : r.stop]),
    }


def partial_fc_case(rank, world):
    """Partial FC over Horovod equals the dense loss over exactly the sampled classes."""
    B, lo, hi = tmd._rows(rank, world)
    x, y, _ = tmd._global_data(B)
    margin = M.CosFace(64.0, 0.35)
    head = shardfc.ShardedMarginHead(tmd.D, tmd.C, margin=margin, sample_rate=0.4, sample_seed=3, dtype=torch.float64)
    xr = x[lo:hi].clone().requires_grad_()
    loss = head(xr, y[lo:hi])
    loss.backward()
    # The rows that received a gradient are the sampled ones (a row-sparse update's view of the sample).
    touched = (head.weight.grad != 0).any(dim=1).nonzero().flatten() + head.class_range.start
    kept = torch.tensor(sorted(sum(head.ctx.all_gather_object(touched.tolist()), [])))
    W_full = init_rows(0, tmd.C, tmd.D, 0).double().requires_grad_()
    x_ref = x.clone().requires_grad_()
    remap = torch.full((tmd.C,), -1, dtype=torch.long)
    remap[kept] = torch.arange(kept.numel())
    ref = shardfc.reference_loss(x_ref, W_full[kept], remap[y], margin)
    ref.backward()
    r = head.class_range
    return {
        "loss": tmd._rel(loss.detach(), ref.detach()),
        "grad_embeddings": tmd._rel(xr.grad, world * x_ref.grad[lo:hi]),
        "grad_weight": tmd._rel(head.weight.grad, W_full.grad[r.start : r.stop]),
    }


def counted_case(rank, world):
    """count_comm sees the head's collectives under Horovod, by the same kinds as under torch.distributed."""
    B, lo, hi = tmd._rows(rank, world)
    x, y, _ = tmd._global_data(B)
    head = shardfc.ShardedMarginHead(tmd.D, tmd.C, dtype=torch.float64)
    xr = x[lo:hi].clone().requires_grad_()
    # A step of a known workload: impl="auto"'s agreement (one all-reduce, at a workload's first
    # forward, or in none if an earlier case of this process met the workload) stays out of the count.
    head(xr, y[lo:hi])
    with count_comm() as counter:
        head(xr, y[lo:hi]).backward()
    return {"bytes": dict(counter.bytes), "calls": dict(counter.calls)}


def main(out: Path) -> None:
    torch.set_num_threads(1)
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    result = {
        "world": world,
        "resolved_backend": DistContext.resolve().backend,
        "cases": {name: tmd._run_case(rank, world, opts) for name, opts in tmd.CASES.items()},
        "bad": tmd._bad_input_cases(rank, world),
        "predict": tmd._predict_case(rank, world),
        "context": explicit_context_case(rank, world),
        "optimizer": distributed_optimizer_case(rank, world),
        "apply_gradients": apply_gradients_case(rank, world),
        "partial": partial_fc_case(rank, world),
        "counted": counted_case(rank, world),
    }
    unequal = list(tmd.SIZES[world])
    tmd.SIZES[world] = [4] * world
    result["equal_cases"] = {name: tmd._run_case(rank, world, tmd.CASES[name]) for name in EQUAL_SIZE_CASES}
    tmd.SIZES[world] = unequal
    torch.save(result, out / f"rank{rank}.pt")
    hvd.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
