"""``shardfc data``: make, inspect, shuffle and check insightface / MXNet RecordIO datasets.

* ``pack SRC OUT``: an image folder (one sub-folder per identity) or, with
  ``--list-file``, a ``path label`` list -> ``OUT/train.rec``, ``train.idx``,
  ``property`` in insightface's layout (header at key 0, images at keys
  ``1..N``, one identity record per class), plus ``classes.txt`` (the folder
  name of each label) for folder sources. Image files are stored byte for byte
  unless ``--resize`` or ``--encode`` asks for re-encoding; every image is
  decoded once, and undecodable ones are left out and listed.
* ``inspect PATH``: counts, images per class, image sizes, layout.
* ``shuffle PATH OUT``: the images in a random order, without header and
  identity records (im2rec layout), records copied unchanged.
* ``verify PATH``: decodes every image; lists bad records; exit status 1 if any.

``PATH`` is a folder holding ``train.rec``/``train.idx`` or a ``.rec`` file.
Progress bars go to stderr when it is a terminal and tqdm is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import sys
from collections import Counter
from typing import Iterable, Iterator, List, Optional, Tuple

import numpy as np
from PIL import Image

from shardfc.data.recordio import (
    IRHeader,
    RecordIODataset,
    RecordIOReader,
    RecordIOWriter,
    _class_id,
    _first_label,
    detect_layout,
    pack_header,
    read_property,
    resolve_recordio_paths,
    unpack_header,
    write_property,
)
from shardfc.data.transforms import CorruptImageError, decode_image

__all__ = ["main", "build_parser", "pack", "inspect", "shuffle", "verify"]


class CommandError(Exception):
    """A failure to report as ``shardfc data <action>: error: ...`` with exit status 1."""


def _progress(iterable: Iterable, total: int, desc: str) -> Iterable:
    if not sys.stderr.isatty():
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=desc, unit="img", file=sys.stderr, dynamic_ncols=True, leave=False)


def _size_arg(text: str) -> Tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m or int(m.group(1)) <= 0 or int(m.group(2)) <= 0:
        raise argparse.ArgumentTypeError(f"expected HEIGHTxWIDTH such as 112x112, got {text!r}")
    return int(m.group(1)), int(m.group(2))


def _quality_arg(text: str) -> int:
    try:
        q = int(text)
    except ValueError:
        q = -1
    if not 1 <= q <= 100:
        raise argparse.ArgumentTypeError(f"JPEG quality must be an integer in 1..100, got {text!r}")
    return q


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shardfc data",
        description="Make, inspect, shuffle and verify insightface / MXNet RecordIO datasets (train.rec, train.idx, property).",
        allow_abbrev=False,
    )
    sub = p.add_subparsers(dest="action", metavar="{pack,inspect,shuffle,verify}")
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
    pk.add_argument("--quality", type=_quality_arg, default=95, help="JPEG quality when re-encoding (default 95)")
    pk.add_argument("--force", action="store_true", help="replace an existing OUT/train.rec")

    ins = sub.add_parser("inspect", help="counts, images per class, image size, layout", allow_abbrev=False)
    ins.add_argument("path", metavar="PATH", help="folder with train.rec/train.idx, or a .rec file")
    ins.add_argument("--json", action="store_true", help="print one JSON object")
    ins.add_argument("--sample", type=int, default=8, metavar="N", help="decode the first N images for their size (default 8)")

    sh = sub.add_parser("shuffle", help="shuffled copy without header/identity records (im2rec layout)", allow_abbrev=False)
    sh.add_argument("path", metavar="PATH", help="folder with train.rec/train.idx, or a .rec file")
    sh.add_argument("out", metavar="OUT", help="output folder (gets train.rec/train.idx), or a .rec path")
    sh.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    sh.add_argument("--force", action="store_true", help="replace existing output files")

    vf = sub.add_parser("verify", help="decode every image; exit status 1 if any record is bad", allow_abbrev=False)
    vf.add_argument("path", metavar="PATH", help="folder with train.rec/train.idx, or a .rec file")
    vf.add_argument("--json", action="store_true", help="print one JSON object")
    return p


# -------------------------------------------------------------------- pack
def _encode(img: Image.Image, fmt: str, quality: int) -> bytes:
    buf = io.BytesIO()
    if fmt == "jpeg":
        img.convert("RGB").save(buf, format="JPEG", quality=quality)
    else:
        img.save(buf, format="PNG")
    return buf.getvalue()


def _check_out(paths: List[str], force: bool) -> None:
    existing = [p for p in paths if os.path.exists(p)]
    if existing and not force:
        raise CommandError(f"{existing[0]!r} exists (use --force to replace it)")


@contextlib.contextmanager
def _staged(finals: List[str]) -> Iterator[List[str]]:
    """Yields ``<final>.part`` names to write; on success renames them over ``finals``, on error deletes them.

    So an interrupted or failed run never leaves a half-written train.rec that looks complete.
    """
    tmps = [f + ".part" for f in finals]
    try:
        yield tmps
    except BaseException:
        for t in tmps:
            try:
                os.remove(t)
            except FileNotFoundError:
                pass
        raise
    for t, f in zip(tmps, finals):
        os.replace(t, f)


def pack(
    src: str,
    out: str,
    list_file: bool = False,
    root: Optional[str] = None,
    resize: Optional[Tuple[int, int]] = None,
    encode: str = "auto",
    quality: int = 95,
    force: bool = False,
    log=None,
) -> dict:
    """Write ``out/train.rec``, ``train.idx``, ``property`` (and ``classes.txt``); returns a summary dict."""
    from shardfc.data.folder import ImageFolderDataset, ListFileDataset

    log = log or sys.stdout

    classes: Optional[List[str]] = None
    if list_file:
        listed = ListFileDataset(src, root)
        samples, num_classes = listed.samples, listed.num_classes
    else:
        folder = ImageFolderDataset(src)
        samples, num_classes, classes = folder.samples, folder.num_classes, folder.classes
    os.makedirs(out, exist_ok=True)
    names = ["train.rec", "train.idx", "property"] + (["classes.txt"] if classes is not None else [])
    finals = [os.path.join(out, n) for n in names]
    _check_out(finals[:2], force)
    with _staged(finals) as tmps:
        fmt = encode if encode != "auto" else ("jpeg" if resize else None)
        order = sorted(range(len(samples)), key=lambda i: samples[i][1])  # stable: keeps path order per class
        first = [0] * num_classes
        end = [0] * num_classes
        sizes: Counter = Counter()
        first_size: Optional[Tuple[int, int]] = None
        skipped: List[Tuple[str, str]] = []
        key = 1
        with RecordIOWriter(tmps[0], tmps[1]) as writer:
            for i in _progress(order, len(order), "pack"):
                path, label = samples[i]
                if not os.path.isfile(path):
                    raise CommandError(f"image file not found: {path!r}")
                with open(path, "rb") as f:
                    data = f.read()
                try:
                    img = decode_image(data, name=path)
                except CorruptImageError as e:
                    skipped.append((path, e.reason))
                    continue
                if resize is not None and img.size != (resize[1], resize[0]):
                    img = img.resize((resize[1], resize[0]), Image.BILINEAR)
                if fmt is not None:
                    data = _encode(img, fmt, quality)
                h_w = (img.size[1], img.size[0])
                sizes[h_w] += 1
                first_size = first_size or h_w
                writer.write(key, pack_header(IRHeader(0, float(label), key, 0), data))
                if end[label] == 0:
                    first[label] = key
                end[label] = key + 1
                key += 1
            if key == 1:
                raise CommandError(f"no decodable images in {src!r} ({len(skipped)} undecodable)")
            a = key  # identity records: keys a .. a + num_classes - 1
            writer.write(0, pack_header(IRHeader(0, [a, a + num_classes], 0, 0)))
            next_start = 1
            for c in range(num_classes):
                start, stop = (first[c], end[c]) if end[c] else (next_start, next_start)
                next_start = stop
                writer.write(a + c, pack_header(IRHeader(0, [start, stop], 0, 0)))
        assert first_size is not None
        write_property(tmps[2], num_classes, *first_size)
        if classes is not None:
            with open(tmps[3], "w", encoding="utf-8") as f:
                f.writelines(name + "\n" for name in classes)
        stale = os.path.join(out, "classes.txt")
        if classes is None and force and os.path.exists(stale):
            os.remove(stale)  # from an earlier folder pack; would name the wrong labels

    summary = {
        "out": out,
        "images": key - 1,
        "classes": num_classes,
        "skipped": [{"path": p, "reason": r} for p, r in skipped],
        "image_sizes": {f"{h}x{w}": n for (h, w), n in sizes.most_common()},
        "rec_bytes": os.path.getsize(finals[0]),
    }
    print(f"packed {key - 1} images of {num_classes} classes into {finals[0]} "
          f"({summary['rec_bytes'] / 2**20:.1f} MiB); property {num_classes},{first_size[0]},{first_size[1]}", file=log)
    if len(sizes) > 1:
        print(f"note: images have {len(sizes)} different sizes ({', '.join(summary['image_sizes'])}); "
              f"property states the first one, use --resize for a uniform size", file=sys.stderr)
    for p, r in skipped:
        print(f"skipped undecodable image {p}: {r}", file=sys.stderr)
    return summary


# ----------------------------------------------------------------- inspect
def inspect(path: str, sample: int = 8) -> dict:
    """Facts about a RecordIO dataset (see the module docstring)."""
    ds = RecordIODataset(path, train=False)
    counts = np.bincount(ds.labels, minlength=ds.num_classes)
    sizes: List[str] = []
    undecodable: List[str] = []
    for i in range(min(max(sample, 0), len(ds))):
        try:
            w, h = decode_image(ds.read_image_bytes(i), name=ds.sample_name(i)).size
            sizes.append(f"{h}x{w}")
        except CorruptImageError as e:
            undecodable.append(f"{ds.sample_name(i)}: {e.reason}")
    return {
        "rec": ds.rec_path,
        "idx": ds.idx_path,
        "layout": ds.layout,
        "records": len(ds.reader),
        "images": len(ds),
        "classes": int(ds.num_classes),
        "classes_from": "property" if ds.property is not None else "labels",
        "empty_classes": int((counts == 0).sum()),
        "images_per_class": {
            "min": int(counts.min()),
            "median": float(np.median(counts)),
            "max": int(counts.max()),
        },
        "identity_records": None if ds.identity_range is None else ds.identity_range[1] - ds.identity_range[0],
        "property": None if ds.property is None else list(ds.property),
        "image_sizes_sampled": dict(Counter(sizes)),
        "undecodable_in_sample": undecodable,
        "rec_bytes": ds.reader.file_size,
    }


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


# ----------------------------------------------------------------- shuffle
def shuffle(path: str, out: str, seed: int = 0, force: bool = False, log=None) -> dict:
    """Copy the images of ``path`` in a random order, keys ``0..N-1``, without header or identity records."""
    log = log or sys.stdout
    ds = RecordIODataset(path, train=False)
    if out.endswith(".rec"):
        rec = out
        os.makedirs(os.path.dirname(os.path.abspath(rec)), exist_ok=True)
    else:
        os.makedirs(out, exist_ok=True)
        rec = os.path.join(out, "train.rec")
    idx = os.path.splitext(rec)[0] + ".idx"
    prop = os.path.join(os.path.dirname(os.path.abspath(rec)), "property")
    if os.path.abspath(rec) == os.path.abspath(ds.rec_path):
        raise CommandError(f"OUT {out!r} would overwrite the input {ds.rec_path!r}")
    copy_property = ds.property is not None and os.path.abspath(prop) != os.path.abspath(ds.property_path)
    _check_out([rec, idx] + ([prop] if copy_property else []), force)
    perm = np.random.default_rng(seed).permutation(len(ds))
    with _staged([rec, idx] + ([prop] if copy_property else [])) as tmps:
        with RecordIOWriter(tmps[0], tmps[1]) as writer:
            for new_key, i in enumerate(_progress(perm.tolist(), len(perm), "shuffle")):
                writer.write(new_key, ds.reader.read(int(ds.keys[i])))
        if copy_property:
            shutil.copyfile(ds.property_path, tmps[2])
    print(f"wrote {len(perm)} images in shuffled order (seed {seed}) to {rec}", file=log)
    return {"rec": rec, "images": len(perm)}


# ------------------------------------------------------------------ verify
def verify(path: str) -> dict:
    """Decode every image and check every identity record; ``{"images", "bad": [{"key", "reason"}]}``."""
    rec, idx, prop_path = resolve_recordio_paths(path)
    bad: List[dict] = []
    try:
        reader = RecordIOReader(rec, idx)
        layout = detect_layout(reader)
        prop = read_property(prop_path)
    except ValueError as e:  # structural: nothing else can be trusted
        return {"rec": rec, "images": 0, "checked": 0, "bad": [{"key": None, "reason": str(e)}]}
    max_label = -1
    for key in _progress(layout.image_keys.tolist(), len(layout.image_keys), "verify"):
        try:
            header, image = unpack_header(reader.read(key), reader.name(key))
            max_label = max(max_label, _class_id(reader, key, _first_label(header)))
            decode_image(image, name=reader.name(key))
        except CorruptImageError as e:
            bad.append({"key": key, "reason": f"undecodable image: {e.reason}"})
        except (ValueError, KeyError) as e:
            bad.append({"key": key, "reason": str(e).strip("'\"")})
    if layout.identity_range is not None:
        a, b = layout.identity_range
        for key in range(a, b):
            try:
                header, image = unpack_header(reader.read(key), reader.name(key))
                ok = header.flag >= 2 and len(image) == 0
                start, stop = (int(header.label[0]), int(header.label[1])) if ok else (0, -1)
                if not (ok and 1 <= start <= stop <= a):
                    bad.append({"key": key, "reason": f"identity record does not hold an image-key range within [1, {a}): "
                                f"flag={header.flag}, label={header.label}, {len(image)} image bytes"})
            except (ValueError, KeyError) as e:
                bad.append({"key": key, "reason": str(e).strip("'\"")})
    if prop is not None and prop[0] <= max_label:
        bad.append({"key": None, "reason": f"{prop_path}: num_classes={prop[0]} but label {max_label} occurs"})
    return {"rec": rec, "layout": layout.kind, "images": len(layout.image_keys), "bad": bad}


# -------------------------------------------------------------------- main
def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, message already printed)
        return int(e.code or 0)
    where = args.path if hasattr(args, "path") else args.src
    if not os.path.exists(where):
        what = "SRC" if args.action == "pack" else "PATH"
        print(f"shardfc data {args.action}: error: {what} {where!r} does not exist", file=sys.stderr)
        return 2
    try:
        if args.action == "pack":
            if args.list_file and not os.path.isfile(args.src):
                raise CommandError(f"--list-file given but SRC {args.src!r} is not a file")
            if not args.list_file and not os.path.isdir(args.src):
                raise CommandError(f"SRC {args.src!r} is not a folder (pass --list-file for a list file)")
            pack(args.src, args.out, args.list_file, args.root, args.resize, args.encode, args.quality, args.force)
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
    except (CommandError, FileNotFoundError, ValueError) as e:
        print(f"shardfc data {args.action}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
