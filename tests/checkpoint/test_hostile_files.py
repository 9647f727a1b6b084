"""Crafted files through every reader: none loads the wrong data, hangs, or exhausts memory.

Each case is a small file crafted here (a checkpoint folder, an exported model, a ``.pt`` record, a
``.bin`` set, a renames file) and ends, within seconds and without inflating anything, in one
CheckpointError / ConfigError / ValueError naming the file, or (through a command) in one line on
stderr and exit 2. A reader added to shardfc joins these cases (issue 33), or those of the non-checkpoint
readers in ``tests/data/test_hostile_data.py`` (issue 43); ``tests/test_files.py`` holds the file gate
all of them read through.
"""

from __future__ import annotations

import builtins
import dataclasses
import hashlib
import json
import os
import pickle
import signal
import struct
import subprocess
import sys
import time
import tracemalloc
import zipfile
from pathlib import Path

import pytest
import torch

from shardfc import checkpoint as ck
from shardfc.checkpoint import CheckpointError, StagePart, save_checkpoint
from shardfc.checkpoint.exported import read_exported
from shardfc.checkpoint.format import short_repr
from shardfc.checkpoint.load import COMPARE_BUDGET, objects_equal
from shardfc.checkpoint.weights_only import load_pt
from shardfc.cli import embed as cli_embed
from shardfc.cli import eval as cli_eval
from shardfc.cli import export as cli_export
from shardfc.data import glyphs as glyphs_module
from shardfc.data.glyphs import GlyphError, GlyphOptions, build, font_files
from shardfc.models import build_backbone
from shardfc.parallel.model_split import stages as cut_stages
from shardfc.train.checkpointing.artifacts import load_backbone
from shardfc.train.checkpointing.classes import read_renames, rename
from shardfc.train.checkpointing.fine_tune import resolve_init_from, saved_classes
from shardfc.train.config import ConfigError, TrainConfig

SRC = Path(__file__).resolve().parents[2] / "src"
DIM, SIZE = 8, [16, 16]
NAMES = ["ann", "bob", "cy", "dee"]


#: Time bounds hold a reader to ending, not to a speed: what they catch never ends (a FIFO read, a
#: comparison of 2^40 leaves, a character map of 2^32 groups), while the slowest case here needs 1.2 s on
#: an idle machine (``shardfc train`` starting in a subprocess; a reader 0.8 s at most). So the bounds are
#: many times that, and a machine busy with other work on every core still meets them; how much work a
#: reader did is asserted by what stopped it (a budget named in its error), not by the clock.
SECONDS = 30
HANG_S = 120  # the alarm behind every case (above SECONDS and the subprocess's 90 s)


pytestmark = pytest.mark.usefixtures("no_hang")  # tests/conftest.py: an alarm behind every case


# --------------------------------------------------------------------------- crafting


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_backbone("tiny", DIM, input_size=tuple(SIZE))


def _config(**fields) -> str:
    return json.dumps(dataclasses.asdict(TrainConfig(backbone="tiny", embedding_dim=DIM, image_size=SIZE)) | fields)


def _train_checkpoint(root: Path, *, staged: bool = False, **common) -> Path:
    """A checkpoint as ``shardfc train`` writes one (its backbone whole in common.pt, or per stage)."""
    model = _model()
    parts = None
    if staged:
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        parts = []
        for i, stage in enumerate(cut_stages(model, ["body"])):
            mine = [n for n, p in stage.named_parameters() if p.requires_grad]
            parts.append(StagePart(i, stage.state_dict(), {"state": {}, "param_groups": [{"lr": 0.1, "params": mine}]},
                                   list(model.state_dict()), names))
    base = {"config_json": _config(), "class_names": NAMES, "state": {}}
    if not staged:
        base["backbone"] = model.state_dict()
    return save_checkpoint(
        root, 1, common=base | common, per_rank=None, head_tensors={"weight": torch.randn(4, DIM)},
        class_range=range(4), num_classes=4, stage_parts=parts,
        fingerprint={"backbone": "tiny", "embedding_dim": DIM, "image_size": SIZE},
    )


def _edit_meta(path: Path, change) -> None:
    meta = json.loads((path / ck.META_FILE).read_text())
    change(meta)
    (path / ck.META_FILE).write_text(json.dumps(meta))


def _rewrite(path: Path, fname: str, obj=None, data: bytes | None = None) -> None:
    """Replace ``path/fname`` (torch.save of ``obj``, or ``data``) and record its size and hash in meta.json,
    as a crafted checkpoint would."""
    target = path / fname
    if data is None:
        torch.save(obj, target)
        data = target.read_bytes()
    else:
        target.write_bytes(data)

    def change(meta):
        meta["files"][fname] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    _edit_meta(path, change)


def _one_line(capsys, rc: int, *needles: str) -> str:
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def _every_command(capsys, path: Path, tmp_path: Path, *needles: str) -> None:
    """eval, export and embed each refuse ``path`` in one line naming ``needles``, exit 2."""
    images = tmp_path / "images"
    images.mkdir(exist_ok=True)
    from PIL import Image

    Image.new("RGB", (16, 16)).save(images / "a.png")
    capsys.readouterr()
    commands = [
        lambda: cli_eval.main(["--checkpoint", str(path), "--synthetic-pairs", "10", "--device", "cpu"]),
        lambda: cli_export.main(["--checkpoint", str(path), "--out", str(tmp_path / "m.pt"), "--force"]),
        lambda: cli_embed.main(["--checkpoint", str(path), "--images", str(images), "--out", str(tmp_path / "e.npy"),
                                "--device", "cpu", "--force"]),
    ]
    for command in commands:
        _one_line(capsys, command(), *needles)


def _zip_with(path: Path, out: Path, replace: dict, compress: dict = ()) -> Path:
    """A copy of zip ``path`` with members (by name suffix) replaced, some deflated."""
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            for suffix, new in replace.items():
                if info.filename.endswith(suffix):
                    data = new
            kind = zipfile.ZIP_DEFLATED if any(info.filename.endswith(s) for s in compress) else zipfile.ZIP_STORED
            dst.writestr(zipfile.ZipInfo(info.filename), data, compress_type=kind)
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "model.pt"
    cli_export.export_torchscript(_model().eval(), torch.zeros(2, 3, *SIZE), out,
                                  {"backbone": "tiny", "embedding_dim": DIM})
    return out


def _bounded(fn, *, seconds: float = SECONDS, megabytes: float = 100.0):
    """``fn()``'s exception, raised within ``seconds`` and ``megabytes`` of Python allocations."""
    tracemalloc.start()
    start = time.monotonic()
    try:
        with pytest.raises((CheckpointError, ConfigError, ValueError)) as info:
            fn()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert time.monotonic() - start < seconds
    assert peak < megabytes * 2**20, f"{peak / 2**20:.0f} MB"
    assert "\n" not in str(info.value)
    return info.value


# --------------------------------------------------------------------------- 1. inside the folder, regular files only


@pytest.mark.parametrize("name", ["/etc/passwd", "../../../etc/passwd", "../other/common.pt", "sub/head_0.pt",
                                  "notes.txt", "/dev/zero", "common.pt\n", "./common.pt"])
def test_a_meta_json_naming_a_path_or_a_foreign_name_is_refused(tmp_path: Path, name: str):
    path = _train_checkpoint(tmp_path)
    size = os.path.getsize("/etc/passwd")
    _edit_meta(path, lambda m: m["files"].__setitem__(name, {"size": 0}))
    with pytest.raises(CheckpointError, match=r"lists the file .* not a name shardfc writes") as info:
        ck.verify_checkpoint(path)
    assert f"{size} bytes" not in str(info.value)  # nothing outside the folder was even stat'ed


@pytest.mark.parametrize("name", ["/dev/zero", "../../../etc/passwd", "../step_2/backbone_stage0.pt"])
def test_stage_files_naming_a_path_are_refused_by_every_command(tmp_path: Path, capsys, name: str):
    path = _train_checkpoint(tmp_path / "run", staged=True)

    def change(meta):
        files = meta["backbone_stages"]["files"]
        files[name] = files.pop("backbone_stage0.pt")
        meta["files"][name] = meta["files"].pop("backbone_stage0.pt")

    _edit_meta(path, change)
    _every_command(capsys, path, tmp_path, "not a name shardfc writes")
    with pytest.raises(CheckpointError, match="not a name shardfc writes"):
        resolve_init_from(str(path))


def _swapped_after_the_check(tmp_path: Path, monkeypatch, swap_in) -> Path:
    """A checkpoint file that ``swap_in(path)`` replaces (after unlinking it) between the gate's check
    of it (``shardfc.files.regular_file``, which every reader's open goes through) and the open."""
    from shardfc import files

    path = tmp_path / ck.COMMON_FILE
    path.write_bytes(b"this run's file")
    check = files.regular_file

    def check_then_swap(p, *args, **kwargs):
        st = check(p, *args, **kwargs)
        os.unlink(p)
        swap_in(p)
        return st

    monkeypatch.setattr(files, "regular_file", check_then_swap)
    return path


@pytest.mark.parametrize("kind", ["symlink to another run", "symlink to /dev/zero", "fifo", "folder"])
@pytest.mark.parametrize("fname", ["head_0.pt", "common.pt", "meta.json"])
def test_an_entry_that_is_not_a_regular_file_is_refused_before_it_is_read(tmp_path: Path, kind: str, fname: str):
    other = _train_checkpoint(tmp_path / "other")
    path = _train_checkpoint(tmp_path / "run")
    (path / fname).unlink()
    if kind == "symlink to another run":
        (path / fname).symlink_to(other / fname)  # same bytes, same hash: only lstat tells
    elif kind == "symlink to /dev/zero":
        (path / fname).symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path / fname)
    else:
        (path / fname).mkdir()
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=rf"refusing to read .*{fname}.*not a regular file") as info:
        ck.load_checkpoint(path, class_range=range(4), num_classes=4)
    assert "\n" not in str(info.value) and time.monotonic() - start < SECONDS
    assert ck.latest_checkpoint(tmp_path / "run") is None  # skipped, not hashed forever


@pytest.mark.parametrize("follow_symlinks", [False, True])
def test_a_symlink_swapped_in_after_the_check_is_not_followed(tmp_path: Path, monkeypatch, follow_symlinks: bool):
    """Between the check of a checkpoint file and its open, another process can swap a symlink in: the
    open itself refuses to follow it (only a file the user names himself may be one)."""
    from shardfc.checkpoint import format as fmt

    other = tmp_path / "other.pt"
    other.write_bytes(b"another run's file")
    fifo = tmp_path / "fifo.pt"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match=f"refusing to read stage file {fifo}: it is a FIFO"):
        fmt.open_regular(fifo, "stage file")  # what the file is, named
    path = _swapped_after_the_check(tmp_path, monkeypatch, lambda p: os.symlink(other, p))
    if follow_symlinks:
        with fmt.open_regular(path, follow_symlinks=True) as f:
            assert f.read() == b"another run's file"
    else:
        with pytest.raises(CheckpointError, match=rf"cannot open checkpoint file .*{ck.COMMON_FILE}"):
            fmt.open_regular(path)


def test_a_fifo_swapped_in_after_the_check_is_refused_without_waiting_for_a_writer(tmp_path: Path, monkeypatch):
    from shardfc.checkpoint import format as fmt

    path = _swapped_after_the_check(tmp_path, monkeypatch, os.mkfifo)
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=rf"refusing to read checkpoint file {path}: it is a FIFO, not a regular"):
        fmt.open_regular(path)  # opened without blocking (no writer will come), then checked again
    assert time.monotonic() - start < SECONDS


def test_train_resuming_from_a_fifo_stops_with_one_line(tmp_path: Path):
    """The hash of a FIFO never returned, and the run then ignored SIGTERM: it is now refused at once."""
    out = tmp_path / "run"
    path = _train_checkpoint(out / "checkpoints")
    (path / ck.COMMON_FILE).unlink()
    os.mkfifo(path / ck.COMMON_FILE)
    cmd = [sys.executable, "-m", "shardfc", "train", "--output-dir", str(out), "--resume", str(path), "--nproc", "1",
           "--image-size", "16", "16", "--embedding-dim", str(DIM), "--synthetic-identities", "4", "--max-steps", "1"]
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=str(SRC)), stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=90)  # 1.2 s when idle
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the old behaviour: still hashing, deaf to SIGTERM
        _, err = proc.communicate(timeout=10)
        pytest.fail(f"train hung on a FIFO common.pt: {err[-500:]}")
    lines = [line for line in err.splitlines() if "error" in line]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "common.pt" in lines[0] and "not a regular file" in lines[0]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A checkpoint of one step of a real ``shardfc train`` run (4 identities, one process)."""
    from shardfc.cli import train as train_cli

    out = tmp_path_factory.mktemp("trained") / "run"
    train_cli.run(_tiny_run(out, max_steps=1))
    return out


def _tiny_run(out: Path, **fields) -> TrainConfig:
    """A run of a second: 4 synthetic identities at 16 x 16, one process, no evaluation."""
    return TrainConfig(synthetic_identities=4, synthetic_images_per_identity=5, image_size=SIZE, embedding_dim=DIM,
                       batch_size=8, warmup_steps=0, eval_every=0, ckpt_every=0, output_dir=str(out), progress=False,
                       nproc=1, **fields)


def _tamper_common(change):
    def tamper(path: Path) -> None:
        common = torch.load(path / ck.COMMON_FILE, weights_only=True)
        change(common)
        _rewrite(path, ck.COMMON_FILE, common)

    return tamper


@pytest.mark.parametrize("tamper, needle", [
    (_tamper_common(lambda c: c.pop("state")), "common.pt"),
    (_tamper_common(lambda c: c.__setitem__("state", [1, 2])), "common.pt"),
    (_tamper_common(lambda c: c.__setitem__("world_size", "two")), "common.pt"),
    (_tamper_common(lambda c: c["backbone"].__setitem__(next(iter(c["backbone"])), torch.zeros(1))), "step_00000001"),
    (_tamper_common(lambda c: c.__setitem__("schedulers", [{"nonsense": 1}])), "common.pt"),
])
def test_resuming_from_a_checkpoint_holding_other_state_is_one_error(trained_run: Path, tmp_path: Path, tamper, needle):
    import shutil

    from shardfc.cli import train as train_cli

    out = tmp_path / "run"
    shutil.copytree(trained_run, out)
    path = out / "checkpoints" / "step_00000001"
    tamper(path)
    cfg = _tiny_run(out, max_steps=2, resume=str(path))
    with pytest.raises(train_cli.USER_ERRORS) as info:
        train_cli.run(cfg)
    assert needle in str(info.value) and "\n" not in str(info.value)


# --------------------------------------------------------------------------- 2. no silent remapping


def test_a_key_in_no_stage_file_or_in_two_is_refused(tmp_path: Path, capsys):
    path = _train_checkpoint(tmp_path / "a", staged=True)
    _edit_meta(path, lambda m: m["backbone_stages"]["files"]["backbone_stage1.pt"]["keys"].remove("fc.weight")
               if "fc.weight" in m["backbone_stages"]["files"]["backbone_stage1.pt"]["keys"] else
               m["backbone_stages"]["files"]["backbone_stage0.pt"]["keys"].remove("fc.weight"))
    _every_command(capsys, path, tmp_path, "do not partition", "fc.weight")

    path = _train_checkpoint(tmp_path / "b", staged=True)

    def twice(meta):
        files = meta["backbone_stages"]["files"]
        files["backbone_stage1.pt"]["keys"].append(files["backbone_stage0.pt"]["keys"][0])

    _edit_meta(path, twice)
    with pytest.raises(CheckpointError, match=r"lists key '.*' in both backbone_stage0\.pt and backbone_stage1\.pt"):
        load_backbone(path)


def test_a_stage_part_missing_a_key_or_of_another_shape_is_refused(tmp_path: Path, capsys):
    path = _train_checkpoint(tmp_path / "run", staged=True)
    part = torch.load(path / "backbone_stage1.pt", weights_only=True)
    key = next(k for k, v in part["model"].items() if v.dim() == 2)
    part["model"][key] = torch.zeros(3, 3)  # the meta still lists it: a shape torch would refuse with a traceback
    _rewrite(path, "backbone_stage1.pt", part)
    _every_command(capsys, path, tmp_path, "backbone_stage1.pt", "does not hold the weights")


def test_common_backbone_of_another_shape_is_one_line(tmp_path: Path, capsys):
    path = _train_checkpoint(tmp_path / "run")
    common = torch.load(path / ck.COMMON_FILE, weights_only=True)
    key = next(iter(common["backbone"]))
    common["backbone"][key] = torch.zeros(1)
    _rewrite(path, ck.COMMON_FILE, common)
    _every_command(capsys, path, tmp_path, "common.pt", "does not hold the weights")


@pytest.mark.parametrize("text", ["ann\tbob\nbob\tann\n", "ann\tbob\nbob\tcy\ncy\tann\n", "ann\tbob\nbob\tcy\n"])
def test_renames_that_swap_cycle_or_chain_are_refused(tmp_path: Path, text: str):
    f = tmp_path / "renames.tsv"
    f.write_text(text)
    with pytest.raises(ConfigError, match=r"line \d: '\w+' is both renamed and a new name"):
        read_renames(f)


def test_renames_passed_again_change_nothing(tmp_path: Path):
    f = tmp_path / "renames.tsv"
    f.write_text("ann\tanna\nbob\trobert\n")
    once = rename(NAMES, read_renames(f))
    assert once == ["anna", "robert", "cy", "dee"]
    assert rename(once, read_renames(f)) == once  # the next resume, the same file


@pytest.mark.parametrize("kind, needle", [("fifo", "FIFO"), ("dev_zero", "device"), ("latin1", "not utf-8 text"),
                                           ("huge", "SHARDFC_MAX_NAMES_BYTES")])
def test_a_hostile_renames_file_is_one_config_error(tmp_path: Path, monkeypatch, special_file, kind: str, needle: str):
    """Through the file gate (issue 43): a regular file, UTF-8, at most the names cap."""
    f = tmp_path / "renames.tsv"
    if special_file(f, kind):
        pass
    elif kind == "latin1":
        f.write_bytes(b"caf\xe9\tcafe\n")
    else:
        monkeypatch.setenv("SHARDFC_MAX_NAMES_BYTES", "1K")
        f.write_text("ann\tanna\n" * 200)
    error = _bounded(lambda: read_renames(f))
    assert isinstance(error, ConfigError) and "renames.tsv" in str(error) and needle in str(error), error


def test_embed_skips_images_that_are_not_regular_files_inside_images(tmp_path: Path, capsys):
    """``shardfc embed --images DIR``: a FIFO, /dev/zero or a link out of DIR named like an image is
    skipped and named, never read; the other images are embedded (issue 43)."""
    from PIL import Image

    path = _train_checkpoint(tmp_path / "run")
    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (16, 16)).save(images / "a.png")
    Image.new("RGB", (16, 16)).save(tmp_path / "secret.png")
    os.mkfifo(images / "pipe.png")
    os.symlink("/dev/zero", images / "zero.png")
    os.symlink(tmp_path / "secret.png", images / "out.png")
    capsys.readouterr()
    rc = cli_embed.main(["--checkpoint", str(path), "--images", str(images), "--out", str(tmp_path / "e.npy"),
                         "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "skipped 3 corrupt image(s)" in err and all(n in err for n in ("pipe.png", "zero.png", "out.png")), err
    assert (tmp_path / "e.npy.paths.txt").read_text() == "a.png\n"


@pytest.mark.parametrize("names", ["ABCD", ["a", "a", "b", "c"], ["a", "b", "c"], ["a", "b", "c", 4]])
def test_class_names_must_be_distinct_strings_one_per_class(tmp_path: Path, names):
    path = _train_checkpoint(tmp_path, class_names=names)
    with pytest.raises(CheckpointError, match=r"common\.pt: class_names must be"):
        saved_classes(path, trust_pickle=False)


# --------------------------------------------------------------------------- 3. bounded work


def _bomb(size: int = 32 << 20) -> bytes:
    return bytes(size)


def test_a_deflated_member_of_an_exported_model_is_refused_before_inflating(exported: Path, tmp_path: Path):
    crafted = _zip_with(exported, tmp_path / "bomb.pt", {"/data/0": _bomb()}, compress={"/data/0"})
    assert crafted.stat().st_size < 1 << 20
    error = _bounded(lambda: read_exported(crafted), megabytes=8)
    assert "compressed" in str(error) and "bomb.pt" in str(error)


def test_a_deflated_record_of_a_pt_file_is_refused_before_inflating(tmp_path: Path):
    torch.save({"w": torch.zeros(4)}, tmp_path / "plain.pt")
    crafted = _zip_with(tmp_path / "plain.pt", tmp_path / "bomb.pt", {"/data/0": _bomb()}, compress={"/data/0"})
    error = _bounded(lambda: load_pt(crafted, "cpu", trust_pickle=False, meta={}), megabytes=8)
    assert "compressed" in str(error)


def test_a_record_said_deflated_whose_two_sizes_are_equal_is_refused(tmp_path: Path):
    """The compression method in the header is checked, not only the sizes: a deflated record can be as
    long compressed as inflated (incompressible bytes, then a few zeros), and is inflated all the same."""
    noise = torch.randint(0, 256, (64,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for zeros in range(0, 256, 4):
        data = bytes(noise.tolist()) + bytes(zeros)
        torch.save({"w": torch.zeros(len(data) // 4)}, tmp_path / "plain.pt")
        crafted = _zip_with(tmp_path / "plain.pt", tmp_path / "equal.pt", {"/data/0": data}, compress={"/data/0"})
        with zipfile.ZipFile(crafted) as archive:
            info = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
        if info.compress_size == info.file_size:
            break
    else:
        pytest.fail("no deflated record as long as its bytes")
    assert info.compress_type == zipfile.ZIP_DEFLATED
    error = _bounded(lambda: load_pt(crafted, "cpu", trust_pickle=False, meta={}))
    assert f"refusing to read {crafted}: its member 'plain/data/0' is compressed ({len(data)} bytes inflating to " \
        f"{len(data)})" in str(error)


def test_check_stored_checks_the_members_named_and_reads_any_file_object(tmp_path: Path):
    """Members left out by ``names`` are skipped, not the end of the check; a file object without a
    descriptor is checked too (without the end-of-file bound)."""
    import io

    from shardfc.checkpoint.weights_only import check_stored

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("a/skipped", b"x" * 100, compress_type=zipfile.ZIP_STORED)
        z.writestr("b/checked", b"y" * 100, compress_type=zipfile.ZIP_DEFLATED)

    class NoDescriptor:  # read, seek and tell only
        def __init__(self, data):
            self._f = io.BytesIO(data)
            self.read, self.seek, self.tell = self._f.read, self._f.seek, self._f.tell

    with zipfile.ZipFile(NoDescriptor(buf.getvalue())) as archive:
        check_stored(archive, tmp_path / "x.pt", names=lambda name: name.startswith("a/"))
        with pytest.raises(CheckpointError, match="its member 'b/checked' is compressed"):
            check_stored(archive, tmp_path / "x.pt", names=lambda name: name != "a/skipped")


def _central_record(data: bytes, suffix: bytes) -> int:
    """Where the central directory's record of the member whose name ends in ``suffix`` starts."""
    at = data.index(b"PK\x01\x02")
    while not data[at + 46 : at + 46 + struct.unpack_from("<H", data, at + 28)[0]].endswith(suffix):
        at = data.index(b"PK\x01\x02", at + 4)
    return at


def test_a_record_said_to_extend_past_the_end_of_the_file_is_refused(tmp_path: Path):
    """A stored member whose two sizes (equal, as stored ones are) run past the file's end."""
    torch.save({"w": torch.zeros(4)}, tmp_path / "plain.pt")
    data = bytearray((tmp_path / "plain.pt").read_bytes())
    at = _central_record(bytes(data), b"/data/0")
    struct.pack_into("<LL", data, at + 20, 1 << 30, 1 << 30)  # compressed and uncompressed sizes
    (tmp_path / "long.pt").write_bytes(bytes(data))
    error = _bounded(lambda: load_pt(tmp_path / "long.pt", "cpu", trust_pickle=False, meta={}))
    assert str(error) == f"{tmp_path / 'long.pt'} is truncated or corrupt: member 'plain/data/0' extends past the end " \
        "of the file"


def test_a_zip_whose_central_directory_is_damaged_is_one_line_naming_the_file(tmp_path: Path):
    torch.save({"w": torch.zeros(4)}, tmp_path / "plain.pt")
    data = bytearray((tmp_path / "plain.pt").read_bytes())
    data[_central_record(bytes(data), b"/data/0") + 2] = 0  # its signature: the end record still finds it
    (tmp_path / "damaged.pt").write_bytes(bytes(data))
    assert zipfile.is_zipfile(tmp_path / "damaged.pt")
    error = _bounded(lambda: load_pt(tmp_path / "damaged.pt", "cpu", trust_pickle=False, meta={}))
    assert str(error) == f"cannot read checkpoint file {tmp_path / 'damaged.pt'}: BadZipFile: Bad magic number for " \
        "central directory"


@pytest.mark.parametrize("kind", ["deflated", "fifo"])
def test_import_arcface_refuses_a_deflated_or_endless_pt_in_one_line(tmp_path: Path, capsys, kind: str):
    from shardfc.cli import import_arcface as cli_import

    backbone = tmp_path / "backbone.pth"
    if kind == "fifo":
        os.mkfifo(backbone)
    else:
        torch.save(_model().state_dict(), tmp_path / "plain.pth")
        _zip_with(tmp_path / "plain.pth", backbone, {"/data/0": _bomb()}, compress={"/data/0"})
    rc = cli_import.main(["--backbone", str(backbone), "--network", "tiny", "--num-classes", "4",
                          "--out", str(tmp_path / "run")])
    _one_line(capsys, rc, "backbone.pth", *(["compressed"] if kind == "deflated" else []))  # a FIFO: "not found"


def test_eval_of_a_crafted_bin_is_one_line(tmp_path: Path, capsys):
    import io

    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (4, 4)).save(png, format="PNG")
    crafted = tmp_path / "crafted.bin"
    crafted.write_bytes(pickle.dumps(([png.getvalue()] * 200_000, [True] * 100_000)))
    path = _train_checkpoint(tmp_path / "run")
    capsys.readouterr()
    rc = cli_eval.main(["--checkpoint", str(path), "--bin", str(crafted), "--device", "cpu"])
    _one_line(capsys, rc, "crafted.bin", "same encoded image")


def _shared_tuples(depth: int):
    t: tuple = ()
    for _ in range(depth):
        t = (t, t)
    return t


def test_nested_shared_tuples_have_a_bounded_repr_and_comparison():
    deep = _shared_tuples(60)  # 2^60 leaves, 60 objects
    start = time.monotonic()
    assert len(short_repr(deep)) <= 200
    with pytest.raises(CheckpointError, match="too large to compare"):
        objects_equal({"x": deep}, {"x": _shared_tuples(60)}, "the extras")
    assert time.monotonic() - start < SECONDS


@pytest.mark.parametrize("limit,fits", [(20, "x" * 18), (200, ("x" * 63, "x" * 63, "x" * 62))])
def test_a_value_in_an_error_is_cut_to_its_limit_and_says_so(limit: int, fits):
    """short_repr and error_line bound what an error prints of a value: up to ``limit`` characters
    as they are, one more and it is cut to ``limit`` ending in "...", and error_line on one line."""
    from shardfc.checkpoint.weights_only import error_line

    assert len(repr(fits)) == limit  # (each string short enough for reprlib to keep whole)
    assert short_repr(fits, limit) == repr(fits)
    longer = fits + "y" if isinstance(fits, str) else fits[:-1] + (fits[-1] + "y",)
    cut = short_repr(longer, limit)
    assert len(cut) == limit and cut == repr(longer)[: limit - 3] + "..."
    prefix = "ValueError: "
    text = "a\n b  " + "z" * (limit - 4)  # limit characters once its whitespace is one space each
    assert error_line(ValueError(text), limit) == prefix + "a b " + "z" * (limit - 4)
    line = error_line(ValueError(text + "!"), limit)
    assert line == prefix + ("a b " + "z" * (limit - 4))[: limit - 3] + "..."


def test_the_default_limits_and_a_value_whose_repr_fails():
    from shardfc.checkpoint.weights_only import error_line

    class list(builtins.list):  # walked by reprlib as a list (by its name), and the walk fails
        def __iter__(self):
            raise RuntimeError("no")

    assert short_repr(list([1])) == "<list>"
    assert len(short_repr(("x" * 70,) * 4)) == 200  # a repr of 300 characters (reprlib keeps 4 items of 70)
    assert len(error_line(ValueError("e" * 400))) == len("ValueError: ") + 300


def test_head_shards_whose_extras_share_2_40_leaves_are_compared_in_bounded_time(tmp_path: Path):
    path = _train_checkpoint(tmp_path)
    for r, (a, b) in enumerate([(0, 2), (2, 4)]):
        _rewrite(path, f"head_{r}.pt", {"class_range": (a, b), "tensors": {"weight": torch.zeros(b - a, DIM)},
                                        "extras": {"x": _shared_tuples(40)}})

    def two_shards(meta):
        meta["class_ranges"], meta["world_size"] = [[0, 2], [2, 4]], 2

    _edit_meta(path, two_shards)
    error = _bounded(lambda: ck.load_checkpoint(path, class_range=range(4), num_classes=4), megabytes=50)
    assert str(error) == (f"the head extras of {path / 'head_1.pt'} are too large to compare "  # stopped by its count
                          f"(more than {COMPARE_BUDGET} values)")


class _Marker:
    pass


def test_an_exported_pickle_with_a_huge_repr_fails_fast(exported: Path, tmp_path: Path):
    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return _shared_tuples(40) if isinstance(obj, _Marker) else None

    import io

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(_Marker())
    crafted = _zip_with(exported, tmp_path / "repr.pt", {"/data.pkl": buf.getvalue()})
    assert "unexpected persistent id" in str(_bounded(lambda: read_exported(crafted)))


def test_an_exported_pickle_of_millions_of_opcodes_is_refused_by_its_size(exported: Path, tmp_path: Path):
    crafted = _zip_with(exported, tmp_path / "noops.pt", {"/data.pkl": b"\x80\x02" + b"N0" * (20 << 20) + b"N."})
    from shardfc.checkpoint.exported import MAX_PICKLE_BYTES

    with zipfile.ZipFile(crafted) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data.pkl"))
    assert str(_bounded(lambda: read_exported(crafted), megabytes=200)) == (
        f"refusing to read {crafted}: its {info.filename} has {info.file_size} bytes, more than the "
        f"{MAX_PICKLE_BYTES >> 10} KiB a `shardfc export` file holds there")


def test_a_bin_naming_one_image_many_times_is_refused_before_decoding(tmp_path: Path):
    import io

    from PIL import Image

    from shardfc.evaluation import load_bin

    png = io.BytesIO()
    Image.new("RGB", (4, 4)).save(png, format="PNG")
    one = png.getvalue()
    path = tmp_path / "crafted.bin"
    path.write_bytes(pickle.dumps(([one] * 200_000, [True] * 100_000)))
    assert path.stat().st_size < 1 << 20
    assert "same encoded image" in str(_bounded(lambda: load_bin(path), megabytes=100))
    distinct = tmp_path / "tiny.bin"  # tiny distinct PNGs: more than 1024 times the file decoded
    pngs = []
    for i in range(4000):
        png = io.BytesIO()
        Image.new("RGB", (1, 1), (i % 256, i // 256, 0)).save(png, format="PNG")
        pngs.append(png.getvalue())
    distinct.write_bytes(pickle.dumps((pngs, [True] * 2000)))
    assert "times its size" in str(_bounded(lambda: load_bin(distinct), megabytes=100))


@pytest.mark.parametrize("fields, message", [
    ({"embedding_dim": 1 << 25}, "embedding_dim must be <= 65536"),
    ({"embedding_dim": -5}, "embedding_dim must be >= 1"),
    ({"image_size": [30000, 30000]}, "image_size must be empty or two ints"),
    ({"backbone": 7}, "backbone must be"),
])
def test_a_saved_config_is_validated_before_anything_is_built(tmp_path: Path, capsys, fields, message):
    path = _train_checkpoint(tmp_path / "run", config_json=_config(**fields))
    error = _bounded(lambda: load_backbone(path), megabytes=50)
    assert "common.pt" in str(error) and message in str(error)
    _every_command(capsys, path, tmp_path, "common.pt", message)


@pytest.mark.parametrize("image_size", [None, [30000, 30000], [16], "16x16", [16.0, 16]])
def test_the_recorded_input_size_is_validated(tmp_path: Path, capsys, image_size):
    path = _train_checkpoint(tmp_path / "run")

    def change(meta):
        if image_size is None:
            del meta["fingerprint"]["image_size"]
        else:
            meta["fingerprint"]["image_size"] = image_size

    _edit_meta(path, change)
    _every_command(capsys, path, tmp_path, "meta.json", "image_size")


def test_a_saved_config_value_with_a_huge_repr_is_refused_fast(tmp_path: Path, capsys):
    """A format-1 ``config`` dict (read as it is, not from JSON) holding nested shared tuples."""
    path = _train_checkpoint(tmp_path / "run")
    common = torch.load(path / ck.COMMON_FILE, weights_only=True)
    del common["config_json"]
    common["config"] = {"backbone": _shared_tuples(40)}
    _rewrite(path, ck.COMMON_FILE, common)
    error = _bounded(lambda: load_backbone(path), megabytes=50)
    assert "common.pt: the saved config's 'backbone' is" in str(error) and len(str(error)) < 600


@pytest.mark.parametrize("config_json", ["{not json", "[1, 2]"])
def test_a_config_that_is_not_a_json_object_is_one_line(tmp_path: Path, capsys, config_json):
    path = _train_checkpoint(tmp_path / "run", config_json=config_json)
    _every_command(capsys, path, tmp_path, "common.pt", "config")


# --------------------------------------------------------------------------- 4. one line naming the file


def _member_offset(path: Path, suffix: str) -> int:
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(suffix))
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len


@pytest.mark.parametrize("damage", ["crc of a storage", "crc of data.pkl", "cut"])
def test_a_damaged_export_is_one_line(exported: Path, tmp_path: Path, damage: str):
    from shardfc.checkpoint.weights_only import error_line

    data = bytearray(exported.read_bytes())
    crafted = tmp_path / "damaged.pt"
    suffix = "/data/0" if "storage" in damage else "/data.pkl"
    if damage.startswith("crc"):
        data[_member_offset(exported, suffix) + 1] ^= 0xFF
    else:
        del data[len(data) // 2: len(data) // 2 + 64]  # a cut in the middle: the directory no longer points right
    crafted.write_bytes(bytes(data))
    error = _bounded(lambda: read_exported(crafted))
    assert "damaged.pt: the archive is damaged" in str(error)
    if damage.startswith("crc"):  # the reader's own error, as zipfile gives it reading that member
        with zipfile.ZipFile(crafted) as archive, pytest.raises(zipfile.BadZipFile) as reference:
            archive.read(next(n for n in archive.namelist() if n.endswith(suffix)))
        assert str(error) == f"cannot read {crafted}: the archive is damaged ({error_line(reference.value)})"


@pytest.mark.parametrize("metadata, message", [(b"{oops", "is not JSON"), (b"[1, 2]", "holds a list")])
def test_an_invalid_shardfc_json_names_the_file(exported: Path, tmp_path: Path, metadata, message):
    crafted = _zip_with(exported, tmp_path / "meta.pt", {"/extra/shardfc.json": metadata})
    error = _bounded(lambda: read_exported(crafted))
    assert "meta.pt" in str(error) and "shardfc.json" in str(error) and message in str(error)


def test_a_pickle_setitem_on_an_empty_stack_is_one_line(exported: Path, tmp_path: Path):
    crafted = _zip_with(exported, tmp_path / "setitem.pt", {"/data.pkl": b"\x80\x02K\x01s."})
    assert "malformed" in str(_bounded(lambda: read_exported(crafted)))


def test_init_from_an_export_with_a_huge_member_is_refused(exported: Path, tmp_path: Path):
    crafted = _zip_with(exported, tmp_path / "bomb.pt", {"/data/0": _bomb(8 << 20)}, compress={"/data/0"})
    assert resolve_init_from(str(crafted)) == crafted  # recognised by its listing only
    assert "compressed" in str(_bounded(lambda: read_exported(crafted), megabytes=8))


def test_export_checks_the_bytes_it_wrote_not_the_file_by_name(tmp_path: Path, monkeypatch):
    loaded = []
    real = torch.jit.load
    monkeypatch.setattr(torch.jit, "load", lambda f, *a, **k: loaded.append(f) or real(f, *a, **k))
    cli_export.export_torchscript(_model().eval(), torch.zeros(2, 3, *SIZE), tmp_path / "m.pt", {})
    assert loaded and not any(isinstance(f, (str, os.PathLike)) for f in loaded)


def test_a_fifo_or_a_link_loop_named_like_a_font_is_never_opened(tmp_path):
    """``shardfc data glyphs --fonts DIR``: only regular files are read, so a FIFO named like a font
    cannot hang the build and a link loop cannot fail it."""
    fonts = tmp_path / "fonts"
    fonts.mkdir()
    os.mkfifo(fonts / "pipe.ttf")
    os.symlink("loop.otf", fonts / "loop.otf")
    assert font_files([str(fonts)]) == []
    with pytest.raises(GlyphError, match="no CJK font found"):
        build(str(tmp_path / "out"), GlyphOptions(), font_dirs=[str(fonts)])


def _tiny_cjk_font(path: Path, cmap_format: int, units_per_em: int = 1000, extent: int = 900) -> None:
    """A valid TrueType font of one glyph mapped from U+4E00, its character map one subtable of
    ``cmap_format`` (4 or 12), written by fontTools; the glyph a bar ``extent`` units wide."""
    from fontTools.ttLib.tables._c_m_a_p import CmapSubtable

    from tiny_fonts import one_glyph_font

    fb = one_glyph_font("Hostile", units_per_em, extent)
    sub = CmapSubtable.newSubtable(cmap_format)
    sub.platformID, sub.platEncID, sub.language, sub.cmap = 3, (10 if cmap_format == 12 else 1), 0, {0x4E00: "yi"}
    fb.font["cmap"].tables = [sub]
    fb.save(str(path))


def _cmap_entry(data: bytes) -> int:
    """Where a one-font file's table directory describes its ``cmap``."""
    (n,) = struct.unpack_from(">H", data, 4)
    entry = next((12 + 16 * i for i in range(n) if data[12 + 16 * i : 16 + 16 * i] == b"cmap"), None)
    assert entry is not None, "no cmap"
    return entry


def _cmap_subtable_at(data: bytes) -> int:
    """The file offset of the first subtable of a one-font file's ``cmap``."""
    offset = struct.unpack_from(">L", data, _cmap_entry(data) + 8)[0]
    return offset + struct.unpack_from(">L", data, offset + 8)[0]


@pytest.mark.parametrize("damage", ["format 12: 2^32 - 1 groups", "format 12: groups claiming the block over and over",
                                    "format 4: 32767 segments", "format 13"])
def test_a_font_whose_character_map_lies_is_skipped_with_a_warning(tmp_path: Path, damage: str):
    """``shardfc data glyphs --fonts DIR`` reads each face's character map itself (the raw ranges):
    a map that claims more than the file holds, ranges that overlap (a million groups each claiming
    the whole CJK block would never finish), or a format it does not read is a warning naming the
    file and the face is skipped — fast, under the alarm; the well-formed font beside it still counts."""
    from shardfc.data.glyphs import read_faces

    fonts = tmp_path / "fonts"
    fonts.mkdir()
    fmt = 4 if "format 4" in damage else 12
    _tiny_cjk_font(fonts / "good.ttf", fmt)
    data = bytearray((fonts / "good.ttf").read_bytes())
    at = _cmap_subtable_at(bytes(data))
    if damage.startswith("format 12: 2^32"):
        struct.pack_into(">L", data, at + 12, 0xFFFFFFFF)
    elif damage.startswith("format 12: groups"):
        n = 100_000
        groups = struct.pack(">LLL", 0x4E00, 0x9FFF, 1) * n
        data = data[: at + 12] + struct.pack(">L", n) + groups  # the map runs to the end of the file
        entry = _cmap_entry(bytes(data))
        struct.pack_into(">L", data, entry + 12, len(data) - struct.unpack_from(">L", data, entry + 8)[0])
    elif damage.startswith("format 4"):
        struct.pack_into(">H", data, at + 6, 0xFFFE)
    else:
        struct.pack_into(">H", data, at, 13)
    (fonts / "liar.ttf").write_bytes(bytes(data))
    assert len(read_faces([str(fonts / "good.ttf")])) == 1
    warned: list = []
    start = time.monotonic()
    faces = read_faces(font_files([str(fonts)]), warn=warned.append)
    assert time.monotonic() - start < SECONDS
    assert [f.path for f, _ in faces] == [str(fonts / "good.ttf")]
    assert len(warned) == 1 and "liar.ttf" in warned[0], warned
    if "over and over" in damage:  # the map is whole: its ranges are what is refused
        assert "overlapping or unsorted ranges" in warned[0], warned


def test_a_glyph_larger_than_its_canvas_is_not_rasterised(tmp_path: Path):
    """A face whose outline claims 500 em (8,000 units at 16 per em): its raster (about 25,000 pixels
    wide at 32x32, ten million in all) would be allocated and drawn whole before the crop; it is not
    drawn at all, and counts as no drawing (issue 43)."""
    from shardfc.data.glyphs import read_faces

    path = tmp_path / "wide.ttf"
    _tiny_cjk_font(path, 4, units_per_em=16, extent=8_000)
    [(face, covered)] = read_faces([str(path)])
    warned: list = []
    drawn = glyphs_module._draw_all([face], ["\u4e00"], [covered], 32, warn=warned.append)
    assert drawn.by_char["\u4e00"] == [] and drawn.drawn == {} and warned == []


def test_a_face_freetype_cannot_open_is_skipped_with_a_warning(tmp_path: Path):
    """One bad font among many: a face read before and unreadable when drawn (replaced by a FIFO,
    cut, or a table FreeType refuses) is skipped with a warning naming it, once; the rest draw."""
    from shardfc.data.glyphs import read_faces

    good, bad = tmp_path / "good.ttf", tmp_path / "bad.ttf"
    _tiny_cjk_font(good, 4)
    _tiny_cjk_font(bad, 4)
    read = read_faces([str(good), str(bad)])
    bad.unlink()
    os.mkfifo(bad)
    warned: list = []
    failed: set = set()
    for _ in range(2):  # a second batch does not try (or warn about) the failed face again
        drawn = glyphs_module._draw_all([f for f, _ in read], ["\u4e00"], [c for _, c in read], 32,
                                        warn=warned.append, failed=failed)
    assert [fi for fi, _ in drawn.by_char["\u4e00"]] == [0] and failed == {1}
    assert len(warned) == 1 and "bad.ttf" in warned[0] and "FIFO" in warned[0], warned
