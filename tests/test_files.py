"""The file gate (:mod:`shardfc.files`, issue 43): its rules, and that every read of a file in
``src/`` goes through it.

The source walk reads every module with :mod:`ast` and lists each call that reads a file by name:
``open(``, ``os.open``, ``os.fdopen``, ``Path.open`` / ``Image.open`` / any ``.open(``,
``read_bytes``, ``read_text``, ``json.load``, ``pickle.load``, ``tomllib.load``, ``torch.load``,
``np.load`` / ``np.fromfile`` / ``np.loadtxt`` / ``np.memmap``, ``mmap.mmap``, ``shutil.copy*``,
fontTools' ``TTFont`` / ``TTCollection`` and Pillow's ``ImageFont.truetype``. Writes are not reads:
an ``open`` / ``fdopen`` whose mode is a literal holding ``w``, ``a`` or ``x`` and no ``+``, or an
``os.open`` whose flags name ``O_WRONLY`` / ``O_CREAT`` / ``O_EXCL``, is a write; a mode that is not
a literal counts as a read. A call reading an in-memory buffer it builds in place
(``torch.load(io.BytesIO(...))``) reads no file. Everything else outside ``files.py`` must be in
:data:`ALLOWED`, with the reason it is not a user's file or already went through the gate.
"""

from __future__ import annotations

import ast
import json
import os
import stat
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from shardfc import files

SRC = Path(__file__).resolve().parents[1] / "src"

#: (module path under src/shardfc, enclosing function, the call as written) -> why it may read
#: without the gate. Keep it short: a new reader of a user's file goes through shardfc.files.
ALLOWED: Dict[Tuple[str, str, str], str] = {
    ("data/transforms.py", "decode_image", "Image.open"):
        "opens an io.BytesIO of bytes the gate read (a path) or the caller holds (a record, a .bin entry)",
    ("checkpoint/weights_only.py", "_torch_load", "torch.load"):
        "torch.load of a checkpoint file: from the gate's open file, or by name for mmap=True after "
        "regular_file() (torch maps by name only); both under the checkpoint readers' rules",
    ("checkpoint/durable.py", "fsync_dir", "os.open"):
        "opens a folder shardfc itself wrote, only to fsync it; reads nothing",
    ("train/builder/cpu.py", "_cpuinfo_flags", "open"):
        "/proc/cpuinfo: the kernel's, not a user's file",
    ("tools/bench/recipes.py", "_why_failed", "read_text"):
        "the log of a `shardfc train` subprocess the bench started, in a folder it created this run",
    ("tools/bench/recipes.py", "measure", "read_text"):
        "the --profile files of a `shardfc train` subprocess the bench started, in a folder it created",
}

_LOADERS = {"json", "pickle", "tomllib", "tomli", "torch", "np", "numpy", "marshal", "yaml"}
_NUMPY_FILE = {"fromfile", "loadtxt", "genfromtxt", "memmap", "load"}
_WRITE_FLAGS = {"O_WRONLY", "O_CREAT", "O_EXCL", "O_TRUNC", "O_APPEND"}


def _mode_writes(call: ast.Call, position: int) -> bool:
    mode = call.args[position] if len(call.args) > position else next(
        (k.value for k in call.keywords if k.arg == "mode"), ast.Constant("r"))
    return isinstance(mode, ast.Constant) and isinstance(mode.value, str) and \
        any(c in mode.value for c in "wax") and "+" not in mode.value


def _in_memory(call: ast.Call) -> bool:
    first = call.args[0] if call.args else None
    return isinstance(first, ast.Call) and (
        (isinstance(first.func, ast.Attribute) and first.func.attr == "BytesIO")
        or (isinstance(first.func, ast.Name) and first.func.id == "BytesIO"))


def _read_call(call: ast.Call) -> str:
    """The name of the read ``call`` makes (``""``: not a read of a file by name)."""
    f = call.func
    if isinstance(f, ast.Name):
        if f.id == "open":
            return "" if _mode_writes(call, 1) else "open"
        if f.id in ("TTFont", "TTCollection"):
            return "" if _in_memory(call) else f.id
        return ""
    if not isinstance(f, ast.Attribute):
        return ""
    owner = f.value.id if isinstance(f.value, ast.Name) else (f.value.attr if isinstance(f.value, ast.Attribute) else "")
    name = f"{owner}.{f.attr}" if owner else f.attr
    if owner == "files":  # the gate itself: shardfc.files.read_bytes / read_text / open_file ...
        return ""
    if f.attr == "open" and owner == "os":
        flags = call.args[1] if len(call.args) > 1 else None
        named = {n.attr if isinstance(n, ast.Attribute) else n.id for n in ast.walk(flags)
                 if isinstance(n, (ast.Attribute, ast.Name))} if flags is not None else set()
        return "" if named & _WRITE_FLAGS else name
    if f.attr == "open":
        return "" if _mode_writes(call, 0) or _in_memory(call) else name
    if f.attr == "fdopen":
        return "" if _mode_writes(call, 1) else name
    if f.attr in ("read_bytes", "read_text"):
        return f.attr
    if f.attr == "load" and owner in _LOADERS:
        return "" if _in_memory(call) else name
    if f.attr in _NUMPY_FILE and owner in ("np", "numpy"):
        return name
    if f.attr == "mmap" and owner == "mmap":
        return name
    if f.attr == "truetype":
        return "" if _in_memory(call) else name
    if owner == "shutil" and f.attr.startswith("copy"):
        return name
    if f.attr in ("TTFont", "TTCollection"):
        return "" if _in_memory(call) else name
    return ""


def gate_bypasses(root: Path = SRC / "shardfc") -> List[Tuple[str, str, str, int]]:
    """``(module, function, call, line)`` of every read of a file by name outside ``files.py``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == "files.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))

        def visit(node: ast.AST, function: str) -> None:
            for child in ast.iter_child_nodes(node):
                inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
                if isinstance(child, ast.Call):
                    name = _read_call(child)
                    if name:
                        found.append((rel, function, name, child.lineno))
                visit(child, inner)

        visit(tree, "<module>")
    return found


def test_every_read_of_a_file_goes_through_the_gate():
    bad = [f"src/shardfc/{m}:{line} in {fn}(): {call}(" for m, fn, call, line in gate_bypasses()
           if (m, fn, call) not in ALLOWED]
    assert not bad, ("reads of a file outside shardfc.files (use files.open_file / read_bytes / read_text / "
                     "iter_lines / load_json / load_toml, or add an ALLOWED entry saying why):\n" + "\n".join(bad))


def test_the_allow_list_has_no_stale_entry():
    seen = {(m, fn, call) for m, fn, call, _ in gate_bypasses()}
    assert not set(ALLOWED) - seen, f"ALLOWED entries that match no call any more: {sorted(set(ALLOWED) - seen)}"


def test_the_walker_sees_reads_and_tells_writes_apart(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "import json, os, io, shutil, torch\nfrom pathlib import Path\nfrom PIL import Image\n"
        "def reads(p, mode):\n"
        "    open(p); open(p, 'rb'); open(p, 'r+'); open(p, mode); Path(p).read_text(); json.load(p)\n"
        "    Image.open(p); os.open(p, os.O_RDONLY); torch.load(p); shutil.copyfile(p, 'x')\n"
        "def writes(p, b):\n"
        "    open(p, 'w'); open(p, mode='xb'); os.open(p, os.O_WRONLY | os.O_CREAT); os.fdopen(3, 'w')\n"
        "    torch.load(io.BytesIO(b)); json.loads(b)\n")
    found = [(fn, call) for _, fn, call, _ in gate_bypasses(pkg)]
    assert found == [("reads", c) for c in ("open", "open", "open", "open", "read_text", "json.load", "Image.open",
                                            "os.open", "torch.load", "shutil.copyfile")]


# --------------------------------------------------------------------------- the gate's rules


pytestmark = pytest.mark.usefixtures("no_hang")  # tests/conftest.py: an alarm behind every case


def _one_line(error: BaseException, *needles: str) -> str:
    text = str(error)
    assert "\n" not in text and all(n in text for n in needles), text
    return text


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "folder", "socket"])
def test_only_a_regular_file_is_read(tmp_path: Path, special_file, kind: str):
    path = tmp_path / "thing.toml"
    if special_file(path, kind):
        pass
    elif kind == "folder":
        path.mkdir()
    else:
        import socket

        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
    for read in (lambda: files.read_bytes(path, "config"), lambda: files.load_toml(path),
                 lambda: files.load_json(path, "cache"), lambda: list(files.iter_lines(path, "list"))):
        with pytest.raises(files.FileRefused) as info:
            read()
        _one_line(info.value, str(path), "not a regular file")


def test_a_missing_file_is_also_a_file_not_found_error(tmp_path: Path):
    with pytest.raises(FileNotFoundError) as info:
        files.read_bytes(tmp_path / "nope", "config", "config file")
    assert isinstance(info.value, files.FileRefused) and "config file" in str(info.value)


def test_a_symlink_is_followed_only_where_the_user_named_it(tmp_path: Path):
    (tmp_path / "real").write_text("x")
    os.symlink("real", tmp_path / "link")
    assert files.read_bytes(tmp_path / "link", "config") == b"x"
    with pytest.raises(files.FileRefused, match="it is a symlink"):
        files.read_bytes(tmp_path / "link", "config", follow_symlinks=False)


@pytest.mark.parametrize("name", ["../outside.png", "link_out.png", "sub/link_dir/outside.png"])
def test_a_file_found_in_a_folder_stays_inside_it(tmp_path: Path, name: str):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (tmp_path / "outside.png").write_bytes(b"secret")
    os.symlink(tmp_path / "outside.png", root / "link_out.png")
    os.symlink(tmp_path, root / "sub" / "link_dir")
    (root / "inside.png").write_bytes(b"ok")
    os.symlink("inside.png", root / "link_in.png")
    assert files.read_bytes(root / "link_in.png", "image", root=root) == b"ok"  # a link within the root
    with pytest.raises(files.FileRefused) as info:
        files.read_bytes(root / name, "image", "image file", root=root)
    _one_line(info.value, "outside", str(root.resolve()))


def test_each_kind_has_a_cap_an_env_var_raises(tmp_path: Path, monkeypatch):
    path = tmp_path / "big.toml"
    path.write_bytes(b"# " + b"x" * (1 << 20))
    with pytest.raises(files.FileRefused) as info:
        files.load_toml(path)
    _one_line(info.value, "big.toml", "1 MiB", "SHARDFC_MAX_CONFIG_BYTES")
    monkeypatch.setenv("SHARDFC_MAX_CONFIG_BYTES", "2M")
    assert files.load_toml(path) == {}
    monkeypatch.setenv("SHARDFC_MAX_CONFIG_BYTES", "lots")
    with pytest.raises(files.FileRefused, match="SHARDFC_MAX_CONFIG_BYTES='lots' is not a size"):
        files.load_toml(path)


@pytest.mark.parametrize("text", ["a = " + "[" * 5000 + "]" * 5000, "a = " + "[" * 40 + "]" * 40,
                                  "a = " + "{b = " * 40 + "1" + "}" * 40])
def test_toml_nested_too_deep_is_one_line(tmp_path: Path, text: str):
    path = tmp_path / "deep.toml"
    path.write_text(text)
    with pytest.raises(files.FileRefused) as info:
        files.load_toml(path)
    _one_line(info.value, "deep.toml", "nested more than")


@pytest.mark.parametrize("depth", [40, 100_000])
def test_json_nested_too_deep_is_one_line(tmp_path: Path, depth: int):
    path = tmp_path / "deep.json"
    path.write_text("[" * depth + "]" * depth)
    with pytest.raises(files.FileRefused) as info:
        files.load_json(path, "cache")
    _one_line(info.value, "deep.json", "nested more than")
    assert files.check_depth(json.loads("[" * 32 + "]" * 32), "x") is not None  # 32 deep is allowed


def test_text_that_is_not_utf8_is_one_line_naming_the_byte(tmp_path: Path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(b"name = 'caf\xe9'\n")
    with pytest.raises(files.FileRefused) as info:
        files.load_toml(path)
    _one_line(info.value, "latin1.toml", "not utf-8 text", "byte 11")
    lines = tmp_path / "list.txt"
    lines.write_bytes(b"a.png 0\nb\xff.png 1\n")
    with pytest.raises(files.FileRefused, match="line 2"):
        list(files.iter_lines(lines, "list"))


def test_a_line_longer_than_the_cap_is_refused_without_reading_it_whole(tmp_path: Path):
    path = tmp_path / "list.txt"
    path.write_bytes(b"a.png 0\n" + b"x" * (files.MAX_LINE_BYTES + 10))
    it = files.iter_lines(path, "list")
    assert next(it) == (1, "a.png 0")
    with pytest.raises(files.FileRefused, match="line 2 is longer than 64 KiB"):
        next(it)


def test_a_fifo_swapped_in_after_the_stat_is_refused_after_the_open(tmp_path: Path, monkeypatch):
    """The open does not block (O_NONBLOCK) and the open file is checked again (fstat)."""
    path = tmp_path / "c.json"
    path.write_text("{}")
    real_stat = os.stat

    def swap(p, *a, **k):
        st = real_stat(p, *a, **k)
        if Path(p) == path and stat.S_ISREG(st.st_mode):
            path.unlink()
            os.mkfifo(path)
        return st

    monkeypatch.setattr(files.os, "stat", swap)
    with pytest.raises(files.FileRefused, match="it is a FIFO"):
        files.read_bytes(path, "cache")
