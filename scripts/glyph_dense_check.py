"""The sharded head on 2 ranks against a plain dense head in one process, on glyph identities: their
loss curves must agree step for step to float rounding (issue 34; docs/accuracy.md).

Both train the same GlyphNet from the same initial weights on the same batches with ArcFace and SGD
(momentum, weight decay):

* **sharded**: 2 gloo ranks; each runs the backbone on its half of the global batch, the head is a
  :class:`shardfc.ShardedMarginHead` over both (each rank holds half the classes, the loss is the
  global batch's mean), and the backbone's gradients are averaged over the ranks (as DDP does: the
  head hands each rank W times its part of the embedding gradient);
* **dense**: one process; the backbone runs on the same two halves (so BatchNorm sees the same
  statistics), the embeddings are concatenated and the loss is ``F.cross_entropy`` over the full
  ``[B, C]`` logits with the margin on the target (:func:`shardfc.head.reference.reference_logits`),
  one ``nn.Parameter`` ``[C, D]`` initialised with the sharded head's rows.

Training is chaotic at float rounding: a relative change of 1e-7 in one weight of the dense run
grows to a visible difference in its own loss within steps. So the check reports, step by step,
the sharded-vs-dense difference beside the dense-vs-nudged-dense one: at step 1 the first must be
float rounding (≈ 1e-7), and after it no larger than the second.

    python scripts/glyph_dense_check.py --data-root data/glyphs --steps 300 --out glyph_dense_check.json
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch
import torch.nn.functional as F

LR, MOMENTUM, WEIGHT_DECAY, SCALE, MARGIN = 0.05, 0.9, 5e-4, 32.0, 0.5
#: The dense run is repeated with one weight tensor scaled by 1 + NUDGE: how far float rounding's
#: size of a difference carries in this training, to read the sharded-vs-dense gap against.
NUDGE = 1e-7


def _batches(data_root: str, steps: int, batch: int, seed: int):
    from shardfc.data.recordio import RecordIODataset

    ds = RecordIODataset(data_root, (32, 32), train=False)
    order = np.random.default_rng(seed).permutation(len(ds))
    need = steps * batch
    idx = np.resize(order, need).reshape(steps, batch)
    cache = {}

    def item(i):
        if i not in cache:
            cache[i] = ds[int(i)]
        return cache[i]

    for row in idx:
        xs, ys = zip(*(item(i) for i in row))
        yield torch.stack(xs), torch.as_tensor(ys, dtype=torch.int64)


def _backbone(seed: int, dim: int):
    from shardfc.models import build_backbone

    torch.manual_seed(seed)
    return build_backbone("glyphnet", dim, input_size=(32, 32))


def _sharded(rank: int, world: int, data_root: str, steps: int, batch: int, seed: int, dim: int, classes: int):
    import torch.distributed as dist

    import shardfc
    from shardfc.head.margins import ArcFace

    torch.set_num_threads(1)
    net = _backbone(seed, dim)
    head = shardfc.ShardedMarginHead(dim, classes, margin=ArcFace(scale=SCALE, margin=MARGIN), init_seed=seed)
    opt = torch.optim.SGD(list(net.parameters()) + list(head.parameters()), lr=LR, momentum=MOMENTUM,
                          weight_decay=WEIGHT_DECAY)
    half = batch // world
    losses = []
    for x, y in _batches(data_root, steps, batch, seed):
        xr, yr = x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]
        loss = head(net(xr), yr)
        opt.zero_grad()
        loss.backward()
        # The head's convention (DDP's): each rank's embedding gradient is W times its part of the
        # global objective's, so the average over the ranks is the backbone's exact gradient.
        for p in net.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _dense(data_root: str, steps: int, batch: int, seed: int, dim: int, classes: int, world: int,
           nudge: float = 0.0):
    import shardfc
    from shardfc.head.margins import ArcFace
    from shardfc.head.reference import reference_logits

    net = _backbone(seed, dim)
    with torch.no_grad():  # a change of one weight by a relative `nudge`: float rounding's size
        next(net.parameters()).mul_(1.0 + nudge)
    margin = ArcFace(scale=SCALE, margin=MARGIN)
    # the same initial centres as the sharded head's (its rows are drawn per class, whatever the shards)
    weight = torch.nn.Parameter(shardfc.ShardedMarginHead(dim, classes, margin=margin, init_seed=seed).weight.detach().clone())
    opt = torch.optim.SGD(list(net.parameters()) + [weight], lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    half = batch // world
    losses = []
    for x, y in _batches(data_root, steps, batch, seed):
        emb = torch.cat([net(x[r * half:(r + 1) * half]) for r in range(world)])  # BN per rank's half, as there
        loss = F.cross_entropy(reference_logits(emb, weight, y, margin), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def plot(result: dict, path: str) -> None:
    """The three loss curves and the two relative differences, step by step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d, s, n = (np.asarray(result[k]) for k in ("dense", "sharded", "dense_nudged"))
    steps = np.arange(1, len(d) + 1)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    ax.plot(steps, d, label="dense, 1 process (F.cross_entropy)", lw=1.2)
    ax.plot(steps, s, label="sharded, 2 ranks", lw=1, ls="--")
    ax.plot(steps, n, label=f"dense, one weight x (1 + {result['nudge']:g})", lw=0.8, alpha=0.7)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend(fontsize=8)
    floor = 1e-9
    bx.semilogy(steps, np.maximum(np.abs(s - d) / np.abs(d), floor), label="sharded vs dense", lw=1)
    bx.semilogy(steps, np.maximum(np.abs(n - d) / np.abs(d), floor), label="nudged dense vs dense", lw=1, alpha=0.8)
    bx.set_xlabel("step")
    bx.set_ylabel("relative loss difference")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    from shardfc.data.recordio import RecordIODataset
    from shardfc.parallel.launch import spawn

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-root", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="glyph_dense_check.json")
    p.add_argument("--plot", default=None, help="also draw the curves (PNG)")
    args = p.parse_args(argv)
    classes = RecordIODataset(args.data_root, (32, 32)).num_classes
    world = 2
    sharded = spawn(_sharded, world, args.data_root, args.steps, args.batch, args.seed, args.dim, classes)
    dense = _dense(args.data_root, args.steps, args.batch, args.seed, args.dim, classes, world)
    nudged = _dense(args.data_root, args.steps, args.batch, args.seed, args.dim, classes, world, nudge=NUDGE)
    assert sharded[0] == sharded[1], "the ranks disagree on the global loss"
    s, d, n = np.asarray(sharded[0]), np.asarray(dense), np.asarray(nudged)
    rel = np.abs(s - d) / np.maximum(np.abs(d), 1e-12)
    rel_nudged = np.abs(n - d) / np.maximum(np.abs(d), 1e-12)
    at = (1, 2, 5, 10, 50, len(rel))
    result = dict(steps=args.steps, batch=args.batch, classes=classes, dim=args.dim, seed=args.seed, nudge=NUDGE,
                  sharded=s.tolist(), dense=d.tolist(), dense_nudged=n.tolist(), max_rel_diff=float(rel.max()),
                  sharded_vs_dense={str(k): float(rel[k - 1]) for k in at if k <= len(rel)},
                  nudged_vs_dense={str(k): float(rel_nudged[k - 1]) for k in at if k <= len(rel)})
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    if args.plot:
        plot(result, args.plot)
    print(f"{args.steps} steps, {classes} classes: loss {d[0]:.4f} -> {d[-1]:.4f} (dense), "
          f"{s[0]:.4f} -> {s[-1]:.4f} (sharded, 2 ranks)")
    print("relative difference at step " + ", ".join(
        f"{k}: {result['sharded_vs_dense'][k]:.1e} (dense vs dense nudged by {NUDGE:g}: {result['nudged_vs_dense'][k]:.1e})"
        for k in result["sharded_vs_dense"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
