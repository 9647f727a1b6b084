"""``shardfc.outputs``: the files ``export`` and ``embed`` write, refused by flag before the work
and written whole or not at all (``tests/train/checkpointing/test_export_command.py`` and
``test_embed_command.py`` run them through the commands)."""

from __future__ import annotations

import os

import pytest

from shardfc.outputs import OutputRefused, blocking_file, check_folder, check_output, check_outputs, write_atomically


def test_check_output_makes_the_missing_folders(tmp_path):
    check_output("--out", tmp_path / "a" / "b" / "m.pt", force=False)
    assert (tmp_path / "a" / "b").is_dir() and not (tmp_path / "a" / "b" / "m.pt").exists()


def test_check_output_keeps_an_existing_file_unless_forced(tmp_path):
    (tmp_path / "m.pt").write_bytes(b"keep")
    with pytest.raises(FileExistsError) as err:
        check_output("--out", tmp_path / "m.pt", force=False)
    assert str(err.value) == f"{tmp_path / 'm.pt'} exists; pass --force to replace it"
    check_output("--out", tmp_path / "m.pt", force=True)
    assert (tmp_path / "m.pt").read_bytes() == b"keep"  # checked, not touched


@pytest.mark.parametrize("force", [False, True])
def test_check_output_refuses_a_folder_even_when_forced(tmp_path, force):
    (tmp_path / "m.pt").mkdir()
    with pytest.raises(OutputRefused) as err:
        check_output("--fc", tmp_path / "m.pt", force=force)
    assert str(err.value) == f"--fc {str(tmp_path / 'm.pt')!r} is a folder; name the file to write"


def test_check_output_names_the_file_standing_where_a_folder_must_be(tmp_path):
    (tmp_path / "f").write_bytes(b"keep")
    with pytest.raises(OutputRefused) as err:
        check_output("--onnx", tmp_path / "f" / "g" / "m.onnx", force=True)
    assert str(err.value) == f"--onnx {str(tmp_path / 'f' / 'g' / 'm.onnx')!r}: {str(tmp_path / 'f')!r} is a file, not a folder"
    assert (tmp_path / "f").read_bytes() == b"keep"


def test_check_output_says_why_a_folder_cannot_be_made(tmp_path, monkeypatch):
    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(type(tmp_path), "mkdir", refuse)
    with pytest.raises(OutputRefused) as err:
        check_output("--out", tmp_path / "new" / "m.pt", force=False)
    assert str(err.value) == f"--out {str(tmp_path / 'new' / 'm.pt')!r}: cannot make its folder (Permission denied)"


def test_write_atomically_writes_through_a_scratch_file_that_is_gone_after(tmp_path):
    seen = []

    def write(scratch):
        seen.append((scratch.name, sorted(os.listdir(tmp_path))))
        scratch.write_bytes(b"new")

    (tmp_path / "m.pt").write_bytes(b"old")
    write_atomically(tmp_path / "m.pt", write)
    scratch = f".m.pt.tmp-{os.getpid()}"
    assert seen == [(scratch, sorted([scratch, "m.pt"]))]  # the old file stays until the new one is whole
    assert os.listdir(tmp_path) == ["m.pt"] and (tmp_path / "m.pt").read_bytes() == b"new"


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), RuntimeError("the writer broke")])
def test_a_failed_write_keeps_the_old_file_and_removes_the_scratch_file(tmp_path, error):
    def write(scratch):
        scratch.write_bytes(b"half")
        raise error

    (tmp_path / "m.pt").write_bytes(b"old")
    with pytest.raises(type(error)) as err:
        write_atomically(tmp_path / "m.pt", write)
    said = f"cannot write {tmp_path / 'm.pt'}: No space left on device" if isinstance(error, OSError) else "the writer broke"
    assert str(err.value) == said
    assert os.listdir(tmp_path) == ["m.pt"] and (tmp_path / "m.pt").read_bytes() == b"old"


def test_a_link_planted_under_the_scratch_name_is_neither_followed_nor_removed(tmp_path):
    target = tmp_path / "victim"
    target.write_bytes(b"keep")
    (tmp_path / f".m.pt.tmp-{os.getpid()}").symlink_to(target)
    written = []
    with pytest.raises(OSError) as err:
        write_atomically(tmp_path / "m.pt", lambda scratch: written.append(scratch))
    assert str(err.value) == f"cannot write {tmp_path / 'm.pt'}: File exists"
    assert written == [] and target.read_bytes() == b"keep"
    assert (tmp_path / f".m.pt.tmp-{os.getpid()}").is_symlink() and not (tmp_path / "m.pt").exists()


def test_the_written_file_has_the_mode_a_new_file_gets(tmp_path):
    """0o666 less the umask, as ``open(path, "w")`` makes it: an output is never executable."""
    umask = os.umask(0o022)
    os.umask(umask)
    write_atomically(tmp_path / "m.pt", lambda scratch: scratch.write_bytes(b"x"))
    assert (tmp_path / "m.pt").stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_writer_that_fails_after_removing_the_scratch_file_keeps_its_own_error(tmp_path):
    def write(scratch):
        scratch.unlink()
        raise RuntimeError("the writer broke")

    with pytest.raises(RuntimeError, match="^the writer broke$"):
        write_atomically(tmp_path / "m.pt", write)
    assert os.listdir(tmp_path) == []


def _never(*args, **kwargs):
    raise AssertionError("the work ran before its output path was checked")


_BENCH = ["--world-size", "1", "--batch", "8", "--dim", "4", "--classes", "10"]
_PEERS = ["--peers", "--batch", "8", "--dim", "4", "--classes", "10"]
_PLAN = ["--classes", "10", "--dim", "4", "--batch", "8"]


@pytest.mark.parametrize("command, argv, runner, flag", [
    ("bench", _BENCH, ("shardfc.cli.bench", "run_bench"), "--json"),
    ("bench", _BENCH, ("shardfc.cli.bench", "run_bench"), "--plot"),
    ("bench --peers", _PEERS, ("shardfc.cli.bench_peers", "run_peers"), "--json"),
    ("bench --peers", _PEERS, ("shardfc.cli.bench_peers", "run_peers"), "--plot"),
    ("bench", ["--recipes", "--split-sweep"], ("shardfc.cli.bench_recipes", "run_recipes"), "--json"),
    ("bench", ["--recipes", "--split-sweep"], ("shardfc.cli.bench_recipes", "run_recipes"), "--plot"),
    ("bench", ["--recipes", "--split-sweep"], ("shardfc.cli.bench_recipes", "run_recipes"), "--split-plot"),
    ("bench --trainer", ["--trainer"], ("shardfc.tools.bench.trainer", "bench_trainer"), "--json"),
    ("plan", _PLAN, ("shardfc.cli.plan", "plan"), "--json"),
])
def test_every_benchmark_checks_the_files_it_will_write_before_it_runs(tmp_path, monkeypatch, capsys, command, argv,
                                                                      runner, flag):
    """A folder named as --json (or a file where its folder must be) ended the run in a traceback at the end."""
    import importlib

    from shardfc.cli import main

    monkeypatch.setattr(importlib.import_module(runner[0]), runner[1], _never)
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("keep")
    for path, said in ((tmp_path / "dir", f"{str(tmp_path / 'dir')!r} is a folder; name the file to write"),
                       (tmp_path / "file" / "x", f"{str(tmp_path / 'file' / 'x')!r}: {str(tmp_path / 'file')!r} is a "
                                                  "file, not a folder")):
        assert main([command.split()[0], *argv, flag, str(path)]) == 2
        assert capsys.readouterr().err.endswith(f"shardfc {command}: error: {flag} {said}\n")
    assert (tmp_path / "file").read_text() == "keep" and os.listdir(tmp_path / "dir") == []


def test_a_benchmarks_existing_json_is_replaced_not_refused(tmp_path):
    """--json / --plot have no --force: a benchmark rerun writes over its last figures."""
    (tmp_path / "bench.json").write_text("[]")
    check_outputs(json=str(tmp_path / "bench.json"), plot=None, split_plot=str(tmp_path / "new" / "s.png"))
    assert (tmp_path / "new").is_dir() and (tmp_path / "bench.json").read_text() == "[]"
    with pytest.raises(OutputRefused) as err:
        check_outputs(split_plot=str(tmp_path))
    assert str(err.value) == f"--split-plot {str(tmp_path)!r} is a folder; name the file to write"


def test_blocking_file_is_the_file_at_or_above_a_folder(tmp_path):
    (tmp_path / "f").write_text("x")
    (tmp_path / "d").mkdir()
    assert blocking_file(tmp_path / "f") == tmp_path / "f"
    assert blocking_file(tmp_path / "f" / "a" / "b") == tmp_path / "f"
    for free in (tmp_path, tmp_path / "d", tmp_path / "d" / "new" / "deeper", tmp_path / "new"):
        assert blocking_file(free) is None


def test_check_folder_names_the_flag_and_the_file_in_the_way(tmp_path):
    (tmp_path / "f").write_text("keep")
    check_folder("--ijb-out", tmp_path / "new" / "report")  # a folder to be made: no obstacle, nothing made
    assert not (tmp_path / "new").exists()
    with pytest.raises(OutputRefused) as err:
        check_folder("--ijb-out", tmp_path / "f" / "report")
    assert str(err.value) == f"--ijb-out {str(tmp_path / 'f' / 'report')!r}: {str(tmp_path / 'f')!r} is a file, not a folder"
    assert (tmp_path / "f").read_text() == "keep"
