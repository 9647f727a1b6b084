"""``shardfc data``: make, inspect, shuffle and check insightface / MXNet RecordIO datasets.

* ``pack SRC OUT``: an image folder (one sub-folder per identity) or, with
  ``--list-file``, a ``path label`` list -> ``OUT/train.rec``, ``train.idx``,
  ``property`` in insightface's layout (header at key 0, images at keys
  ``1..N``, one identity record per class), plus ``classes.txt`` (the folder
  name of each label) for folder sources. Image files are stored byte for byte
  unless ``--resize`` or ``--encode`` asks for re-encoding; every image is
  decoded once, and undecodable ones (or ones the file gate refuses) are left
  out and listed.
* ``inspect PATH``: counts, images per class, image sizes, layout.
* ``shuffle PATH OUT``: the images in a random order, without header and
  identity records (im2rec layout), records copied unchanged.
* ``verify PATH``: decodes every image; lists bad records; exit status 1 if any.

A refused input (a missing or malformed file, one the file gate refuses: :mod:`shardfc.files`) is
one line on stderr and exit status 2, as for every ``shardfc`` command.
* ``glyphs OUT``: a face-recognition-shaped set of glyph identities from the machine's CJK fonts
  (:mod:`shardfc.data.glyphs`): ``train.rec`` and three verification ``.bin`` sets.

``PATH`` is a folder holding ``train.rec``/``train.idx`` or a ``.rec`` file.
Progress bars go to stderr when it is a terminal and tqdm is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import List, Optional, Tuple

from shardfc.data.recordio_ops import CommandError, inspect, pack, shuffle, verify
from shardfc.outputs import OutputRefused, blocking_file, check_folder
from shardfc.train.config.fields import MAX_IMAGE_SIDE

__all__ = ["main", "build_parser", "pack", "inspect", "shuffle", "verify"]


def _size_arg(text: str) -> Tuple[int, int]:
    """``HxW``, each side 1..MAX_IMAGE_SIDE (training's bound: a 99999x99999 resize would ask 30 GB an image)."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m or not all(1 <= int(side) <= MAX_IMAGE_SIDE for side in m.groups()):
        raise argparse.ArgumentTypeError(
            f"expected HEIGHTxWIDTH such as 112x112, each side 1..{MAX_IMAGE_SIDE}, got {text!r}")
    return int(m.group(1)), int(m.group(2))


def _quality_arg(text: str) -> int:
    try:
        q = int(text)
    except ValueError:
        q = -1
    if not 1 <= q <= 100:
        raise argparse.ArgumentTypeError(f"JPEG quality must be an integer in 1..100, got {text!r}")
    return q


def _count_arg(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shardfc data",
        description="Make, inspect, shuffle and verify insightface / MXNet RecordIO datasets (train.rec, train.idx, property).",
        allow_abbrev=False,
    )
    sub = p.add_subparsers(dest="action", metavar="{pack,inspect,shuffle,verify,glyphs}")
    sub.required = True

    pk = sub.add_parser("pack", help="image folder or list file -> train.rec/train.idx/property", allow_abbrev=False,
                        description="Pack an image folder (one sub-folder per identity) or a list file into "
                        "OUT/train.rec, train.idx and property, in insightface's layout.")
    pk.add_argument("src", metavar="SRC", help="image folder, or with --list-file a 'path label' list file")
    pk.add_argument("out", metavar="OUT", help="output folder (created)")
    pk.add_argument("--list-file", action="store_true", help="SRC is a list file of 'path label' lines")
    pk.add_argument("--root", metavar="DIR", help="with --list-file: base of relative paths (default: the list's folder)")
    pk.add_argument("--resize", type=_size_arg, metavar="HxW", help="resize every image to HEIGHTxWIDTH (re-encodes)")
    pk.add_argument("--encode", choices=("auto", "jpeg", "png"), default="auto",
                    help="auto (default): keep the file's bytes, JPEG when resized; jpeg/png: always re-encode")
    pk.add_argument("--quality", type=_quality_arg, default=None,
                    help="JPEG quality when re-encoding to JPEG: --encode jpeg, or --resize with --encode auto (default 95)")
    pk.add_argument("--force", action="store_true", help="replace an existing OUT/train.rec")

    ins = sub.add_parser("inspect", help="counts, images per class, image size, layout", allow_abbrev=False)
    ins.add_argument("path", metavar="PATH", help="folder with train.rec/train.idx, or a .rec file")
    ins.add_argument("--json", action="store_true", help="print one JSON object")
    ins.add_argument("--sample", type=_count_arg, default=8, metavar="N", help="decode the first N images for their size (default 8)")

    sh = sub.add_parser("shuffle", help="shuffled copy without header/identity records (im2rec layout)", allow_abbrev=False)
    sh.add_argument("path", metavar="PATH", help="folder with train.rec/train.idx, or a .rec file")
    sh.add_argument("out", metavar="OUT", help="output folder (gets train.rec/train.idx), or a .rec path")
    sh.add_argument("--seed", type=_count_arg, default=0, help="shuffle seed, an integer >= 0 (default 0)")
    sh.add_argument("--force", action="store_true",
                    help="replace existing output files (the .rec, its .idx, and a property in OUT's folder)")

    vf = sub.add_parser("verify", help="decode every image; exit status 1 if any record is bad", allow_abbrev=False)
    vf.add_argument("path", metavar="PATH", help="folder with train.rec/train.idx, or a .rec file")
    vf.add_argument("--json", action="store_true", help="print one JSON object")

    from shardfc.data.glyphs import GlyphOptions

    d = GlyphOptions()
    gl = sub.add_parser("glyphs", help="glyph identities from the system's CJK fonts -> train.rec + 3 .bin sets",
                        allow_abbrev=False,
                        description="Build a face-recognition-shaped data set from the CJK fonts on this machine: an "
                        "identity is a character, its images the distinct drawings of it by different typefaces, "
                        "augmented; OUT gets train.rec/train.idx/property/classes.txt and three verification sets "
                        "(glyphs_unseen.bin: unseen characters; glyphs_hard.bin: the same with each negative the most "
                        "similar character under one face; glyphs_faces.bin: training characters drawn by held-out "
                        "typeface families), 10 folds each as LFW. Seeded: the same fonts give the same bytes.")
    gl.add_argument("out", metavar="OUT", help="output folder (created)")
    gl.add_argument("--fonts", nargs="+", metavar="DIR", help="font folders (default: the system's)")
    gl.add_argument("--image-size", type=int, default=d.image_size, help=f"square side in pixels (default {d.image_size})")
    gl.add_argument("--channels", type=int, choices=(1, 3), default=d.channels, help="1: grayscale PNG (default), 3: RGB")
    gl.add_argument("--min-faces", type=int, default=d.min_faces,
                    help=f"distinct drawings a character needs to be an identity (default {d.min_faces})")
    gl.add_argument("--identities", type=int, default=d.identities, help=f"training identities (default {d.identities})")
    gl.add_argument("--unseen-identities", type=int, default=d.unseen_identities,
                    help=f"characters kept out of training for the unseen and hard sets (default {d.unseen_identities})")
    gl.add_argument("--holdout-faces", type=int, default=d.holdout_faces,
                    help=f"typeface families kept out of training for glyphs_faces.bin (default {d.holdout_faces})")
    gl.add_argument("--copies", type=int, default=d.copies, help=f"augmented images per training drawing (default {d.copies})")
    gl.add_argument("--pairs", type=int, default=d.pairs, help=f"pairs per verification set (default {d.pairs}, as LFW)")
    gl.add_argument("--seed", type=_count_arg, default=d.seed,
                    help=f"seed of every choice and augmentation, an integer >= 0 (default {d.seed})")
    gl.add_argument("--force", action="store_true", help="replace an existing set in OUT")
    return p


def _print_inspect(info: dict, out=None) -> None:
    out = out or sys.stdout
    ipc = info["images_per_class"]
    median = ipc["median"]
    sizes = info["image_sizes_sampled"]
    median_s = str(int(median)) if float(median).is_integer() else f"{median:.1f}"
    layout = info["layout"] + (" (header at key 0 + identity records)" if info["layout"] == "insightface" else " (no header)")
    rows = [
        ("file", info["rec"]),
        ("layout", layout),
        ("images", info["images"]),
        ("classes", f"{info['classes']} (from {info['classes_from']})"),
        ("images/class", f"min {ipc['min']}, median {median_s}, max {ipc['max']}"
                         + (f"; {info['empty_classes']} class(es) without images" if info["empty_classes"] else "")),
        ("image size", (", ".join(f"{k} ({n})" for k, n in sizes.items()) or "-")
                       + f"  (of the first {sum(sizes.values()) + len(info['undecodable_in_sample'])} images)"),
        ("property", "absent" if info["property"] is None else ",".join(map(str, info["property"]))),
        ("size", f"{info['rec_bytes'] / 2**20:.1f} MiB, {info['records']} records"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}", file=out)
    for line in info["undecodable_in_sample"]:
        print(f"undecodable: {line}", file=out)


# -------------------------------------------------------------------- main
def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, message already printed)
        return int(e.code or 0)
    if args.action == "glyphs":
        try:
            check_folder("OUT", Path(args.out))
        except OutputRefused as e:
            print(f"shardfc data glyphs: error: {e}", file=sys.stderr)
            return 2
        return _glyphs(args)
    where = args.path if hasattr(args, "path") else args.src
    if not os.path.exists(where):
        what = "SRC" if args.action == "pack" else "PATH"
        print(f"shardfc data {args.action}: error: {what} {where!r} does not exist", file=sys.stderr)
        return 2
    try:
        if args.action in ("pack", "shuffle"):  # OUT is a folder (shuffle: or a .rec file in one)
            folder = os.path.dirname(args.out) if args.action == "shuffle" and args.out.endswith(".rec") else args.out
            blocking = blocking_file(Path(os.path.abspath(folder or ".")))
            if blocking is not None:
                raise CommandError(f"OUT {args.out!r}: {str(blocking)!r} is a file, not a folder")
        if args.action == "pack":
            jpeg = args.encode == "jpeg" or (args.encode == "auto" and args.resize is not None)
            if args.quality is not None and not jpeg:
                raise CommandError(f"--quality applies to re-encoding as JPEG (--encode jpeg, or --resize with "
                                   f"--encode auto); got --encode {args.encode}"
                                   + ("" if args.resize is not None or args.encode == "png" else " without --resize"))
            if args.list_file and not os.path.isfile(args.src):
                raise CommandError(f"--list-file given but SRC {args.src!r} is not a file")
            if not args.list_file and not os.path.isdir(args.src):
                raise CommandError(f"SRC {args.src!r} is not a folder (pass --list-file for a list file)")
            pack(args.src, args.out, args.list_file, args.root, args.resize, args.encode,
                 95 if args.quality is None else args.quality, args.force)
        elif args.action == "inspect":
            info = inspect(args.path, args.sample)
            if args.json:
                print(json.dumps(info, indent=2))
            else:
                _print_inspect(info)
        elif args.action == "shuffle":
            shuffle(args.path, args.out, args.seed, args.force)
        else:
            result = verify(args.path)
            if args.json:
                print(json.dumps(result, indent=2))
            else:
                for item in result["bad"]:
                    where_ = "" if item["key"] is None else f"key {item['key']}: "
                    print(f"bad: {where_}{item['reason']}")
                print(f"{result['rec']}: {result['images']} images, {len(result['bad'])} bad record(s)")
            return 1 if result["bad"] else 0
    except (CommandError, FileNotFoundError, ValueError) as e:  # a refused input: exit 2, as every command
        print(f"shardfc data {args.action}: error: {e}", file=sys.stderr)
        return 2
    return 0


def _glyphs(args) -> int:
    from shardfc.data.glyphs import GlyphError, GlyphOptions, build

    options = GlyphOptions(image_size=args.image_size, channels=args.channels, min_faces=args.min_faces,
                           identities=args.identities, unseen_identities=args.unseen_identities,
                           holdout_faces=args.holdout_faces, copies=args.copies, pairs=args.pairs, seed=args.seed)
    try:
        build(args.out, options, font_dirs=args.fonts, force=args.force)
    except (GlyphError, CommandError) as e:
        print(f"shardfc data glyphs: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
