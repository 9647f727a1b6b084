"""``shardfc embed``: embeddings of every image under a folder, with a checkpoint's backbone.

Images are found recursively (sorted paths), resized to the training input size and normalised
as in training. Corrupt images are skipped, counted and named in a warning. Output by suffix:

* ``.pt``: ``{"embeddings": float32 [N, D], "paths": [N paths relative to --images], "checkpoint": str}``;
* ``.npy``: the ``[N, D]`` array, with the paths one per line in ``<out>.paths.txt`` (a file name
  holding a line break is refused before anything is embedded: use ``.pt``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterator, List, Optional

import numpy as np
import torch

from shardfc import checkpoint as ckpt
from shardfc.data import CorruptImageError, decode_image, image_to_tensor
from shardfc.evaluation.verification import embed_batches
from shardfc.outputs import check_output, write_atomically
from shardfc.progress import progress
from shardfc.train.checkpointing.artifacts import add_checkpoint_args, list_images, load_backbone, pick_device
from shardfc.train.config import ConfigError

__all__ = ["main"]

SUFFIXES = (".pt", ".npy")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardfc embed", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_checkpoint_args(p)
    p.add_argument("--images", required=True, metavar="DIR", help="folder of images (searched recursively)")
    p.add_argument("--out", required=True, metavar="FILE", help="output file: .pt or .npy")
    p.add_argument("--batch-size", type=int, default=256, help="images per forward pass (default: 256)")
    p.add_argument("--flip", action=argparse.BooleanOptionalAction, default=True,
                   help="add the mirrored image's embedding (default: on)")
    p.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=True,
                   help="L2-normalise the embeddings (default: on)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    p.add_argument("--force", action="store_true", help="replace an existing output file")
    return p


def _batches(files: List[Path], image_size, batch_size: int, kept: List[Path], corrupt: List[str],
             root: Optional[Path] = None) -> Iterator[torch.Tensor]:
    """Decoded image batches; appends each decoded file to ``kept`` and each undecodable one (or one
    that is not a regular file inside ``root``) to ``corrupt``."""
    batch: List[torch.Tensor] = []
    for path in progress(files, len(files), "embed"):
        try:
            batch.append(image_to_tensor(decode_image(path, root=root), image_size))
        except CorruptImageError as e:
            corrupt.append(f"{path} ({e.reason})")
            continue
        kept.append(path)
        if len(batch) == batch_size:
            yield torch.stack(batch)
            batch = []
    if batch:
        yield torch.stack(batch)


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)  # None: argparse reads sys.argv[1:]
    out = Path(args.out)
    try:
        if out.suffix not in SUFFIXES:
            raise ConfigError(f"--out {args.out!r} must end in {' or '.join(SUFFIXES)}")
        check_output("--out", out, args.force)
        if out.suffix == ".npy":  # its paths go beside it, and are the user's file as much as the embeddings
            check_output("--out", Path(f"{out}.paths.txt"), args.force)
        if args.batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
        files = list_images(args.images)
        root = Path(args.images).expanduser()  # as list_images read it: the paths below are relative to it
        if out.suffix == ".npy":  # one path per line: a name holding a line break would shift every row after it
            broken = next((p for p in files if len(f"{p.relative_to(root)}x".splitlines()) > 1), None)
            if broken is not None:
                raise ConfigError(f"--out {args.out!r} lists the paths one per line, but {str(broken.relative_to(root))!r} "
                                  "holds a line break: use --out FILE.pt (the paths as a list)")
        device = pick_device(args.device)
        trained = load_backbone(args.checkpoint, device, trust_pickle=args.trust_checkpoint)
        kept: List[Path] = []
        corrupt: List[str] = []
        batches = _batches(files, trained.image_size, args.batch_size, kept, corrupt, root)
        try:
            emb = embed_batches(trained.model, batches, flip=args.flip, device=device)
        except ValueError:  # no batch at all
            raise ValueError(f"none of the {len(files)} images under {args.images!r} could be decoded") from None
    except (ConfigError, ckpt.CheckpointError, FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"shardfc embed: error: {e}", file=sys.stderr)
        return 2
    if args.normalize:
        emb = torch.nn.functional.normalize(emb, dim=1)
    paths = [str(p.relative_to(root)) for p in kept]
    try:  # each file whole or not at all: a crash never leaves a half-written output under the user's name
        if out.suffix == ".pt":
            write_atomically(out, lambda scratch: torch.save(
                {"embeddings": emb, "paths": paths, "checkpoint": str(trained.path)}, scratch))
        else:
            def save_npy(scratch: Path) -> None:
                with open(scratch, "wb") as f:  # np.save given a name would add ".npy" to the scratch name
                    np.save(f, emb.numpy(), allow_pickle=False)

            write_atomically(out, save_npy)
            write_atomically(Path(f"{out}.paths.txt"),
                             lambda scratch: scratch.write_text("".join(p + "\n" for p in paths), encoding="utf-8"))
    except OSError as e:
        print(f"shardfc embed: error: {e}", file=sys.stderr)
        return 2
    if corrupt:
        print(f"warning: skipped {len(corrupt)} corrupt image(s): " + "; ".join(corrupt[:5])
              + (" ..." if len(corrupt) > 5 else ""), file=sys.stderr)
    print(f"wrote {out}: {emb.shape[0]} x {emb.shape[1]} embeddings of images under {args.images}"
          + (f" (paths in {out}.paths.txt)" if out.suffix == ".npy" else ""))
    return 0
