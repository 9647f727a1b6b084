"""The actions of ``shardfc data`` as functions: pack an image folder or list into RecordIO,
inspect, shuffle and verify a RecordIO dataset (the command line is :mod:`shardfc.cli.data`)."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections import Counter
from typing import Iterable, Iterator, List, Optional, Tuple

import numpy as np
from PIL import Image

from shardfc import files
from shardfc.data.recordio import (
    IRHeader,
    RecordIODataset,
    RecordIOReader,
    RecordIOWriter,
    class_id,
    detect_layout,
    first_label,
    pack_header,
    read_property,
    resolve_recordio_paths,
    unpack_header,
    write_property,
)
from shardfc.data.transforms import CorruptImageError, decode_image
from shardfc.progress import progress

__all__ = ["CommandError", "pack", "inspect", "shuffle", "verify"]


class CommandError(Exception):
    """A failure to report as ``shardfc data <action>: error: ...`` with exit status 1."""


# -------------------------------------------------------------------- pack
class NoImages(ValueError):
    """:func:`write_insightface` was given no image (told apart from any other ValueError)."""


def _encode(img: Image.Image, fmt: str, quality: int) -> bytes:
    buf = io.BytesIO()
    if fmt == "jpeg":
        img.convert("RGB").save(buf, format="JPEG", quality=quality)
    else:
        img.save(buf, format="PNG")
    return buf.getvalue()


def check_outputs(paths: List[str], force: bool) -> None:
    existing = [p for p in paths if os.path.exists(p)]
    if existing and not force:
        raise CommandError(f"{existing[0]!r} exists (use --force to replace it)")


@contextlib.contextmanager
def staged_outputs(finals: List[str]) -> Iterator[List[str]]:
    """Yields ``<final>.part`` names to write; on success renames them over ``finals``, on error deletes them.

    So an interrupted or failed run never leaves a half-written train.rec that looks complete.
    """
    tmps = [f + ".part" for f in finals]
    try:
        yield tmps
        for t, f in zip(tmps, finals):
            os.replace(t, f)
    except BaseException:  # the renames' failures too: no .part is left behind
        for t in tmps:
            try:
                os.remove(t)
            except FileNotFoundError:
                pass
        raise


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
    image_root = None if list_file else src  # a list names its images; a folder's stay inside it
    os.makedirs(out, exist_ok=True)
    names = ["train.rec", "train.idx", "property"] + (["classes.txt"] if classes is not None else [])
    finals = [os.path.join(out, n) for n in names]
    check_outputs(finals[:2], force)
    with staged_outputs(finals) as tmps:
        fmt = encode if encode != "auto" else ("jpeg" if resize else None)
        order = sorted(range(len(samples)), key=lambda i: samples[i][1])  # stable: keeps path order per class
        skipped: List[Tuple[str, str]] = []

        def images():
            for i in progress(order, len(order), "pack"):
                path, label = samples[i]
                try:  # the gate: a regular file (inside SRC for a folder), at most the image cap
                    data = files.read_bytes(path, "image", root=image_root)
                except files.FileMissing:
                    raise CommandError(f"image file not found: {path!r}") from None
                except files.FileRefused as e:
                    skipped.append((path, str(e)))
                    continue
                try:
                    img = decode_image(data, name=path)
                except CorruptImageError as e:
                    skipped.append((path, f"undecodable: {e.reason}"))
                    continue
                if resize is not None and img.size != (resize[1], resize[0]):
                    img = img.resize((resize[1], resize[0]), Image.BILINEAR)
                if fmt is not None:
                    data = _encode(img, fmt, quality)
                yield label, data, (img.size[1], img.size[0])

        try:
            key, sizes, first_size = write_insightface(tmps[0], tmps[1], tmps[2], images(), num_classes)
        except NoImages:
            path, reason = skipped[0]  # every image was skipped (a missing one raised above): say why
            raise CommandError(f"no image in {src!r} could be packed: {len(skipped)} skipped, the first "
                               f"{path}: {reason}") from None
        key += 1
        if classes is not None:
            with open(tmps[3], "w", encoding="utf-8") as f:
                f.writelines(name + "\n" for name in classes)
    # After the new files are in place, not before: a pack that fails (or is killed) leaves the earlier
    # pack whole, its class names included.
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
        print(f"skipped image {p}: {r}", file=sys.stderr)
    return summary


def write_insightface(rec: str, idx: str, prop: str, images: Iterable[Tuple[int, bytes, Tuple[int, int]]],
                      num_classes: int) -> Tuple[int, Counter, Tuple[int, int]]:
    """Write ``(label, encoded image, (height, width))`` in label order (each label's images
    together) as insightface's layout: images at keys ``1..N``, then the header at key 0 and one
    identity record per class, and ``prop`` (``property``). Returns ``(N, sizes, first size)``;
    :class:`NoImages` (a ValueError) when ``images`` is empty."""
    first = [0] * num_classes
    end = [0] * num_classes
    sizes: Counter = Counter()
    first_size: Optional[Tuple[int, int]] = None
    key = 1
    with RecordIOWriter(rec, idx) as writer:
        for label, data, h_w in images:
            sizes[h_w] += 1
            first_size = first_size or h_w
            writer.write(key, pack_header(IRHeader(0, float(label), key, 0), data))
            if end[label] == 0:
                first[label] = key
            end[label] = key + 1
            key += 1
        if first_size is None:
            raise NoImages("no images to write")
        a = key  # identity records: keys a .. a + num_classes - 1
        writer.write(0, pack_header(IRHeader(0, [a, a + num_classes], 0, 0)))
        next_start = 1
        for c in range(num_classes):
            start, stop = (first[c], end[c]) if end[c] else (next_start, next_start)
            next_start = stop
            writer.write(a + c, pack_header(IRHeader(0, [start, stop], 0, 0)))
    write_property(prop, num_classes, *first_size)
    return key - 1, sizes, first_size


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


# ----------------------------------------------------------------- shuffle
def shuffle(path: str, out: str, seed: int = 0, force: bool = False, log=None) -> dict:
    """Copy the images of ``path`` in a random order, keys ``0..N-1``, without header or identity records;
    the ``property`` in OUT's folder becomes the input's (or, when it has none, one there is removed)."""
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
    # The property in OUT's folder is read as the shuffled file's: it becomes the input's (the values
    # the dataset read and checked), or, when the input has none, one already there goes — unless it
    # is the input's own (OUT beside the input).
    own_property = os.path.abspath(prop) == os.path.abspath(ds.property_path)
    copy_property = ds.property is not None and not own_property
    check_outputs([rec, idx] + ([] if own_property else [prop]), force)
    perm = np.random.default_rng(seed).permutation(len(ds))
    with staged_outputs([rec, idx] + ([prop] if copy_property else [])) as tmps:
        with RecordIOWriter(tmps[0], tmps[1]) as writer:
            for new_key, i in enumerate(progress(perm.tolist(), len(perm), "shuffle")):
                writer.write(new_key, ds.reader.read(int(ds.keys[i])))
        if copy_property:
            write_property(tmps[2], *ds.property)
    # After the shuffled file is in place (a failed shuffle leaves what OUT held whole):
    if not copy_property and not own_property and os.path.lexists(prop):
        os.remove(prop)  # another data set's: it would name the wrong number of classes
    print(f"wrote {len(perm)} images in shuffled order (seed {seed}) to {rec}", file=log)
    return {"rec": rec, "images": len(perm)}


# ------------------------------------------------------------------ verify
def verify(path: str) -> dict:
    """Decode every image and check every identity record: ``{"rec", "layout", "images", "bad": [{"key",
    "reason"}]}`` (``layout`` None and ``images`` 0 when the file's structure is damaged)."""
    rec, idx, prop_path = resolve_recordio_paths(path)
    bad: List[dict] = []
    try:
        reader = RecordIOReader(rec, idx)
        layout = detect_layout(reader)
        prop = read_property(prop_path)
    except ValueError as e:  # structural: nothing else can be trusted
        return {"rec": rec, "layout": None, "images": 0, "bad": [{"key": None, "reason": str(e)}]}
    max_label = -1
    for key in progress(layout.image_keys.tolist(), len(layout.image_keys), "verify"):
        try:
            header, image = unpack_header(reader.read(key), reader.name(key))
            max_label = max(max_label, class_id(reader, key, first_label(header)))
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
