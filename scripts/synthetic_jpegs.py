"""Write shardfc's synthetic identities as a JPEG folder (one sub-folder per identity), to pack into
a RecordIO set for ``shardfc bench --trainer`` on real decoding::

    python scripts/synthetic_jpegs.py faces --identities 200 --images 20 --size 112
    shardfc data pack faces rec
    shardfc bench --trainer --dataset recordio --data-root rec --image-size 112 112 --num-workers 1
"""

from __future__ import annotations

import argparse
import os

import torch
from PIL import Image

from shardfc.data import SyntheticIdentities


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="folder to write (one sub-folder per identity)")
    p.add_argument("--identities", type=int, default=200)
    p.add_argument("--images", type=int, default=20, help="images per identity")
    p.add_argument("--size", type=int, default=112, help="image side in pixels")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality")
    args = p.parse_args()
    torch.set_num_threads(1)
    data = SyntheticIdentities(args.identities, args.images, (args.size, args.size), seed=0)
    for i in range(len(data)):
        x, label = data[i]
        pixels = ((x.clamp(-1, 1) * 0.5 + 0.5) * 255).round().byte().permute(1, 2, 0).numpy()
        folder = os.path.join(args.out, f"id{label:05d}")
        os.makedirs(folder, exist_ok=True)
        Image.fromarray(pixels).save(os.path.join(folder, f"{i % args.images:03d}.jpg"), quality=args.quality)


if __name__ == "__main__":
    main()
