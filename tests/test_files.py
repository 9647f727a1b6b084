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

from read_spy import ReadSpy
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
    ("train/run_lock.py", "_lock", "os.open"):
        "the run folder's lock file, opened read-write to flock it (created if missing; O_NOFOLLOW and "
        "O_NONBLOCK, then a regular file checked by fstat); only the holder's line is read, 300 bytes at most",
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


def _not_a_file(path: Path, kind: str, special_file) -> None:
    """``path`` made a FIFO, a link to ``/dev/zero``, a folder or a socket."""
    if special_file(path, kind):
        return
    if kind == "folder":
        path.mkdir()
    else:
        import socket

        socket.socket(socket.AF_UNIX).bind(str(path))


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "folder", "socket"])
def test_only_a_regular_file_is_read(tmp_path: Path, special_file, kind: str):
    path = tmp_path / "thing.toml"
    _not_a_file(path, kind, special_file)
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


# ------------------------------------------------- each entry point, its words and its arguments
#
# The rules above hold for whichever function a reader calls; these check that each of them names
# the file as its caller asked (``what``, or "<kind> file"), and passes on ``root``,
# ``follow_symlinks`` and ``max_depth`` rather than the defaults.


def _bytes(path, **kw):
    return files.read_bytes(path, "config", **kw)


def _open(path, **kw):
    with files.open_file(path, "config", **kw) as f:
        return f.read()


def _text(path, **kw):
    return files.read_text(path, "config", **kw).encode()


def _lines(path, **kw):
    return "\n".join(line for _, line in files.iter_lines(path, "config", **kw)).encode()


def _json(path, **kw):
    return json.dumps(files.load_json(path, "config", **kw)).encode()


READERS = {"open_file": _open, "read_bytes": _bytes, "read_text": _text, "iter_lines": _lines, "load_json": _json}


@pytest.mark.parametrize("read", READERS.values(), ids=READERS.keys())
@pytest.mark.parametrize("what, said", [(None, "config file"), ("preset", "preset")])
def test_each_reader_names_the_file_as_asked(tmp_path: Path, monkeypatch, read, what, said):
    kw = {} if what is None else {"what": what}
    with pytest.raises(files.FileMissing) as info:
        read(tmp_path / "gone.json", **kw)
    assert str(info.value) == f"{said} {tmp_path / 'gone.json'} is missing"
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(files.FileRefused) as info:
        read(tmp_path / "dir.json", **kw)
    assert str(info.value) == f"refusing to read {said} {tmp_path / 'dir.json'}: it is a folder, not a regular file"
    big = tmp_path / "big.json"
    big.write_bytes(b"[1, 2, 3]  ")
    monkeypatch.setenv("SHARDFC_MAX_CONFIG_BYTES", "10")
    with pytest.raises(files.FileRefused) as info:
        read(big, **kw)
    assert str(info.value) == (f"{said} {big} is 11 bytes, more than the 10 bytes a config file may have "
                               "(raise it with SHARDFC_MAX_CONFIG_BYTES)")
    monkeypatch.delenv("SHARDFC_MAX_CONFIG_BYTES")
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(big, root / "out.json")
    with pytest.raises(files.FileRefused) as info:
        read(root / "out.json", root=root, **kw)
    assert str(info.value) == (f"refusing to read {said} {root / 'out.json'}: it resolves to {big}, "
                               f"outside {root}")


@pytest.mark.parametrize("read", [r for n, r in READERS.items() if n != "open_file"],
                         ids=[n for n in READERS if n != "open_file"])
def test_each_reader_that_decodes_names_the_file_and_where_it_is_not_utf8(tmp_path: Path, read):
    path = tmp_path / "latin1.json"
    path.write_bytes(b'["caf\xe9"]\n')
    if read is _bytes:
        assert read(path) == b'["caf\xe9"]\n'
        return
    with pytest.raises(files.FileRefused) as info:
        read(path, what="preset")
    where = "line 1" if read is _lines else "byte 5"
    assert str(info.value) == f"preset {path} is not utf-8 text ({where}: invalid continuation byte)"


@pytest.mark.parametrize("read", READERS.values(), ids=READERS.keys())
def test_each_reader_follows_a_link_by_default_and_passes_on_follow_symlinks_and_root(tmp_path: Path, read):
    root = tmp_path / "root"
    root.mkdir()
    (root / "real.json").write_text("[1]")
    os.symlink("real.json", root / "link.json")
    assert read(root / "link.json") == b"[1]"  # a file the user named may be a link he chose
    assert read(root / "link.json", root=root) == b"[1]"  # ... and one found inside a folder, within it
    with pytest.raises(files.FileRefused) as info:
        read(root / "link.json", follow_symlinks=False)
    assert str(info.value) == (f"refusing to read config file {root / 'link.json'}: it is a symlink, "
                               "not a regular file")


def test_the_gates_own_functions_follow_a_link_by_default_and_say_file(tmp_path: Path):
    (tmp_path / "real").write_text("x")
    os.symlink("real", tmp_path / "link")
    assert files.regular_file(tmp_path / "link").st_size == 1
    with pytest.raises(files.FileRefused) as info:
        files.regular_file(tmp_path)
    assert str(info.value) == f"refusing to read file {tmp_path}: it is a folder, not a regular file"
    with pytest.raises(files.FileRefused) as info:
        files.inside(tmp_path / "link", tmp_path / "elsewhere")
    assert str(info.value).startswith(f"refusing to read file {tmp_path / 'link'}: it resolves to")
    assert files.inside(tmp_path / "link", tmp_path) == str((tmp_path / "real").resolve())


@pytest.mark.parametrize("kind, said", [("folder", "a folder"), ("socket", "a socket"), ("dev_zero", "a device"),
                                        ("fifo", "a FIFO")])
def test_what_is_not_a_regular_file_is_named(tmp_path: Path, special_file, kind, said):
    path = tmp_path / "thing"
    _not_a_file(path, kind, special_file)
    with pytest.raises(files.FileRefused) as info:
        files.read_bytes(path, "config")
    assert str(info.value) == f"refusing to read config file {path}: it is {said}, not a regular file"


def test_a_path_that_cannot_be_stat_ed_or_opened_says_why(tmp_path: Path, monkeypatch):
    (tmp_path / "plain").write_text("x")
    with pytest.raises(files.FileRefused) as info:
        files.read_bytes(tmp_path / "plain" / "below", "config")
    assert str(info.value) == f"cannot stat config file {tmp_path / 'plain' / 'below'}: Not a directory"
    os.symlink("loop", tmp_path / "loop")
    with pytest.raises(files.FileRefused) as info:
        files.read_bytes(tmp_path / "loop", "config", "preset")
    assert str(info.value) == f"cannot stat preset {tmp_path / 'loop'}: Too many levels of symbolic links"

    # Gone, or swapped for a link, between the check and the open.
    check = files.regular_file

    def check_then(change):
        def run(p, *args, **kwargs):
            st = check(p, *args, **kwargs)
            change(Path(p))
            return st
        return run

    path = tmp_path / "c.json"
    path.write_text("{}")
    monkeypatch.setattr(files, "regular_file", check_then(Path.unlink))
    with pytest.raises(files.FileMissing) as info:
        files.read_bytes(path, "config", "preset")
    assert str(info.value) == f"preset {path} is missing"
    path.write_text("{}")
    monkeypatch.setattr(files, "regular_file", check_then(lambda p: (p.unlink(), os.symlink("real", p))))
    with pytest.raises(files.FileRefused) as info:
        files.read_bytes(path, "config", "preset", follow_symlinks=False)
    assert str(info.value) == f"cannot open preset {path}: Too many levels of symbolic links"


@pytest.mark.parametrize("setting, cap, said", [("1G", 1 << 30, "1 GiB"), ("3M", 3 << 20, "3 MiB"),
                                                ("2K", 2048, "2 KiB"), ("1536", 1536, "1536 bytes"),
                                                ("1025K", 1025 << 10, "1025 KiB"), ("0", 0, "0 bytes")])
def test_a_cap_is_read_up_to_its_last_byte_and_said_in_its_largest_whole_unit(tmp_path: Path, monkeypatch,
                                                                              setting, cap, said):
    monkeypatch.setenv("SHARDFC_MAX_NAMES_BYTES", setting)
    assert files.cap_bytes("names") == cap
    path = tmp_path / "names.txt"
    with path.open("wb") as f:
        f.truncate(cap)  # sparse: 1 GiB costs no disk
    if cap <= 3 << 20:
        assert len(files.read_bytes(path, "names")) == cap
    else:
        assert files.open_file(path, "names").close() is None
    with path.open("ab") as f:
        f.write(b"x")
    with pytest.raises(files.FileRefused) as info:
        files.open_file(path, "names")
    assert str(info.value) == (f"names file {path} is {cap + 1} bytes, more than the {said} a names file may "
                               "have (raise it with SHARDFC_MAX_NAMES_BYTES)")


@pytest.mark.parametrize("kind", [k for k, cap in files.CAPS.items() if cap is None])
def test_a_kind_without_a_cap_gets_one_only_from_its_variable(tmp_path: Path, monkeypatch, kind):
    name = f"SHARDFC_MAX_{kind.upper()}_BYTES"
    monkeypatch.delenv(name, raising=False)
    assert files.cap_bytes(kind) is None
    monkeypatch.setenv(name, "  ")  # blank is unset, never a cap of 0 bytes
    assert files.cap_bytes(kind) is None
    path = tmp_path / "f"
    path.write_bytes(b"12345")
    assert files.read_bytes(path, kind) == b"12345"
    monkeypatch.setenv(name, "4")
    assert files.cap_bytes(kind) == 4
    with pytest.raises(files.FileRefused, match=f"is 5 bytes, more than the 4 bytes a {kind} file may have"):
        files.read_bytes(path, kind)
    monkeypatch.setenv(name, "four")
    with pytest.raises(files.FileRefused, match=f"{name}='four' is not a size"):
        files.cap_bytes(kind)


def test_an_unknown_kind_is_a_key_error_listing_the_known_ones():
    with pytest.raises(KeyError) as info:
        files.cap_bytes("tape")
    assert info.value.args == (f"unknown kind of file 'tape'; known: {', '.join(files.CAPS)}",)
    assert ", config, cache, names," in ", " + info.value.args[0].split("known: ")[1]


def _spied(monkeypatch, reported_size=None):
    """Every file the gate opens spied on; with ``reported_size``, ``fstat`` says the file has that
    many bytes (a file that grows once checked)."""
    asked = []
    fdopen, fstat = os.fdopen, os.fstat
    monkeypatch.setattr(files.os, "fdopen", lambda *a, **k: ReadSpy(fdopen(*a, **k), lambda op, n: asked.append((op, n))))
    if reported_size is not None:
        def small(fd):
            fields = list(fstat(fd))
            fields[stat.ST_SIZE] = reported_size
            return os.stat_result(fields)
        monkeypatch.setattr(files.os, "fstat", small)
    return asked


MiB = 1 << 20


@pytest.mark.parametrize("size, reads", [(0, [1]), (5, [6, MiB])])
def test_a_file_is_read_in_one_read_of_its_size(tmp_path: Path, monkeypatch, size, reads):
    path = tmp_path / "c.toml"
    path.write_bytes(b"x" * size)
    asked = _spied(monkeypatch)
    assert files.read_bytes(path, "config") == b"x" * size
    assert asked == [("read", n) for n in reads]  # the second read only sees that the end is reached


def test_a_file_that_grows_after_its_check_is_read_a_mib_at_a_time_up_to_its_cap(tmp_path: Path, monkeypatch):
    path = tmp_path / "grown.toml"
    data = os.urandom(3 * MiB + 5)
    path.write_bytes(data)
    monkeypatch.setenv("SHARDFC_MAX_CONFIG_BYTES", "4M")  # the whole file is under the cap: read whole
    asked = _spied(monkeypatch, reported_size=10)
    assert files.read_bytes(path, "config") == data
    assert asked == [("read", 11)] + [("read", MiB)] * 4
    # Over the cap: one MiB past it at most, never the whole file, and refused.
    monkeypatch.setenv("SHARDFC_MAX_CONFIG_BYTES", str(MiB + 11))  # reached exactly after two reads
    asked.clear()
    with pytest.raises(files.FileRefused) as info:
        files.read_bytes(path, "config", "preset")
    assert str(info.value) == (f"preset {path} is {2 * MiB + 11} bytes, more than the {MiB + 11} bytes a config "
                               "file may have (raise it with SHARDFC_MAX_CONFIG_BYTES)")
    assert asked == [("read", 11), ("read", MiB), ("read", MiB)]


def test_lines_are_read_at_most_one_cap_at_a_time_and_keep_all_but_their_end(tmp_path: Path, monkeypatch):
    path = tmp_path / "list.txt"
    path.write_bytes(b"a 0 \r\nb\t1\nX\n1234567\n12345678\n")
    asked = _spied(monkeypatch)
    lines = files.iter_lines(path, "list", max_line=8)
    assert [next(lines) for _ in range(4)] == [(1, "a 0 "), (2, "b\t1"), (3, "X"), (4, "1234567")]
    with pytest.raises(files.FileRefused) as info:  # 9 bytes with its end
        next(lines)
    assert str(info.value) == f"list file {path}: line 5 is longer than 8 bytes"
    assert set(asked) == {("readline", 9)}


def test_toml_names_the_file_as_asked(tmp_path: Path, monkeypatch):
    with pytest.raises(files.FileMissing) as info:
        files.load_toml(tmp_path / "gone.toml")
    assert str(info.value) == f"config file {tmp_path / 'gone.toml'} is missing"
    (tmp_path / "big.toml").write_text("a = 12345")
    monkeypatch.setenv("SHARDFC_MAX_CONFIG_BYTES", "5")
    with pytest.raises(files.FileRefused) as info:
        files.load_toml(tmp_path / "big.toml", what="preset")
    assert str(info.value).startswith(f"preset {tmp_path / 'big.toml'} is 9 bytes, more than the 5 bytes")


def test_max_depth_is_passed_on(tmp_path: Path):
    (tmp_path / "c.json").write_text('{"a": [1]}')
    (tmp_path / "c.toml").write_text("a = [1]")
    assert files.load_json(tmp_path / "c.json", "cache", max_depth=2) == {"a": [1]}
    assert files.load_toml(tmp_path / "c.toml", max_depth=2) == {"a": [1]}
    with pytest.raises(files.FileRefused) as info:
        files.load_json(tmp_path / "c.json", "cache", max_depth=1)
    assert str(info.value) == f"cache file {tmp_path / 'c.json'} is nested more than 1 deep"
    with pytest.raises(files.FileRefused) as info:
        files.load_toml(tmp_path / "c.toml", what="preset", max_depth=1)
    assert str(info.value) == f"preset {tmp_path / 'c.toml'} is nested more than 1 deep"
    with pytest.raises(files.FileRefused, match="^x is nested more than 1 deep$"):
        files.parse_json('{"a": [1]}', "x", max_depth=1)


def test_a_syntax_error_says_what_the_parser_said(tmp_path: Path):
    with pytest.raises(files.FileRefused) as info:
        files.parse_json("[1,", "the cache")
    assert str(info.value) == "the cache is not JSON: Expecting value: line 1 column 4 (char 3)"
    path = tmp_path / "c.toml"
    path.write_text("a = 1\nb = \n")
    with pytest.raises(files.FileRefused) as info:
        files.load_toml(path)
    assert str(info.value) == f"config file {path} is not valid TOML: Invalid value (at line 2, column 5)"


def test_toml_without_tomllib_or_tomli_says_what_to_install(tmp_path: Path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "tomllib", None)  # an import of either now fails
    monkeypatch.setitem(sys.modules, "tomli", None)
    with pytest.raises(files.FileRefused) as info:
        files.load_toml(tmp_path / "c.toml")
    assert str(info.value) == (f"reading {tmp_path / 'c.toml'} needs Python >= 3.11 or the 'tomli' package "
                               "(pip install tomli)")
