"""The one gate every file a user hands shardfc goes through (issue 43).

A config, a cache, a font, an image, a list file, a RecordIO file, a ``.bin`` set, an IJB meta
file, a renames file, an arcface_torch ``.pth``: each reader in ``src/`` opens it here, and
``tests/test_files.py`` walks the source and fails on a read that bypasses this module. The rules:

* **A regular file only.** It is ``stat``-ed before it is opened (so a tape device is never
  opened), opened with ``O_NONBLOCK`` (a FIFO swapped in since cannot block the open) and
  ``fstat``-ed again: a FIFO, a device (``/dev/zero``), a socket or a folder is refused.
* **Inside the folder given.** A file found *inside* a folder the user named (an image of an image
  folder, a face of an IJB release, a font under ``--fonts``) is resolved, and must stay under that
  folder once resolved: a link out of it, an absolute name or ``..`` is refused. The resolved path
  is opened with ``O_NOFOLLOW``. A file the user names himself may be a link (he chose it);
  ``follow_symlinks=False`` refuses even that (a checkpoint's own files).
* **A size cap per kind** (:data:`CAPS`), checked on the open file before a byte is read, and on
  what is read (a file that grows after the check). ``SHARDFC_MAX_<KIND>_BYTES`` raises a cap
  (``SHARDFC_MAX_FONT_BYTES=1G``).
* **Text is UTF-8** (or what the reader asks for), strictly; lines are capped (:func:`iter_lines`);
  JSON and TOML are nested at most :data:`MAX_DEPTH` deep (a config needs 2, the cache 3).
* **One line naming the file.** Every refusal is a :class:`FileRefused` (a ``ValueError``, which
  every command turns into exit status 2; a missing file is also a ``FileNotFoundError``).

This module is the bottom layer (it imports nothing from shardfc), so ``data``, ``head``,
``checkpoint`` and ``evaluation`` all use it.
"""

from __future__ import annotations

import json
import os
import re
import stat
from typing import Any, BinaryIO, Dict, Iterator, Optional, Tuple, TypeVar, Union

__all__ = [
    "CAPS",
    "MAX_DEPTH",
    "MAX_LINE_BYTES",
    "FileRefused",
    "FileMissing",
    "cap_bytes",
    "env_limit",
    "check_depth",
    "inside",
    "regular_file",
    "open_file",
    "read_bytes",
    "read_text",
    "iter_lines",
    "load_json",
    "parse_json",
    "load_toml",
]

PathLike = Union[str, "os.PathLike[str]"]
_Default = TypeVar("_Default", bound=Optional[int])

#: The largest file of each kind read, in bytes (None: no cap, the reader bounds its work itself).
#: Each is far above what shardfc writes or the public data sets hold, and far below what would
#: exhaust a host. ``SHARDFC_MAX_<KIND>_BYTES`` (``K``/``M``/``G`` suffixes) raises one.
CAPS: Dict[str, Optional[int]] = {
    "config": 1 << 20,       # a TOML config or preset: a few KiB
    "cache": 16 << 20,       # shardfc's head-impl cache: ~200 bytes per workload
    "names": 1 << 30,        # a renames file: 10 M names of ~100 bytes
    "list": 16 << 30,        # an image list file: streamed line by line (Glint360K's is ~1 GiB)
    "property": 4 << 10,     # RecordIO ``property``: "num_classes,H,W"
    "index": 8 << 30,        # a RecordIO ``.idx``: ~20 bytes per record (also bounded by its .rec)
    "record": None,          # a ``.rec``: hundreds of GiB, read record by record with its framing checked
    "image": 64 << 20,       # one encoded image (a 112x112 JPEG is ~5 KiB); pixels are capped apart
    "font": 256 << 20,       # a font file (a CJK .ttc is 20-120 MiB)
    "bin": 4 << 30,          # a verification .bin (LFW's is 60 MiB)
    "meta": 1 << 30,         # an IJB meta file (IJB-C's 5-point file is ~30 MiB)
    "model": None,           # an arcface_torch .pth: records checked by the weights-only reader
    "checkpoint": None,      # a checkpoint file: sizes and hashes checked against meta.json
    "csv": 4 << 30,          # a run's metrics.csv, read back on resume
}
#: The deepest nesting of a JSON or TOML document read (arrays and tables alike): a config is 2 deep,
#: the head-impl cache 3, a checkpoint's meta.json 4.
MAX_DEPTH = 32
#: The longest line of a text file read line by line (a list file's ``path label``, an IJB meta row).
MAX_LINE_BYTES = 64 << 10

_SIZE_RE = re.compile(r"\s*(\d+)\s*([KMGT]?)i?B?\s*", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class FileRefused(ValueError):
    """A file the gate will not read (not a regular file, outside its folder, over its cap, not
    the text or structure its kind needs): one line naming the file and why."""


class FileMissing(FileRefused, FileNotFoundError):
    """The file does not exist (also a FileNotFoundError, as callers that predate the gate expect)."""


def env_limit(name: str, default: _Default) -> Union[int, _Default]:
    """The int in environment variable ``name`` (``K``/``M``/``G``/``T`` suffixes, powers of 1024),
    or ``default`` when unset or blank; a value that is not a size is a FileRefused naming the variable."""
    text = os.environ.get(name, "")
    if not text.strip():
        return default
    m = _SIZE_RE.fullmatch(text)
    if not m:
        raise FileRefused(f"environment variable {name}={text!r} is not a size (e.g. 300000, 64M, 2G)")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def cap_bytes(kind: str) -> Optional[int]:
    """The size cap of ``kind`` (:data:`CAPS`), raised by ``SHARDFC_MAX_<KIND>_BYTES`` if set."""
    if kind not in CAPS:
        raise KeyError(f"unknown kind of file {kind!r}; known: {', '.join(CAPS)}")
    # A kind without a cap (None) gets one only from a variable set to a size: a blank one is unset,
    # as for every kind, never a cap of 0 bytes.
    return env_limit(f"SHARDFC_MAX_{kind.upper()}_BYTES", CAPS[kind])


def _human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"


def _kind_of(mode: int) -> str:
    return ("a symlink" if stat.S_ISLNK(mode) else "a folder" if stat.S_ISDIR(mode) else
            "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device")


def inside(path: PathLike, root: PathLike, what: str = "file") -> str:
    """``path`` resolved (links followed), which must lie under ``root`` resolved; else a
    FileRefused naming both. What a data set's folder holds may link within it, never out of it."""
    real, base = os.path.realpath(path), os.path.realpath(root)
    if real != base and os.path.commonpath([real, base]) != base:
        raise FileRefused(f"refusing to read {what} {os.fspath(path)}: it resolves to {real}, outside {base}")
    return real


def regular_file(path: PathLike, what: str = "file", *, follow_symlinks: bool = True,
                 root: Optional[PathLike] = None) -> os.stat_result:
    """The ``stat`` of ``path`` if it is a regular file (inside ``root`` when given), before
    anything opens it; else a FileRefused (FileMissing when it does not exist) naming it.
    ``follow_symlinks=False``: a symlink itself is refused (``lstat``)."""
    target = inside(path, root, what) if root is not None else path
    try:
        st = os.stat(target) if follow_symlinks and root is None else os.lstat(target)
    except FileNotFoundError:
        raise FileMissing(f"{what} {os.fspath(path)} is missing") from None
    except OSError as e:
        raise FileRefused(f"cannot stat {what} {os.fspath(path)}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise FileRefused(f"refusing to read {what} {os.fspath(path)}: it is {_kind_of(st.st_mode)}, not a regular file")
    return st


def _check_size(path: PathLike, what: str, kind: str, size: int) -> None:
    cap = cap_bytes(kind)
    if cap is not None and size > cap:
        raise FileRefused(f"{what} {os.fspath(path)} is {size} bytes, more than the {_human(cap)} a {kind} file may "
                          f"have (raise it with SHARDFC_MAX_{kind.upper()}_BYTES)")


def open_file(path: PathLike, kind: str, what: Optional[str] = None, *, follow_symlinks: bool = True,
              root: Optional[PathLike] = None) -> BinaryIO:
    """``path`` opened for reading in binary if it is a regular file of at most ``kind``'s cap
    (inside ``root`` when given; see the module docstring); else a FileRefused naming it."""
    what = what or f"{kind} file"
    regular_file(path, what, follow_symlinks=follow_symlinks, root=root)
    target = os.path.realpath(path) if root is not None else path
    nofollow = root is not None or not follow_symlinks  # a resolved path has no link left to follow
    # (os.open makes its descriptor non-inheritable itself, with O_CLOEXEC where there is one: PEP 446.)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | (getattr(os, "O_NOFOLLOW", 0) if nofollow else 0)
    try:
        fd = os.open(target, flags)
    except FileNotFoundError:
        raise FileMissing(f"{what} {os.fspath(path)} is missing") from None
    except OSError as e:
        raise FileRefused(f"cannot open {what} {os.fspath(path)}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped for something else between the stat and the open
            raise FileRefused(f"refusing to read {what} {os.fspath(path)}: it is {_kind_of(st.st_mode)}, "
                              "not a regular file")
        _check_size(path, what, kind, st.st_size)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def read_bytes(path: PathLike, kind: str, what: Optional[str] = None, *, follow_symlinks: bool = True,
               root: Optional[PathLike] = None) -> bytes:
    """The bytes of ``path`` (:func:`open_file`'s rules), never more than ``kind``'s cap even if
    the file grows while it is read."""
    what = what or f"{kind} file"
    cap = cap_bytes(kind)
    with open_file(path, kind, what, follow_symlinks=follow_symlinks, root=root) as f:
        # read(n) allocates n bytes up front: ask for the size the file has (checked under the cap),
        # and only then, if it grew meanwhile, for the rest a chunk at a time up to the cap.
        chunks = [f.read(os.fstat(f.fileno()).st_size + 1)]
        total = len(chunks[0])
        while chunks[-1] and (cap is None or total <= cap):
            chunks.append(f.read(1 << 20))
            total += len(chunks[-1])
    _check_size(path, what, kind, total)
    return b"".join(chunks)


def _decode(data: bytes, path: PathLike, what: str, encoding: str, line: Optional[int] = None) -> str:
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        where = f"line {line}" if line is not None else f"byte {e.start}"
        raise FileRefused(f"{what} {os.fspath(path)} is not {encoding} text ({where}: {e.reason})") from None


def read_text(path: PathLike, kind: str, what: Optional[str] = None, *, encoding: str = "utf-8",
              follow_symlinks: bool = True, root: Optional[PathLike] = None) -> str:
    """The text of ``path`` (:func:`read_bytes`), decoded strictly: bytes that are not
    ``encoding`` are a FileRefused naming the file and the byte."""
    what = what or f"{kind} file"
    return _decode(read_bytes(path, kind, what, follow_symlinks=follow_symlinks, root=root), path, what, encoding)


def iter_lines(path: PathLike, kind: str, what: Optional[str] = None, *, encoding: str = "utf-8",
               max_line: int = MAX_LINE_BYTES, follow_symlinks: bool = True,
               root: Optional[PathLike] = None) -> Iterator[Tuple[int, str]]:
    """``(line number, line without its end)`` of text file ``path``, streamed (a list of millions
    of images is never held whole); a line longer than ``max_line`` bytes, or not ``encoding``, is a
    FileRefused naming the file and the line."""
    what = what or f"{kind} file"
    with open_file(path, kind, what, follow_symlinks=follow_symlinks, root=root) as f:
        number = 0
        while True:
            raw = f.readline(max_line + 1)
            if not raw:
                return
            number += 1
            if len(raw) > max_line:
                raise FileRefused(f"{what} {os.fspath(path)}: line {number} is longer than {_human(max_line)}")
            yield number, _decode(raw, path, what, encoding, number).rstrip("\r\n")


def check_depth(value: Any, name: str, max_depth: int = MAX_DEPTH) -> Any:
    """``value`` if its lists / dicts nest at most ``max_depth`` deep, else a FileRefused naming
    ``name``. Iterative: a deep value cannot exhaust the stack here."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, tuple, dict)):
            if depth > max_depth:
                raise FileRefused(f"{name} is nested more than {max_depth} deep")
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return value


def parse_json(text: Union[str, bytes], name: str, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads(text)`` nested at most ``max_depth`` deep; a parse error, or nesting deep enough
    to exhaust the parser's stack, is a FileRefused naming ``name``."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise FileRefused(f"{name} is nested more than {max_depth} deep") from None
    except ValueError as e:  # JSONDecodeError, and UnicodeDecodeError of bytes
        raise FileRefused(f"{name} is not JSON: {str(e)[:200]}") from None
    return check_depth(value, name, max_depth)


def load_json(path: PathLike, kind: str, what: Optional[str] = None, *, max_depth: int = MAX_DEPTH,
              follow_symlinks: bool = True, root: Optional[PathLike] = None) -> Any:
    """A JSON file (:func:`read_text`'s rules, then :func:`parse_json`)."""
    what = what or f"{kind} file"
    text = read_text(path, kind, what, follow_symlinks=follow_symlinks, root=root)
    return parse_json(text, f"{what} {os.fspath(path)}", max_depth)


def load_toml(path: PathLike, kind: str = "config", what: Optional[str] = None, *,
              max_depth: int = MAX_DEPTH) -> Dict[str, Any]:
    """A TOML file (:func:`read_text`'s rules), nested at most ``max_depth`` deep; a syntax error is
    a FileRefused naming the file, the line and the column."""
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise FileRefused(f"reading {os.fspath(path)} needs Python >= 3.11 or the 'tomli' package "
                              "(pip install tomli)") from None
    what = what or f"{kind} file"
    text = read_text(path, kind, what)
    name = f"{what} {os.fspath(path)}"
    try:
        value = tomllib.loads(text)
    except RecursionError:
        raise FileRefused(f"{name} is nested more than {max_depth} deep") from None
    except tomllib.TOMLDecodeError as e:
        raise FileRefused(f"{name} is not valid TOML: {e}") from None
    return check_depth(value, name, max_depth)
