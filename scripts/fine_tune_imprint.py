"""What imprinting buys when fine-tuning on a disjoint identity set, and what imprinting costs at 1M classes.

Fine-tuning table (docs/classes.md): a tiny backbone is trained on synthetic identities of seed 0,
then fine-tuned with ``--init-from`` on the identities of seed 1 (a disjoint set, under another
template), once with ``--head-init random`` and once with ``--head-init imprint``, everything else
equal. After 0, 50 and 200 steps it reports the verification accuracy on held-out pairs of unseen
seed-1 identities (what ``shardfc train`` evaluates) and the head's closed-set top-1 on held-out
images of the fine-tuning identities (how usable the head is).

Imprinting cost (``--imprint-classes``): :func:`shardfc.head.imprint.imprint_centres` over a
synthetic embedding stream (two per class), one process, against the tiny backbone's forward on
as many images.

    python scripts/fine_tune_imprint.py --out /tmp/ft            # the table
    python scripts/fine_tune_imprint.py --imprint-classes 1000000  # the timing only
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from shardfc.cli import train as train_cli
from shardfc.data import SyntheticIdentities
from shardfc.head.imprint import imprint_centres
from shardfc.models import build_backbone
from shardfc.parallel.context import DistContext
from shardfc.train.builder.factory import build_run
from shardfc.train.checkpointing.fine_tune import init_from, resolve_init_from
from shardfc.train.config import TrainConfig
from shardfc.train.loop import load_parts
from shardfc.train.observe.evaluate import build_targets

SIZE, DIM = 32, 64
COMMON = dict(backbone="tiny", image_size=[SIZE, SIZE], embedding_dim=DIM, batch_size=64, nproc=1, progress=False,
              eval_every=0, synthetic_val_pairs=1000, log_every=50, threads=2, warmup_steps=0)


def measure(parts, cfg: TrainConfig) -> dict:
    """Verification accuracy on unseen identities, and the head's top-1 on 3 held-out images per class."""
    target = build_targets(cfg, (SIZE, SIZE), torch.device("cpu"))[0]
    verification = target.evaluate(parts.module)["accuracy"]
    data = SyntheticIdentities(cfg.synthetic_identities, cfg.synthetic_images_per_identity, (SIZE, SIZE), seed=cfg.seed)
    ids = [c for c in range(cfg.synthetic_identities) for _ in range(3)]
    ks = [cfg.synthetic_images_per_identity + k for _ in range(cfg.synthetic_identities) for k in range(3)]
    model, head = parts.module.eval(), parts.head.eval()
    with torch.no_grad():
        _, top = head.predict(model(data.render_batch(ids, ks)), k=1)
    top1 = float((top[:, 0] == torch.tensor(ids)).float().mean())
    return {"verification": verification, "top1": top1}


def fine_tune_table(out: Path, pretrain_steps: int, steps: int, **options) -> list:
    pre = TrainConfig(**COMMON, synthetic_identities=200, synthetic_images_per_identity=20, seed=0,
                      max_steps=pretrain_steps, ckpt_every=0, output_dir=str(out / "pretrain"))
    if not (out / "pretrain" / "checkpoints").is_dir():
        train_cli.run(pre)
    rows = []
    for init in ("random", "imprint"):
        cfg = TrainConfig(**COMMON, synthetic_identities=100, synthetic_images_per_identity=10, seed=1,
                          init_from=str(out / "pretrain"), head_init=init, max_steps=steps, ckpt_every=50, keep_last=0,
                          output_dir=str(out / "-".join([f"ft-{init}"] + [f"{k}{v}" for k, v in options.items()])),
                          resume="none", **options).validate()
        path = resolve_init_from(cfg.init_from)
        started = time.time()
        run = build_run(cfg, DistContext(), classes_from=(path, True))
        init_from(run, path, cfg)
        setup_s = time.time() - started
        row = {"head_init": init, **options, "init_s": round(setup_s, 2), 0: measure(run.parts, cfg)}
        summary = train_cli.run(cfg)
        row["train_s"] = round(summary["wall_time_s"], 1)
        for step in (50, steps):
            parts, _ = load_parts(cfg, Path(cfg.output_dir) / "checkpoints" / f"step_{step:08d}")
            row[step] = measure(parts, cfg)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def imprint_timing(classes: int, dim: int = 128, per_class: int = 2, batch: int = 8192) -> dict:
    """Seconds to imprint ``classes`` centres from ``per_class`` embeddings each (one process), and the
    tiny backbone's forward time for as many 112x112 images (measured on a few batches)."""
    n = classes * per_class
    g = torch.Generator().manual_seed(0)
    stream_x = torch.randn(batch, dim, generator=g)

    def stream():
        for start in range(0, n, batch):
            b = min(batch, n - start)
            labels = (torch.arange(start, start + b) % classes)
            yield stream_x[:b], labels

    started = time.time()
    got = imprint_centres(stream(), range(classes), dim)
    imprint_s = time.time() - started
    assert int(got.counts.sum()) == n
    model = build_backbone("tiny", dim, input_size=(112, 112)).eval()
    images = torch.randn(64, 3, 112, 112, generator=g)
    with torch.no_grad():
        model(images)
        started = time.time()
        for _ in range(5):
            model(images)
        per_image = (time.time() - started) / (5 * 64)
    return {"classes": classes, "embeddings": n, "dim": dim, "imprint_s": round(imprint_s, 2),
            "tiny_forward_112_s_per_image": per_image, "tiny_forward_s_for_all": round(per_image * n, 1),
            "threads": torch.get_num_threads()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="folder for the fine-tuning runs (the table)")
    p.add_argument("--pretrain-steps", type=int, default=600)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--backbone-lr-mult", type=float, default=1.0, help="fine-tuning runs: --backbone-lr-mult")
    p.add_argument("--head-warmup-steps", type=int, default=0, help="fine-tuning runs: --head-warmup-steps")
    p.add_argument("--imprint-classes", type=int, default=0, help="time imprinting this many classes")
    p.add_argument("--imprint-dim", type=int, default=128, help="embedding width of the imprinting timing")
    args = p.parse_args()
    if args.imprint_classes:
        print(json.dumps(imprint_timing(args.imprint_classes, args.imprint_dim)), flush=True)
    if args.out:
        options = {k: v for k, v in (("backbone_lr_mult", args.backbone_lr_mult),
                                     ("head_warmup_steps", args.head_warmup_steps)) if v != {"backbone_lr_mult": 1.0}.get(k, 0)}
        fine_tune_table(args.out, args.pretrain_steps, args.steps, **options)


if __name__ == "__main__":
    main()
