"""``shardfc import-arcface``: an insightface arcface_torch run (or released backbone) as a shardfc checkpoint.

The checkpoint lands in ``OUT/checkpoints``; ``shardfc train --output-dir OUT --resume auto`` continues
it on any number of processes, ``shardfc eval/export/embed --checkpoint OUT`` use its backbone.
"""

from __future__ import annotations

import argparse
import glob
import sys
from typing import List, Optional

from shardfc import checkpoint as ckpt
from shardfc.checkpoint.format import read_meta
from shardfc.models import BACKBONES
from shardfc.train.checkpointing.arcface_import import import_arcface

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardfc import-arcface", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--backbone", required=True, metavar="FILE",
                   help="arcface_torch backbone state dict (model.pt, backbone.pth) or a checkpoint_gpu_<r>.pt")
    p.add_argument("--network", required=True, choices=sorted(BACKBONES),
                   help="the shardfc backbone with the same architecture (iresnet50 for arcface_torch's r50, mbf for its mbf)")
    p.add_argument("--head", nargs="+", default=None, metavar="FILE",
                   help="the per-rank FC shards: checkpoint_gpu_*.pt (PartialFC_V2) or rank_*_softmax_weight.pt "
                        "(PartialFC); quoted glob patterns are expanded")
    p.add_argument("--num-classes", type=int, default=None,
                   help="without --head: classes of the fresh head to fine-tune on (with --head: a check)")
    p.add_argument("--embedding-dim", type=int, default=None, help="embedding size (default: the head's, else 512)")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd",
                   help="the optimizer the resumed run will use (SGD momentum of the FC is imported; default: sgd)")
    p.add_argument("--out", required=True, metavar="DIR", help="run folder to create the checkpoint in")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="read files that need full unpickling (can run arbitrary code: only files you trust)")
    return p


def _expand(patterns: List[str]) -> List[str]:
    files: List[str] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise FileNotFoundError(f"--head {pattern!r} matches no file")
        files += matches
    return files


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)  # None: sys.argv[1:], as argparse reads it
    try:
        heads = _expand(args.head) if args.head else []
        path, head = import_arcface(
            args.out, args.backbone, args.network, heads, num_classes=args.num_classes,
            embedding_dim=args.embedding_dim, optimizer=args.optimizer, trust_pickle=args.trust_checkpoint,
        )
    except (ValueError, FileNotFoundError, ckpt.CheckpointError) as e:
        print(f"shardfc import-arcface: error: {e}", file=sys.stderr)
        return 2
    meta = read_meta(path)
    source = f"{head.world_size} arcface_torch rank(s), step {head.global_step}" if head else "a fresh head"
    print(f"wrote {path}: {args.network}, {meta['num_classes']} classes x {meta['embedding_dim']} from {source}")
    for note in head.notes if head else []:
        print(f"  note: {note}")
    print(f"continue with: shardfc train --output-dir {args.out} --backbone {args.network} --resume auto ...")
    return 0
