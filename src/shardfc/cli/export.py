"""``shardfc export``: write a checkpoint's backbone for inference, as TorchScript and optionally ONNX.

The TorchScript file is traced on the CPU in eval mode; it maps float images ``[N, 3, H, W]`` in
``[-1, 1]`` (the training normalisation) to ``[N, D]`` embeddings (not L2-normalised). It is
reloaded and compared with the eager backbone before the command reports success. The file
carries ``shardfc.json`` (backbone, embedding size, input size, normalisation) as an extra file.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import sys
import warnings
from pathlib import Path
from typing import List, Optional

import torch

from shardfc import checkpoint as ckpt
from shardfc.checkpoint.format import saved_num_classes
from shardfc.outputs import check_output, write_atomically
from shardfc.train.checkpointing.artifacts import add_checkpoint_args, load_backbone
from shardfc.train.config import ConfigError

__all__ = ["main", "export_torchscript", "export_onnx", "export_fc"]

#: Largest |difference| between the eager and the reloaded exported model that counts as equal.
TOLERANCE = 1e-4


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardfc export", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_checkpoint_args(p)
    p.add_argument("--out", required=True, metavar="FILE", help="TorchScript file to write (e.g. model.pt)")
    p.add_argument("--onnx", nargs="?", const="", default=None, metavar="FILE",
                   help="also write ONNX (default file: --out with the suffix .onnx); needs the 'onnx' package")
    p.add_argument("--fc", default=None, metavar="FILE",
                   help="also write the head's class centres, all shards joined, as one float tensor [C, D] (torch.save)")
    p.add_argument("--force", action="store_true", help="replace existing output files")
    return p


def _check_distinct(out: Path, onnx_out: Optional[Path], fc_out: Optional[Path]) -> None:
    """Each output its own file: ``--out m.onnx --onnx`` wrote the ONNX model over the TorchScript one."""
    named = [("--out", out), ("--onnx", onnx_out), ("--fc", fc_out)]
    given = [(flag, path) for flag, path in named if path is not None]
    for i, (flag, path) in enumerate(given):
        for other, other_path in given[:i]:
            if os.path.abspath(path) == os.path.abspath(other_path):
                raise ConfigError(f"{other} and {flag} name one file, {str(path)!r}: each output needs its own")


def export_torchscript(model: torch.nn.Module, example: torch.Tensor, out: Path, metadata: dict) -> float:
    """Trace ``model`` to ``out`` (written atomically); returns the max |difference| after reloading.

    The bytes reloaded are the bytes written, kept in memory: ``out`` is not read back by its name
    (in a shared folder another user could swap the file in between, and loading TorchScript runs it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch marks jit as deprecated; trace still works
        traced = torch.jit.trace(model, example)
        buffer = io.BytesIO()
        torch.jit.save(traced, buffer, _extra_files={"shardfc.json": json.dumps(metadata)})
        data = buffer.getvalue()
        write_atomically(out, lambda scratch: scratch.write_bytes(data))
        reloaded = torch.jit.load(io.BytesIO(data), map_location="cpu")
    probe = torch.randn(3, *example.shape[1:], generator=torch.Generator().manual_seed(0)).clamp(-1, 1)
    with torch.no_grad():
        return float((reloaded(probe) - model(probe)).abs().max())


def export_onnx(model: torch.nn.Module, example: torch.Tensor, out: Path) -> None:
    """Write ``model`` as ONNX with a dynamic batch dimension (input ``images``, output ``embeddings``)."""
    def write(scratch: Path) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.onnx.export(
                model, (example,), str(scratch), input_names=["images"], output_names=["embeddings"],
                dynamic_axes={"images": {0: "batch"}, "embeddings": {0: "batch"}}, dynamo=False,
            )

    write_atomically(out, write)


def export_fc(folder: Path, out: Path, *, trust_pickle: bool = False) -> torch.Size:
    """Write the class centres of checkpoint ``folder`` (every saved shard's rows, in class order)
    to ``out`` as one tensor; returns its shape."""
    num_classes = saved_num_classes(folder)
    loaded = ckpt.load_checkpoint(
        folder, class_range=range(num_classes), num_classes=num_classes, rank=0, trust_pickle=trust_pickle
    )
    weight = loaded.head_tensors["weight"].contiguous()
    write_atomically(out, lambda scratch: torch.save(weight, scratch))
    return weight.shape


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)  # None: argparse reads sys.argv[1:]
    out = Path(args.out)
    onnx_out = None if args.onnx is None else Path(args.onnx or out.with_suffix(".onnx"))
    try:
        _check_distinct(out, onnx_out, None if args.fc is None else Path(args.fc))
        if onnx_out is not None and importlib.util.find_spec("onnx") is None:  # before minutes of work, not after
            raise ConfigError("--onnx needs the 'onnx' package, which is not installed (pip install onnx)")
        check_output("--out", out, args.force)
        if onnx_out is not None:
            check_output("--onnx", onnx_out, args.force)
        if args.fc is not None:
            check_output("--fc", Path(args.fc), args.force)
        trained = load_backbone(args.checkpoint, "cpu", trust_pickle=args.trust_checkpoint)
        h, w = trained.image_size
        example = torch.zeros(2, 3, h, w)
        metadata = {
            "backbone": trained.config.backbone,
            "embedding_dim": trained.config.embedding_dim,
            "input_size": [h, w],
            "input": "float32 [N, 3, H, W], RGB, (pixel / 255 - 0.5) / 0.5",
            "checkpoint": str(trained.path),
        }
        diff = export_torchscript(trained.model, example, out, metadata)
        fc_shape = export_fc(trained.path, Path(args.fc), trust_pickle=args.trust_checkpoint) if args.fc else None
    except (ConfigError, ckpt.CheckpointError, OSError, ValueError) as e:
        print(f"shardfc export: error: {e}", file=sys.stderr)
        return 2
    if diff > TOLERANCE:
        print(f"shardfc export: error: the reloaded TorchScript model differs from the checkpoint's by {diff:.3g}",
              file=sys.stderr)
        return 1
    print(f"wrote {out} (TorchScript, {trained.config.backbone}, input [N, 3, {h}, {w}] -> "
          f"[N, {trained.config.embedding_dim}]; reload check: max |diff| {diff:.2g})")
    if fc_shape is not None:
        print(f"wrote {args.fc} (class centres, one tensor {list(fc_shape)})")
    if onnx_out is None:
        return 0
    try:
        export_onnx(trained.model, example, onnx_out)
    except Exception as e:  # the exporter's many failure types all mean the same thing to a user
        print(f"shardfc export: ONNX export failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"wrote {onnx_out} (ONNX, dynamic batch)")
    return 0
