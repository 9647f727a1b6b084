"""Pick the fastest implementation of the head's loss once per workload, on the user's own GPU.

Like ``torch.backends.cudnn.benchmark``: the first forward of a workload (shapes, dtypes, margin,
sampling, GPU, library versions: whatever the caller puts in :func:`workload_key`) runs each
candidate implementation a few times, keeps the fastest, and remembers it — in memory for the
process, and in a small JSON file (:func:`cache_file`) for the next run. Nothing here knows about
the head: a candidate is a callable that runs one forward + backward of one implementation on the
real inputs and changes no state.

Across ranks the choice must be the same everywhere (a rank that runs another implementation still
computes the same loss, but its collectives could differ), and every rank must take part in the
agreement whatever it would do alone, or the others wait for it forever. In a process group the
head settles a new workload in one or two collectives, the same number on every rank:

1. :meth:`ImplSelector.settle`: every rank sends what it would do alone (:class:`RankView`: its
   ``SHARDFC_HEAD_IMPL``, whether it can run what that names or time the fused kernels, its cache
   file's entry) in one all-gather, and every rank applies the same rule (:func:`settle_views`) to
   the same list: an override that differs between ranks, or that names no implementation, or one
   that cannot run on some rank, is the same ValueError on every rank (naming the variable, the
   values and the ranks); one override set alike everywhere is run; ranks where the fused kernels
   cannot run make every rank run torch (with a warning when some other rank could have); else
   rank 0's cached choice, if it has one;
2. only when nothing was settled: :meth:`ImplSelector.choose` (``cached=False``) times every
   candidate on every rank, and ``agree(index of its fastest)`` gives rank 0's pick everywhere.

One process calls :meth:`ImplSelector.choose` alone: ``agree`` is then None.
``SHARDFC_HEAD_IMPL`` (:func:`env_override`) lets a user skip all of this and name the implementation.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import pathlib
import statistics
import tempfile
import time
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from shardfc import files, version
from shardfc.checks import check_int, check_names, check_positive_int
from shardfc.head.fused import CANDIDATES, IMPLS, TIMED

__all__ = [
    "ENV_VAR",
    "INVALID",
    "ImplSelector",
    "RankView",
    "Settled",
    "VIEW_CODES",
    "bucket",
    "cache_file",
    "default_selector",
    "env_override",
    "environment_fields",
    "settle_views",
    "short_key",
    "workload_key",
]

#: Names the implementation for every head of the process (one of :data:`~shardfc.head.fused.IMPLS`),
#: instead of the head's ``impl`` argument; unset or empty: no override.
ENV_VAR = "SHARDFC_HEAD_IMPL"
#: The folder of the cache file, instead of ``$XDG_CACHE_HOME/shardfc`` or ``~/.cache/shardfc``.
CACHE_DIR_VAR = "SHARDFC_CACHE_DIR"
CACHE_NAME = "head_impl.json"

_OOM = getattr(torch.cuda, "OutOfMemoryError", RuntimeError)

#: A :class:`RankView`'s ``override`` when ``$SHARDFC_HEAD_IMPL`` names no implementation there.
INVALID = "<invalid>"
#: Every value a rank's override can take, in the order of its code in :meth:`RankView.encode`.
_OVERRIDES: Tuple[Optional[str], ...] = (None, *CANDIDATES, INVALID)
#: How many codes :meth:`RankView.encode` uses (override x runs x cached).
#: The names a choice can have: an implementation's name alone (at its default chunk scale), and
#: :data:`~shardfc.head.fused.TIMED`'s (an implementation at a chunk scale).
NAMES: Tuple[str, ...] = CANDIDATES + tuple(n for n in TIMED if n not in CANDIDATES)
VIEW_CODES = len(_OVERRIDES) * 2 * (len(NAMES) + 1)


def env_override() -> Optional[str]:
    """The implementation ``$SHARDFC_HEAD_IMPL`` names (None when unset or empty); a ValueError
    naming the variable, its value and the allowed names when it names none."""
    raw = os.environ.get(ENV_VAR, "")
    value = raw.strip().lower()
    if not value:
        return None
    if value not in IMPLS:
        raise ValueError(f"{ENV_VAR}={raw!r} is not an implementation of the head; choose from {', '.join(IMPLS)}")
    return value


def cache_file() -> pathlib.Path:
    """Where the chosen implementations persist: ``$SHARDFC_CACHE_DIR/head_impl.json``, else
    ``$XDG_CACHE_HOME/shardfc/head_impl.json`` (an absolute path, as the XDG spec asks), else
    ``~/.cache/shardfc/head_impl.json``."""
    own = os.environ.get(CACHE_DIR_VAR, "")
    if own:
        return pathlib.Path(own).expanduser() / CACHE_NAME
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if xdg and os.path.isabs(xdg):
        return pathlib.Path(xdg) / "shardfc" / CACHE_NAME
    return pathlib.Path.home() / ".cache" / "shardfc" / CACHE_NAME


def bucket(n: int) -> int:
    """``n`` rounded up to a power of two (0 stays 0): class and batch counts in a workload key, so
    1,000,000 and 1,000,003 classes share a choice (their best implementation is the same)."""
    n = check_int("n", n, 0)
    return 0 if n == 0 else 1 << (n - 1).bit_length()


def workload_key(**fields: Any) -> str:
    """A stable string for one workload: the fields as JSON with sorted names (``torch.dtype``,
    ``torch.device`` and other non-JSON values as their ``str``). Bucket counts first (:func:`bucket`)."""
    if not fields:
        raise ValueError("workload_key needs at least one field")
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)


def short_key(key: str) -> str:
    """A 10-hex-digit digest of ``key``, for log lines."""
    return hashlib.sha256(key.encode()).hexdigest()[:10]


def environment_fields(device: Union[torch.device, str, None] = None) -> Dict[str, Optional[str]]:
    """The machine's part of a workload key: GPU name (``"cpu"`` off CUDA), shardfc, torch, CUDA and
    Triton versions (``None`` when absent). A new release of any of them may change which
    implementation is fastest (new kernels, new tiles, a new compiler), so it times again."""
    device = torch.device("cuda" if device is None and torch.cuda.is_available() else (device or "cpu"))
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return {
        "gpu": gpu, "shardfc": version.__version__, "torch": torch.__version__, "cuda": torch.version.cuda,
        "triton": _triton_version(),
    }


@functools.lru_cache(maxsize=None)
def _triton_version() -> Optional[str]:
    """Read once: the head builds a workload key every forward under ``impl="auto"``."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------- the ranks' agreement
@dataclasses.dataclass(frozen=True)
class RankView:
    """What one rank would do for a workload on its own, before the ranks agree.

    Attributes:
        override: the implementation its ``$SHARDFC_HEAD_IMPL`` names (None: unset, empty or
            ``auto``; :data:`INVALID`: a value that names none).
        runs: with an override, whether that implementation can run there; without, whether the
            candidates can be timed there (a CUDA device with Triton, a dtype the kernels take).
        cached: index in :data:`NAMES` of its cache file's choice for the
            workload (an implementation and its chunk scale), -1 for none.
    """

    override: Optional[str] = None
    runs: bool = True
    cached: int = -1

    def __post_init__(self):
        if self.override not in _OVERRIDES:
            raise ValueError(f"override must be one of {_OVERRIDES}, got {self.override!r}")
        if not -1 <= self.cached < len(NAMES):
            raise ValueError(f"cached must be an index of {NAMES} or -1, got {self.cached!r}")

    def encode(self) -> int:
        """One small integer (below :data:`VIEW_CODES`): what the ranks exchange, exact in any float dtype."""
        return _OVERRIDES.index(self.override) + len(_OVERRIDES) * (int(self.runs) + 2 * (self.cached + 1))

    @classmethod
    def decode(cls, code: int) -> "RankView":
        """The view :meth:`encode` made ``code`` of; a RuntimeError when no view makes it."""
        if isinstance(code, bool) or not isinstance(code, int) or not 0 <= code < VIEW_CODES:
            raise RuntimeError(f"a rank sent {code!r}, not the code of a head-impl view (0 .. {VIEW_CODES - 1})")
        rest, override = divmod(code, len(_OVERRIDES))
        cached, runs = divmod(rest, 2)
        return cls(_OVERRIDES[override], bool(runs), cached - 1)


class Settled(NamedTuple):
    """What :func:`settle_views` decided: ``impl`` every rank runs (None: time the candidates),
    ``how`` (``"override"``, ``"no-triton"``, ``"cached"`` or ``"time"``) and, for ``"no-triton"``,
    the ranks where the fused kernels cannot run."""

    impl: Optional[str]
    how: str
    ranks: Tuple[int, ...] = ()


def settle_views(views: Sequence[RankView]) -> Settled:
    """The one rule every rank applies to the same list of views (``views[r]``: rank r's), so each
    decides the same or raises the same ValueError:

    * an override that names no implementation on some rank, or that is not the same on every
      rank (set on some ranks only, or to different names), or that cannot run on some rank: a
      ValueError naming the variable, the values and the ranks — never a rank that goes on alone;
    * one override set alike on every rank (and runnable on each): that implementation, no timing;
    * no override, and the fused kernels cannot run on some rank: torch on every rank, the one
      implementation that runs everywhere (what ``auto`` means on one such process too);
    * else rank 0's cached choice, if any; else None: time the candidates.
    """
    if not views:
        raise ValueError("settle_views needs the view of at least one rank")
    invalid = [r for r, v in enumerate(views) if v.override == INVALID]
    if invalid:
        raise ValueError(
            f"{ENV_VAR} names no implementation of the head on {_ranks(invalid)} (see the error there); "
            f"set it to one of {', '.join(CANDIDATES)} on every rank, or leave it unset on every rank"
        )
    if len({v.override for v in views}) > 1:
        groups: Dict[Optional[str], List[int]] = {}
        for r, v in enumerate(views):
            groups.setdefault(v.override, []).append(r)
        shown = ", ".join(f"{_ranks(rs)} {'unset' if o is None else repr(o)}" for o, rs in groups.items())
        raise ValueError(f"{ENV_VAR} differs across ranks: {shown}; set it on every rank or on none")
    override = views[0].override
    cannot = tuple(r for r, v in enumerate(views) if not v.runs)
    if override is not None:
        if cannot:
            raise ValueError(
                f"{ENV_VAR}={override!r} cannot run on {_ranks(cannot)} (see the error there); "
                f"name an implementation every rank can run, e.g. torch"
            )
        return Settled(override, "override")
    if cannot:
        return Settled("torch", "no-triton", cannot)
    if views[0].cached >= 0:
        return Settled(NAMES[views[0].cached], "cached")
    return Settled(None, "time")


def _ranks(ranks: Sequence[int]) -> str:
    """``rank 3``, or ``ranks 0,2-7``: runs of consecutive ranks as ranges, so an error about a
    thousand ranks stays one line."""
    runs: List[List[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _default_sync() -> Callable[[], None]:
    if torch.cuda.is_available():
        return torch.cuda.synchronize
    return lambda: None


def _reason(e: BaseException) -> str:
    """One line, at most 200 characters, for the log table (OOM messages run to paragraphs)."""
    text = str(e).strip().splitlines()
    line = f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")
    return line if len(line) <= 200 else line[:197] + "..."


class ImplSelector:
    """Chooses and remembers the fastest candidate per workload key (see the module docstring).

    Args:
        path: the JSON cache (default :func:`cache_file`, resolved now).
        steps: timed calls per candidate; the median counts.
        warmup: untimed calls per candidate before them (compilation, autotuning, allocator).
        clock: seconds, monotonic (default ``time.perf_counter``).
        sync: waits for the device (default ``torch.cuda.synchronize`` when CUDA is available,
            else nothing). It synchronises the *current* device: pass your own when the candidates
            run on several.
        log: where the table of timings goes (info) and cache trouble (warning, once each).
        write_cache: write choices to ``path`` (pass ``rank == 0`` in a group; ``choose(write=)``
            overrides it per call).

    Attributes:
        choices: ``key -> name`` chosen in this process.
        timings: ``key -> {name: median ms}`` for the keys timed here (``inf``: the candidate failed).
        failures: ``key -> {name: reason}`` for the candidates that raised.
    """

    def __init__(
        self,
        path: Union[str, os.PathLike, None] = None,
        steps: int = 5,
        warmup: int = 1,
        clock: Optional[Callable[[], float]] = None,
        sync: Optional[Callable[[], None]] = None,
        log: Optional[logging.Logger] = None,
        write_cache: bool = True,
    ):
        self.path = cache_file() if path is None else pathlib.Path(path)
        self.steps = check_positive_int("steps", steps)
        self.warmup = check_int("warmup", warmup, 0)
        self.clock = time.perf_counter if clock is None else clock
        self.sync = _default_sync() if sync is None else sync
        self.log = logging.getLogger("shardfc.head") if log is None else log
        self.write_cache = bool(write_cache)
        self.choices: Dict[str, str] = {}
        self.timings: Dict[str, Dict[str, float]] = {}
        self.failures: Dict[str, Dict[str, str]] = {}
        self._warned: set = set()

    # ------------------------------------------------------------------ settle (process groups)
    def settle(
        self,
        key: str,
        override: Optional[str],
        runs: bool,
        gather: Optional[Callable[[int], Sequence[int]]] = None,
        cause: Optional[BaseException] = None,
    ) -> Optional[str]:
        """The first step of workload ``key`` in a process group (see the module docstring): the
        implementation every rank runs, or None when the candidates must be timed (then call
        :meth:`choose` with ``cached=False`` on every rank).

        ``override`` and ``runs``: this rank's :class:`RankView` (its cached entry is read here).
        ``gather(code)``: every rank's code in rank order, one collective that every rank enters
        (None: this process alone). ``cause``: why this rank cannot do what its view says (its
        invalid value, why its override cannot run here, or why the candidates cannot be timed
        here). Raises the ValueError of :func:`settle_views`, the same on every rank, from ``cause``
        on a rank whose override it concerns; the warning of a fall-back to torch names it. A
        settled name is remembered like a timed one, so a workload costs its collective once per
        process.
        """
        if key in self.choices:
            return self.choices[key]
        cached = -1
        if override is None and runs:  # a cache entry only matters where the candidates could be timed
            entry = self._read().get(key)
            name = entry.get("impl") if isinstance(entry, dict) else None
            cached = NAMES.index(name) if name in NAMES else -1
        view = RankView(override, bool(runs), cached)
        codes = [view.encode()] if gather is None else list(gather(view.encode()))
        try:
            settled = settle_views([RankView.decode(c) for c in codes])
        except ValueError as e:
            if cause is not None and override is not None:  # this rank's override is in the error: say why
                raise e from cause
            raise
        if settled.impl is not None:
            self._log_settled(key, settled, view, len(codes), cause)
            self.choices[key] = settled.impl
        return settled.impl

    def _log_settled(self, key: str, settled: Settled, view: RankView, world: int, cause) -> None:
        short = short_key(key)
        if settled.how == "override":
            self.log.info("head impl for workload %s: %s (%s on every rank)", short, settled.impl, ENV_VAR)
        elif settled.how == "cached":
            where = f"cached in {self.path}" if view.cached == NAMES.index(settled.impl) else "rank 0's cached choice"
            self.log.info("head impl for workload %s: %s (%s)", short, settled.impl, where)
        elif len(settled.ranks) < world:  # some ranks could have run the fused kernels: say why they don't
            here = f" (here: {cause})" if cause is not None and not view.runs else ""
            self.log.warning(
                "head impl for workload %s: torch on every rank, as the fused kernels cannot run on %s%s and every "
                "rank runs the same implementation; make Triton run there (a CUDA device, pip install "
                "'shardfc[gpu]') or pass impl='torch' to choose torch yourself", short, _ranks(settled.ranks), here,
            )
        else:  # no rank can run them (a CPU run): what auto means there, nothing to warn about
            self.log.debug("head impl for workload %s: torch (the fused kernels run on no rank)", short)

    # ------------------------------------------------------------------ choose
    def choose(
        self,
        key: str,
        candidates: Mapping[str, Callable[[], None]],
        agree: Optional[Callable[[int], int]] = None,
        write: Optional[bool] = None,
        cached: bool = True,
    ) -> str:
        """The implementation to run for workload ``key``.

        ``candidates``: name -> one forward + backward on the real inputs, changing no state; names
        from :data:`NAMES`, tried in the order given, the same on every rank.
        ``agree(i)``: returns rank 0's ``i`` on every rank (None: one process). ``write``: persist the
        choice (default: the constructor's ``write_cache``). ``cached=False``: time without looking
        at the cache file (and without the agreement on rank 0's entry): :meth:`settle` did. Raises a
        RuntimeError listing the failures when no candidate runs (on rank 0, or here).
        """
        if key in self.choices:
            return self.choices[key]
        names = check_names("candidates", list(candidates), NAMES)
        write = self.write_cache if write is None else bool(write)
        short = short_key(key)

        if cached:
            entry = self._read().get(key)
            name = entry.get("impl") if isinstance(entry, dict) else None
            i0 = self._agree(agree, names.index(name) if name in names else -1, len(names))
            if i0 >= 0:
                where = f"cached in {self.path}" if names[i0] == name else "rank 0's cached choice"
                self.log.info("head impl for workload %s: %s (%s)", short, names[i0], where)
                self.choices[key] = names[i0]
                return names[i0]

        times, errors = self._time_all(names, candidates)
        self.timings[key], self.failures[key] = times, errors
        ok = [n for n in names if n not in errors]
        fastest = min(ok, key=lambda n: times[n]) if ok else None  # min keeps the first of equals
        i1 = self._agree(agree, names.index(fastest) if fastest else -1, len(names))
        if i1 < 0 or fastest is None:
            where = "on rank 0" if i1 < 0 and agree is not None else "here"
            listed = "; ".join(f"{n}: {r}" for n, r in errors.items()) or "none failed here"
            raise RuntimeError(f"no implementation of the head could run {where} (workload {short}): {listed}")
        name = names[i1]
        where = self._write(key, name, times) if write else "not cached here (write disabled)"
        self._log_table(short, names, times, errors, name, fastest, where)
        self.choices[key] = name
        return name

    def _agree(self, agree: Optional[Callable[[int], int]], i: int, n: int) -> int:
        if agree is None:
            return i
        got = int(agree(i))
        if not -1 <= got < n:
            raise RuntimeError(f"agree({i}) returned {got}, not an index of the {n} candidates or -1")
        return got

    def _time_all(self, names, candidates):
        times: Dict[str, float] = {}
        errors: Dict[str, str] = {}
        for name in names:
            fn = candidates[name]
            try:
                for _ in range(self.warmup):
                    fn()
                samples = []
                for _ in range(self.steps):
                    self.sync()
                    t0 = self.clock()
                    fn()
                    self.sync()
                    samples.append(self.clock() - t0)
            except Exception as e:  # any failure rules the candidate out; interrupts go through
                times[name], errors[name] = math.inf, _reason(e)
                if isinstance(e, _OOM) and torch.cuda.is_available():
                    torch.cuda.empty_cache()
                continue
            times[name] = 1000.0 * statistics.median(samples)
        return times, errors

    def _log_table(self, short, names, times, errors, name, fastest, where) -> None:
        lines = [f"head impl for workload {short} (median of {self.steps} calls after {self.warmup} warm-up; {where}):"]
        for n in names:
            if n in errors:
                lines.append(f"  {n:<7} failed: {errors[n]}")
                continue
            mark = ""
            if n == name:
                mark = "  chosen" if n == fastest else "  chosen (rank 0's pick)"
            elif n == fastest:
                mark = "  fastest here"
            lines.append(f"  {n:<7} {times[n]:10.3f} ms{mark}")
        self.log.info("\n".join(lines))
        if name in errors:
            self.log.warning("head impl for workload %s: rank 0 chose %s, which failed here (%s)", short, name, errors[name])

    # ------------------------------------------------------------------ the file
    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            self.log.warning(message)

    def _read(self) -> Dict[str, Any]:
        """The file's entries; {} when it is missing, unreadable or corrupt (warned once)."""
        try:  # the gate: a FIFO or /dev/zero here would block or fill every run's first forward
            data = files.load_json(self.path, "cache", "head-impl cache")
        except FileNotFoundError:
            return {}
        except files.FileRefused as e:  # shardfc's own file: a damaged one never stops a run
            self._warn_once("read", f"ignoring the head-impl cache ({e}); its workloads are timed again")
            return {}
        except (OSError, ValueError) as e:
            self._warn_once("read", f"ignoring the head-impl cache {self.path}: {_reason(e)}")
            return {}
        if not isinstance(data, dict):
            self._warn_once("read", f"ignoring the head-impl cache {self.path}: not a JSON object")
            return {}
        return data

    def _write(self, key: str, name: str, times: Dict[str, float]) -> str:
        """Merge ``key``'s entry into the file, atomically; says where it went (or why not)."""
        data = self._read()
        data[key] = {
            "impl": name,
            "times_ms": {n: (None if math.isinf(t) else round(t, 4)) for n, t in times.items()},
            "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1, sort_keys=True, allow_nan=False)
                f.write("\n")
            os.replace(tmp, self.path)
        except OSError as e:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            self._warn_once(
                "write", f"cannot write the head-impl cache {self.path}: {_reason(e)}; choices last this process only"
            )
            return "not cached: the file cannot be written"
        return f"cached in {self.path}"


_default: Optional[ImplSelector] = None


def default_selector() -> ImplSelector:
    """The process's shared selector (created on first use with the defaults), so every head of a
    process times a workload once."""
    global _default
    if _default is None:
        _default = ImplSelector()
    return _default
