"""Loading speed: RecordIODataset vs ImageFolderDataset through a DataLoader.

Makes a temporary image folder of synthetic 112x112 JPEG "faces" (smooth colour
fields plus noise, a few KB each like real aligned crops), packs it with
``shardfc data pack``, then times full passes of both datasets through
``DataLoader(batch_size=64, shuffle=True)``: one untimed warm-up epoch, then
``--epochs`` timed ones. Besides images/s (wall clock, worker start-up
included), it reports the CPU time per image summed over the main process and
the workers, which is much less sensitive to other jobs on the machine than the
wall clock. Files are in the page
cache after the warm-up, so this compares per-image overhead (open/seek/decode),
not cold-disk throughput. The main process runs torch with one thread (workers
always do): on a small, busy machine torch's intra-op threads in the main
process otherwise spin against the workers and dominate the timing. The two
datasets are measured alternately, ``--repeats`` times each, and the median is
reported; the load average is printed because other jobs on the machine skew it.

    PYTHONPATH=src python docs/bench/recordio_speed.py            # 2000 images, workers 1 and 2
    PYTHONPATH=src python docs/bench/recordio_speed.py --images 5000 --workers 1,2,4
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import tempfile
import time
from typing import Tuple

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader

from shardfc.data import ImageFolderDataset
from shardfc.data.recordio import RecordIODataset
from shardfc.data.recordio_ops import pack


def make_folder(root: str, images: int, classes: int, size: int, seed: int = 0) -> int:
    """Write ``images`` JPEGs spread over ``classes`` folders; returns the total bytes."""
    rng = np.random.default_rng(seed)
    total = 0
    for i in range(images):
        label = i % classes
        folder = os.path.join(root, f"id{label:05d}")
        os.makedirs(folder, exist_ok=True)
        low = rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
        img = np.asarray(Image.fromarray(low).resize((size, size), Image.BICUBIC), dtype=np.int16)
        img = np.clip(img + rng.normal(0, 6, img.shape), 0, 255).astype(np.uint8)
        path = os.path.join(folder, f"{i:06d}.jpg")
        Image.fromarray(img).save(path, quality=90)
        total += os.path.getsize(path)
    return total


def _cpu_seconds() -> float:
    """CPU time of this process plus its reaped children (finished DataLoader workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def measure(dataset, workers: int, batch: int, epochs: int) -> Tuple[float, float]:
    """``(images/s wall clock, CPU microseconds per image over all processes)`` of ``epochs`` passes.

    Workers are not persistent, so each epoch's workers exit and their CPU time is counted;
    the wall time includes starting them, as in a training loop without persistent workers.
    """
    loader = DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers)
    for _ in loader:  # warm-up: page cache, allocator
        pass
    seen = 0
    cpu, start = _cpu_seconds(), time.perf_counter()
    for _ in range(epochs):
        for x, _ in loader:
            seen += x.shape[0]
    wall = time.perf_counter() - start
    return seen / wall, (_cpu_seconds() - cpu) / seen * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--classes", type=int, default=200)
    p.add_argument("--size", type=int, default=112)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", default="1,2", help="comma-separated num_workers values")
    p.add_argument("--epochs", type=int, default=2, help="timed epochs per measurement")
    p.add_argument("--repeats", type=int, default=5, help="measurements per cell; the median is reported")
    args = p.parse_args()
    workers = [int(w) for w in args.workers.split(",")]
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "faces"), os.path.join(tmp, "rec")
        t = time.perf_counter()
        nbytes = make_folder(src, args.images, args.classes, args.size)
        t_make = time.perf_counter() - t
        t = time.perf_counter()
        pack(src, out, log=open(os.devnull, "w"))
        t_pack = time.perf_counter() - t
        size = (args.size, args.size)
        t = time.perf_counter()
        folder = ImageFolderDataset(src, size, train=True)
        t_folder = time.perf_counter() - t
        t = time.perf_counter()
        rec = RecordIODataset(out, size, train=True)
        t_rec = time.perf_counter() - t
        assert len(rec) == len(folder) == args.images

        print(f"{args.images} JPEGs {args.size}x{args.size}, {args.classes} classes, mean {nbytes / args.images / 1024:.1f} KiB; "
              f"made in {t_make:.1f}s, packed in {t_pack:.1f}s ({os.path.getsize(os.path.join(out, 'train.rec')) / 2**20:.1f} MiB)")
        print(f"construction: ImageFolderDataset {t_folder * 1000:.0f} ms, RecordIODataset {t_rec * 1000:.0f} ms (label scan)")
        print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
              f"batch {args.batch}, {args.epochs} timed epochs after 1 warm-up, median of {args.repeats}\n")
        print("| num_workers | ImageFolderDataset img/s | RecordIODataset img/s | ratio | ImageFolderDataset CPU µs/img | RecordIODataset CPU µs/img |")
        print("|---:|---:|---:|---:|---:|---:|")
        for w in workers:
            fs, rs = [], []
            for _ in range(args.repeats):  # alternate, so load changes hit both alike
                fs.append(measure(folder, w, args.batch, args.epochs))
                rs.append(measure(rec, w, args.batch, args.epochs))
            (f, fc), (r, rc) = np.median(fs, axis=0), np.median(rs, axis=0)
            print(f"| {w} | {f:,.0f} | {r:,.0f} | {r / f:.2f} | {fc:,.0f} | {rc:,.0f} |", flush=True)
        if hasattr(os, "getloadavg"):
            print("\nload average (1, 5, 15 min): " + ", ".join(f"{v:.1f}" for v in os.getloadavg()))


if __name__ == "__main__":
    main()
