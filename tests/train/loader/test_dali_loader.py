"""``--loader dali``: the same batches as the torch loader (labels exact, pixels within the JPEG
decoders' tolerance) from folders and both RecordIO layouts, at non-square sizes in both orientations
and under the P x K sampler, every
record once per epoch over 1-3 ranks, a killed 2-rank run resumed bit for bit, a 2-stage pipeline
run bit-identical to its torch-loader twin, ``auto`` on the CPU, and bad input as a clear error.

Skipped without NVIDIA DALI, failing instead with ``SHARDFC_REQUIRE_DALI=1`` (as CI runs).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from shardfc.checkpoint import latest_checkpoint, read_stage_state, verify_checkpoint
from shardfc.cli import data as data_cli
from shardfc.cli import train as train_cli
from shardfc.data.recordio import RecordIODataset, RecordIOReader
from shardfc.data.transforms import CorruptImageError, decode_image, pil_to_tensor
from shardfc.parallel.context import DistContext
from shardfc.parallel.launch import WorkerError
from shardfc.train.config import ConfigError, TrainConfig
from shardfc.train.loader.dali_loader import DaliBatches, choose_loader, dali_to_torch
from shardfc.train.loader.data import EpochKeys, ShardBatches, micro_batches, rank_batches, train_dataset
from shardfc.train.state import RunState
from shardfc.train.stopping import CRASH_ENV

from ..builder.test_pipeline_strategy import _losses
from ..checkpointing.test_reproducible_resume import _weights
from ..tiny import tiny_config

pytestmark = pytest.mark.usefixtures("dali")

#: The loaders' tolerance, in uint8 levels. Decoding: DALI's libjpeg-turbo and PIL's agree exactly
#: here on images at the run's size (1 level allowed for another libjpeg-turbo build). Resizing
#: (DALI's antialiased linear vs PIL's bilinear), measured on random pixels, the worst case: up to 4,
#: 0.4 on average.
JPEG_TOLERANCE = 4

IDS, PER = 6, 5  # 30 images: every rank count of 1..3 divides them, so no sampler padding repeats one


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    """A JPEG folder (random pixels, so each image and its mirror are unique; two of them at
    another size, for the resize), its ``shardfc data pack`` (insightface layout: header and
    identity records) and ``shardfc data shuffle`` copy (image records only)."""
    root = tmp_path_factory.mktemp("dali")
    rng = np.random.default_rng(0)
    for ident in range(IDS):
        for k in range(PER):
            path = root / "folder" / f"id{ident}" / f"{k}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            size = (20, 24) if (ident, k) in ((1, 2), (4, 0)) else (16, 16)
            Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(path, quality=90)
    assert data_cli.main(["pack", str(root / "folder"), str(root / "packed")]) == 0
    assert data_cli.main(["shuffle", str(root / "packed"), str(root / "shuffled")]) == 0
    assert RecordIODataset(root / "packed", (16, 16)).layout == "insightface"
    assert RecordIODataset(root / "shuffled", (16, 16)).layout == "im2rec"
    return {"folder": root / "folder", "insightface": root / "packed", "im2rec": root / "shuffled"}


def _config(data_root: Path, layout: str, **overrides) -> TrainConfig:
    dataset = "folder" if layout == "folder" else "recordio"
    return dataclasses.replace(
        TrainConfig(dataset=dataset, data_root=str(data_root), image_size=[16, 16], seed=7, output_dir="unused"),
        **overrides,
    )


def _stream(cfg: TrainConfig, batches: int, channels_last: bool = False):
    dataset = train_dataset(cfg, tuple(cfg.image_size))
    shards = rank_batches(cfg, dataset, 4, DistContext())  # cfg.sampler's batches of 4, as the trainer's
    state = RunState(batches_per_epoch=len(shards))
    stream = micro_batches(dataset, shards, state, cfg, DistContext(), channels_last=channels_last)
    out = [(*next(stream)[:2], (state.epoch, state.batch_in_epoch)) for _ in range(batches)]
    stream.close()
    return out


def _assert_same_batches(torch_batches: list, dali_batches: list) -> None:
    """The same places and labels exactly, the same images within the decoders' tolerance."""
    assert len(torch_batches) == len(dali_batches)
    for (x, y, where), (xd, yd, where_d) in zip(torch_batches, dali_batches):
        assert where == where_d and torch.equal(y, yd)
        assert xd.dtype == torch.float32 and xd.shape == x.shape
        assert (xd - x).abs().max() <= JPEG_TOLERANCE * 2 / 255 + 1e-6  # normalised: 1 level = 2/255


@pytest.mark.parametrize("layout", ["folder", "insightface", "im2rec"])
def test_dali_gives_the_torch_loaders_batches(data, layout, caplog):
    # 10 micro-batches of 4: the epoch's 8 (the last one of 2 images) and 2 of the next epoch.
    cfg = _config(data[layout], layout, num_workers=0)
    torch_batches = _stream(cfg, 10)
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        dali_batches = _stream(dataclasses.replace(cfg, loader="dali", num_workers=2), 10)
    assert "loader: NVIDIA DALI, decoding on the CPU with 2 thread(s)" in caplog.text
    _assert_same_batches(torch_batches, dali_batches)
    levels = torch.cat([(xd - x).abs().flatten() for (x, _, _), (xd, _, _) in zip(torch_batches, dali_batches)]) * 255 / 2
    assert float(levels.mean()) < 0.05  # 28 of the 30 images decode exactly alike
    assert float(levels.max()) > 0.5  # the two resized ones do differ: the bound is not vacuous


@pytest.fixture(scope="module")
def odd_sizes(tmp_path_factory) -> Path:
    """A JPEG folder of smooth images (a coarse random grid, upscaled: resizing it is well conditioned,
    so DALI and PIL agree closely) at tall, wide and odd sizes."""
    root = tmp_path_factory.mktemp("dali_sizes") / "folder"
    rng = np.random.default_rng(1)
    sizes = [(300, 140), (140, 300), (41, 29), (29, 41), (256, 128), (128, 256), (97, 97), (63, 200)]  # (H, W)
    for i, (h, w) in enumerate(sizes):
        path = root / f"id{i % 2}" / f"{i}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        coarse = Image.fromarray(rng.integers(0, 256, (5, 4, 3), dtype=np.uint8))
        coarse.resize((w, h), Image.BICUBIC).save(path, quality=95)
    return root


@pytest.mark.parametrize("size", [(256, 128), (128, 256), (37, 23), (23, 37)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_dali_resizes_to_non_square_sizes_as_the_torch_loader(odd_sizes, size):
    # H x W as the run's image_size says, in both orientations: a transposed resize would give
    # W x H batches (or, for a square source, the other axis stretched), and flips along the wrong axis differ.
    cfg = _config(odd_sizes, "folder", image_size=list(size), num_workers=0)
    torch_batches = _stream(cfg, 3)  # 8 images in batches of 4: the epoch's 2 and one of the next
    dali_batches = _stream(dataclasses.replace(cfg, loader="dali", num_workers=1), 3)
    assert torch_batches[0][0].shape == (4, 3, *size)
    _assert_same_batches(torch_batches, dali_batches)


def test_pk_sampler_batches_are_the_torch_loaders(data, tmp_path, caplog):
    # Identity 0 keeps one image, so its chunk of K=2 is that image twice (drawn with replacement):
    # a batch that holds one index twice. 26 images, batches of 4 = 2 identities x 2: 5 an epoch.
    root = tmp_path / "uneven"
    shutil.copytree(data["folder"], root)
    for k in range(1, PER):
        (root / "id0" / f"{k}.jpg").unlink()
    cfg = _config(root, "folder", sampler="pk", pk_instances=2, num_workers=0)
    torch_batches = _stream(cfg, 7)  # an epoch and 2 batches of the next
    assert [where for _, _, where in torch_batches] == [(0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (1, 1), (1, 2)]
    assert all(torch.equal(y[0::2], y[1::2]) for _, y, _ in torch_batches)  # P x K: pairs of one identity
    assert any(int((y == 0).sum()) == 2 for _, y, _ in torch_batches)  # identity 0's repeated image
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        dali_batches = _stream(dataclasses.replace(cfg, loader="dali", num_workers=1), 7)
    assert "loader: NVIDIA DALI" in caplog.text
    _assert_same_batches(torch_batches, dali_batches)


def test_auto_on_the_cpu_loads_with_torch_and_says_so(data, caplog):
    cfg = _config(data["insightface"], "insightface", loader="auto", num_workers=0)
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        (x, _, _), = _stream(cfg, 1)
    assert "loader: torch DataLoader, 0 worker process(es) (--loader auto)" in caplog.text
    assert x.shape == (4, 3, 16, 16)


def test_channels_last_batches_are_the_nhwc_layout_of_the_same_values(data):
    cfg = _config(data["insightface"], "insightface", loader="dali")
    (x, _, _), = _stream(cfg, 1)
    (xl, _, _), = _stream(cfg, 1, channels_last=True)
    assert xl.is_contiguous(memory_format=torch.channels_last) and not xl.is_contiguous()
    assert x.is_contiguous() and torch.equal(x, xl)


def _which(image: torch.Tensor, references: list) -> int:
    """The index of the reference ``image`` is (as is or mirrored), within the JPEG tolerance."""
    for i, ref in enumerate(references):
        for candidate in (ref, ref.flip(-1)):
            if int((image.int() - candidate.int()).abs().max()) <= JPEG_TOLERANCE:
                return i
    raise AssertionError("a DALI image matches no record")


@pytest.mark.parametrize("world", [1, 2, 3])
def test_shards_cover_every_record_once_per_epoch(data, world):
    dataset = RecordIODataset(data["insightface"], (16, 16), train=True, seed=3)
    references = [
        pil_to_tensor(decode_image(dataset.read_image_bytes(i)).resize((16, 16), Image.BILINEAR))
        for i in range(len(dataset))
    ]
    seen, counts = [], []
    for rank in range(world):
        shards = ShardBatches(len(dataset), 4, rank, world, seed=3, drop_last=False)
        stream = iter(DaliBatches(dataset, EpochKeys(shards), torch.device("cpu"), 1, 5))
        batches = [next(stream) for _ in range(len(shards))]
        counts.append(len(batches))
        for images, labels, _, where in batches:
            for image, label in zip(dali_to_torch(images, torch.device("cpu"), hwc=False), labels):
                seen.append(_which(image, references))
                assert int(label) == dataset.label_of(seen[-1])
        stream.close()
    assert len(set(counts)) == 1  # the same number of batches on every rank
    assert sorted(seen) == list(range(len(dataset)))


def test_a_killed_two_rank_run_resumes_bit_identically(data, tmp_path):
    # 30 images over 2 ranks in micro-batches of 4: 4 per rank an epoch; 10 steps cross two epochs.
    cfg = tiny_config(
        tmp_path / "whole", dataset="recordio", data_root=str(data["insightface"]), loader="dali", num_workers=1,
        image_size=[16, 16], batch_size=4, grad_accum=1, max_steps=10, warmup_steps=2, poly_power=0.0,
        ckpt_every=4, eval_every=0, synthetic_val_pairs=0, log_every=5,
    )
    assert train_cli.run(cfg)["step"] == 10
    assert "loader: NVIDIA DALI" in (tmp_path / "whole" / "train.log").read_text()
    killed = dataclasses.replace(cfg, output_dir=str(tmp_path / "killed"))
    marker = tmp_path / "crashed"
    os.environ[CRASH_ENV] = f"1:6:{marker}"  # rank 1 dies at step 6, after the checkpoint of step 4
    try:
        with pytest.raises(WorkerError, match="rank 1"):
            train_cli.run(killed)
    finally:
        del os.environ[CRASH_ENV]
    assert marker.exists()
    assert train_cli.run(killed)["step"] == 10  # resumes from step 4
    whole, resumed = _weights(tmp_path / "whole"), _weights(tmp_path / "killed")
    assert [k for k in whole if not torch.equal(whole[k], resumed[k])] == []


@pytest.fixture(scope="module")
def at_run_size(data, tmp_path_factory) -> Path:
    """The RecordIO pack of the folder's images that are already 16x16 (28 of 30): nothing to
    resize, so DALI's decodes equal the torch loader's bit for bit."""
    root = tmp_path_factory.mktemp("dali_16")
    shutil.copytree(data["folder"], root / "folder")
    for odd in ("id1/2.jpg", "id4/0.jpg"):  # the two at 20x24
        (root / "folder" / odd).unlink()
    assert data_cli.main(["pack", str(root / "folder"), str(root / "packed")]) == 0
    return root / "packed"


def _stage_weights(run: Path) -> dict:
    """The last checkpoint's backbone (assembled from its stage files) and head."""
    ckpt = latest_checkpoint(run / "checkpoints")
    backbone, _ = read_stage_state(ckpt, verify_checkpoint(ckpt))
    return {**backbone, "margin_head.weight": torch.load(ckpt / "head_0.pt", weights_only=True)["tensors"]["weight"]}


def test_pipeline_stages_train_on_dali_batches_as_on_torch_ones(at_run_size, tmp_path):
    # 2 stages x 1 replica (the tiny backbone's one cut); 28 images in batches of 8 with drop_last:
    # 3 an epoch, so the 5 steps cross an epoch boundary. Only stage 0 loads; DALI decodes these
    # 16x16 JPEGs exactly as PIL does (libjpeg-turbo both), so the losses are equal, not just close.
    same = [torch.equal(x, xd) for (x, _, _), (xd, _, _) in zip(
        _stream(_config(at_run_size, "insightface"), 7), _stream(_config(at_run_size, "insightface", loader="dali"), 7))]
    assert all(same), "this test's premise: DALI's batches of images at the run's size are the torch loader's"
    cfg = tiny_config(
        tmp_path / "torch", dataset="recordio", data_root=str(at_run_size), strategy="pipeline", pipeline_stages=2,
        micro_batches=2, micro_batch_stats=True, batch_size=8, grad_accum=1, drop_last=True, max_steps=5,
        log_every=1, ckpt_every=0, eval_every=0, synthetic_val_pairs=0, num_workers=0,
    )
    dali = dataclasses.replace(cfg, output_dir=str(tmp_path / "dali"), loader="dali", num_workers=1)
    train_cli.run(cfg)
    train_cli.run(dali)
    assert "loader: NVIDIA DALI" in (tmp_path / "dali" / "train.log").read_text()
    expected, got = _losses(tmp_path / "torch"), _losses(tmp_path / "dali")
    assert sorted(expected) == [1, 2, 3, 4, 5] and expected[5] != expected[1]
    assert got == expected  # as logged: 6 significant digits; the weights below, every bit
    a, b = _stage_weights(tmp_path / "torch"), _stage_weights(tmp_path / "dali")
    assert list(a) == list(b) and [k for k in a if not torch.equal(a[k], b[k])] == []


def _corrupt_record(src: Path, dst: Path, key: int, how: str) -> Path:
    dst.mkdir()
    for name in ("train.rec", "train.idx", "property"):
        (dst / name).write_bytes((src / name).read_bytes())
    offset = RecordIOReader(dst / "train.rec").offset_of(key)
    blob = bytearray((dst / "train.rec").read_bytes())
    if how == "framing":
        blob[offset : offset + 4] = b"XXXX"  # the record's magic
    else:  # the image's bytes, past the 8-byte frame and the 24-byte IRHeader: framed, undecodable
        blob[offset + 8 + 24 : offset + 8 + 24 + 40] = b"\x00" * 40
    (dst / "train.rec").write_bytes(bytes(blob))
    return dst


@pytest.mark.parametrize("how, error, named", [
    ("framing", ValueError, "key 3: bad magic"),
    ("image", CorruptImageError, "train.rec#key 3.*the DALI loader stops"),
])
def test_a_damaged_record_is_an_error_naming_it(data, tmp_path, how, error, named):
    root = _corrupt_record(data["insightface"], tmp_path / "bad", 3, how)
    cfg = _config(root, "insightface", loader="dali")
    with pytest.raises(error, match=named):
        _stream(cfg, 8)  # one epoch: every record


def test_bad_input_before_the_first_batch(data, tmp_path, monkeypatch):
    bad = tmp_path / "noidx"
    bad.mkdir()
    (bad / "train.rec").write_bytes((data["insightface"] / "train.rec").read_bytes())
    with pytest.raises(FileNotFoundError, match="train.idx"):
        _stream(_config(bad, "insightface", loader="dali"), 1)
    few = tmp_path / "few"
    few.mkdir()
    for name in ("train.rec", "train.idx"):
        (few / name).write_bytes((data["insightface"] / name).read_bytes())
    (few / "property").write_text("4,16,16\n")  # labels run to 5
    with pytest.raises(ValueError, match="num_classes=4, but .* has label 5"):
        _stream(_config(few, "insightface", loader="dali"), 1)
    with pytest.raises(ConfigError, match="loader='dali' reads the 'recordio' and 'folder' datasets"):
        TrainConfig(loader="dali").validate()
    monkeypatch.setattr("shardfc.train.loader.dali_loader.importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"NVIDIA DALI is not installed: pip install 'shardfc\[dali\]'"):
        _config(data["folder"], "folder", loader="dali").validate()
    assert choose_loader("auto", "recordio", torch.device("cuda")) == "torch"  # auto without DALI


def test_auto_picks_dali_on_cuda_only():
    assert choose_loader("auto", "recordio", torch.device("cuda", 0)) == "dali"
    assert choose_loader("auto", "folder", torch.device("cpu")) == "torch"
    assert choose_loader("auto", "synthetic", torch.device("cuda")) == "torch"
    assert choose_loader("torch", "recordio", torch.device("cuda")) == "torch"
