"""HBM bytes of one head step, kernel by kernel (``shardfc plan --bytes``), counted from the real step.

The step is the one :mod:`.replay` runs on the ``meta`` device. Two sources tell what each kernel
touches:

* **torch operators**, seen by the replay's dispatch mode: an operator reads its tensor arguments
  and writes its results (in place: the argument it returns). Gathers (``index_select``, indexing,
  ``embedding``, ``gather``) read only the rows they return; scatters into a tensor
  (``index_add_``, ``index_put_``, ``scatter_``, ``index_copy_``) read and write only the rows
  their source covers. ``empty`` touches nothing; ``zero_``/``fill_``/``copy_`` write without
  reading their destination. Views move nothing.
* **the fused kernels**, which launch nothing on meta: each launcher tells what its loads and
  stores would touch (:mod:`shardfc.head.fused.traffic`), from the arguments it would launch with.

Between the kernels and HBM sits an **L2 model**: a least-recently-used cache of ``l2_bytes``
holding whole regions (a slice of a tensor, or rows gathered through an index). A read of a
region held is served by L2; any other read costs its bytes of HBM and brings the region in
(unless it is larger than the cache: then it streams). A write puts the region in, dirty; a dirty
region costs its bytes of HBM when it is evicted, or when the step ends with it still in L2 —
credited to the kernel that wrote it. A tensor freed while in L2 stays there, dirty, until it is
evicted (then written back) or its block is reused: as torch's caching allocator does, the next
tensor of the same size the step creates takes the most recently freed block of that size (the chunk
loop's next block of products, its next ``H``), and its writes replace those lines with no
write-back. Not modelled: partial
overlaps of different regions of one tensor (each is its own region), L2's sets and its two halves,
the row tiles of the fused forward re-reading their split's rows (counted once: they run together).

Time "on paper" per launch is ``max(HBM bytes / HBM_BYTES_PER_S, flops / MATMUL_FLOPS_PER_S)`` —
an H100's sustained rates, launch overheads and latencies left out: an estimate, not a measurement.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from shardfc.tools.bench.memory import tensors_in
from shardfc.tools.plan.units import format_bytes

aten = torch.ops.aten

#: Sustained HBM rate (bytes/s) and bf16 dense matmul rate (FLOP/s) of an H100 SXM, for the time
#: on paper: ≈ 87% of its 3.35 TB/s, ≈ 60% of its 990 TFLOP/s (what cuBLAS reaches at these shapes).
HBM_BYTES_PER_S = 2.9e12
MATMUL_FLOPS_PER_S = 600e12
#: Host time to issue one launch (µs): a Triton launch from Python, a cuBLAS call through torch, or
#: a small torch operator, each ≈ 5–10 µs of CPU; a step's issue time on paper is its launches at
#: this rate. When it exceeds the GPU time, the GPU waits for the host.
HOST_LAUNCH_US = 8.0
#: Torch operators under this many bytes (HBM and L2) are one row of ``--bytes``'s table.
SMALL_ROW_BYTES = 16 * 2**20
#: An H100's L2 (the default of ``shardfc plan --l2``).
DEFAULT_L2_BYTES = 50 * 2**20

_NO_TRAFFIC = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_local_scalar_dense",
               "lift_fresh", "resize_", "set_", "record_stream"}
_WRITE_ONLY = {"zero_", "_foreach_zero_", "fill_", "zeros_like", "ones_like", "full_like", "zeros", "ones", "full", "arange",
               "randperm", "scalar_tensor"}
_GATHERS = {"index_select", "index", "embedding", "gather", "take"}
_SCATTERS = {"index_add_", "index_put_", "_index_put_impl_", "scatter_", "scatter_add_", "index_copy_",
             "index_fill_", "scatter_reduce_"}
_GEMMS = {"mm", "addmm", "bmm", "baddbmm", "matmul"}


@dataclass
class Launch:
    """One kernel launch: its HBM bytes (write-backs credited as they happen), L2-served bytes,
    FLOPs, and the largest region it touched."""

    kernel: str
    fused: bool
    read: int = 0
    written: int = 0
    from_l2: int = 0
    flops: float = 0.0
    largest: int = 0
    shape: str = ""

    @property
    def ms(self) -> float:
        return 1e3 * max((self.read + self.written) / HBM_BYTES_PER_S, self.flops / MATMUL_FLOPS_PER_S)


@dataclass
class _Entry:
    nbytes: int
    dirty: bool  # written and not yet in HBM: then ``writer`` is the launch that wrote it
    writer: Optional[Launch]


@dataclass
class StepTraffic:
    """Every launch of one step, and :meth:`table` of them by kernel."""

    l2_bytes: int
    launches: List[Launch] = field(default_factory=list)

    def total(self, what: str = "hbm") -> float:
        if what == "hbm":
            return sum(x.read + x.written for x in self.launches)
        return sum(getattr(x, what) for x in self.launches)

    def table(self) -> List[Dict[str, Any]]:
        """Rows by kernel (GEMMs by kernel and shape), in the order they first ran."""
        rows: Dict[Tuple[str, str], Dict[str, Any]] = {}
        for x in self.launches:
            row = rows.setdefault((x.kernel, x.shape), dict(
                kernel=x.kernel, shape=x.shape, fused=x.fused, launches=0, read=0, written=0, from_l2=0, flops=0.0, ms=0.0))
            row["launches"] += 1
            for k in ("read", "written", "from_l2", "flops"):
                row[k] += getattr(x, k)
            row["ms"] += x.ms
        return list(rows.values())


class TrafficCounter:
    """Counts a step's launches: :meth:`op` for each torch operator (the replay's dispatch mode
    calls it), :meth:`kernel` for each fused launch (:func:`shardfc.head.fused.traffic.recording`);
    both only while ``active()``. :meth:`finish` ends the step and returns its :class:`StepTraffic`."""

    def __init__(self, l2_bytes: int, active: Callable[[], bool] = lambda: True):
        self.result = StepTraffic(l2_bytes)
        self.active = active
        self._cache: "OrderedDict[Hashable, _Entry]" = OrderedDict()
        self._used = 0
        self._serials: Dict[int, int] = {}  # storage address -> serial (of its block)
        self._sizes: Dict[int, int] = {}  # serial -> its block's bytes
        self._free_blocks: Dict[int, List[int]] = {}  # bytes -> serials of freed blocks, last freed last
        self._next = 0
        self._finalizers: List[weakref.finalize] = []

    # ------------------------------------------------------------------ identities
    def _serial(self, t: torch.Tensor, new: bool = False) -> int:
        """The serial of ``t``'s block; a ``new`` storage (made by the step) takes the most recently
        freed block of its size when there is one."""
        storage = t.untyped_storage()
        key = storage._cdata
        serial = self._serials.get(key)
        if serial is None:
            nbytes = storage.nbytes()
            free = self._free_blocks.get(nbytes) if new else None
            if free:
                serial = free.pop()
            else:
                self._next += 1
                serial = self._next
                self._sizes[serial] = nbytes
            self._serials[key] = serial
            self._finalizers.append(weakref.finalize(storage, self._freed, key, serial))
        return serial

    def _freed(self, key: int, serial: int) -> None:
        """The storage is gone; its block (and its lines in L2) wait for the next of its size."""
        if self._serials.get(key) == serial:
            del self._serials[key]
            self._free_blocks.setdefault(self._sizes[serial], []).append(serial)

    def _resolve(self, part) -> Hashable:
        if isinstance(part, torch.Tensor):
            return ("t", self._serial(part))
        if isinstance(part, tuple):
            return tuple(self._resolve(p) for p in part)
        return part

    # ------------------------------------------------------------------ the L2 model
    def _evict_until(self, room: int) -> None:
        while self._used + room > self.result.l2_bytes and self._cache:
            k, entry = self._cache.popitem(last=False)
            self._used -= entry.nbytes
            if entry.dirty:
                entry.writer.written += entry.nbytes

    def _insert(self, key, nbytes: int, dirty: bool, writer: Optional[Launch]) -> bool:
        if nbytes > self.result.l2_bytes:
            return False
        self._evict_until(nbytes)
        self._cache[key] = _Entry(nbytes, dirty, writer)
        self._used += nbytes
        return True

    def _read(self, launch: Launch, t: torch.Tensor, part, nbytes: int, streamed: bool = False) -> None:
        key = (self._serial(t), self._resolve(part))
        launch.largest = max(launch.largest, nbytes)
        if key in self._cache:
            self._cache.move_to_end(key)
            launch.from_l2 += nbytes
            return
        launch.read += nbytes
        if not streamed:  # evict_first: read once, kept out of the way of what is reused
            self._insert(key, nbytes, False, None)

    def _write(self, launch: Launch, t: torch.Tensor, part, nbytes: int, streamed: bool = False) -> None:
        key = (self._serial(t), self._resolve(part))
        launch.largest = max(launch.largest, nbytes)
        entry = self._cache.pop(key, None)
        if entry is not None:
            self._used -= entry.nbytes
        if streamed or not self._insert(key, nbytes, True, launch):
            launch.written += nbytes  # evict_first, or larger than L2: streams to HBM

    # ------------------------------------------------------------------ sources
    def kernel(self, name: str, reads: Sequence, writes: Sequence, flops: float = 0.0) -> None:
        """A fused launch (:func:`shardfc.head.fused.traffic.note`)."""
        if not self.active():
            return
        launch = Launch(name, True, flops=flops)
        self.result.launches.append(launch)
        for r in reads:
            self._read(launch, r.tensor, r.part, r.nbytes, r.streamed)
        for w in writes:
            self._write(launch, w.tensor, w.part, w.nbytes, w.streamed)

    def op(self, func, args, kwargs, out) -> None:
        """A torch operator that ran in the step (see the module docstring for what it touches)."""
        if not self.active() or func.is_view:
            return
        name = func.overloadpacket.__name__
        for t in tensors_in(out):  # a storage the operator made takes a freed block of its size
            self._serial(t, new=True)
        if name in _NO_TRAFFIC:
            return
        kwargs = {k: v for k, v in kwargs.items() if k != "out"}
        launch = Launch(name, False)
        if name in _GEMMS:
            launch.flops, launch.shape = _gemm(name, args)
        outs = list(tensors_in(out)) + list(tensors_in(_mutated(func, args, kwargs)))
        if name in _GATHERS:
            got = sum(_nbytes(t) for t in outs)
            src, rest = args[0], [t for t in tensors_in((args[1:], kwargs))]
            self._read(launch, src, ("gather", self._resolve(tuple(rest))), got)
            for t in rest:
                self._read_view(launch, t)
        elif name in _SCATTERS:
            dest, rest = args[0], [t for t in tensors_in((args[1:], kwargs))]
            touched = _scattered_bytes(name, dest, args)
            part = ("scatter", self._resolve(tuple(rest)))
            if name != "index_fill_":
                self._read(launch, dest, part, touched)
            for t in rest:
                self._read_view(launch, t)
            self._write(launch, dest, part, touched)
            outs = []
        elif name == "copy_":
            self._read_view(launch, args[1])
        elif name not in _WRITE_ONLY:
            seen = set()
            for t in tensors_in((args, kwargs)):
                if id(t) not in seen:
                    seen.add(id(t))
                    self._read_view(launch, t)
        for t in outs:
            self._write_view(launch, t)
        if launch.largest or launch.flops:  # it touched a region of some bytes (largest > 0), or computed
            self.result.launches.append(launch)

    def _read_view(self, launch: Launch, t: torch.Tensor) -> None:
        if t.dim() == 0 and t.device.type == "cpu":  # a wrapped Python number
            return
        self._read(launch, t, _view_part(t), _nbytes(t))

    def _write_view(self, launch: Launch, t: torch.Tensor) -> None:
        self._write(launch, t, _view_part(t), _nbytes(t))

    def finish(self) -> StepTraffic:
        """The step is over: what is dirty in L2 and still alive will be written back."""
        for entry in self._cache.values():
            if entry.dirty:
                entry.writer.written += entry.nbytes
        self._cache.clear()
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()
        return self.result


def _mutated(func, args, kwargs) -> list:
    """The arguments ``func`` writes in place, by its schema (``Tensor(a!)``): what an operator
    that returns nothing, such as torch's fused SGD, writes."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        # torch's fused optimizers mark their gradients written (for maximize=True): they are not
        if a.alias_info is not None and a.alias_info.is_write and a.name not in ("out", "grads"):
            value = args[i] if i < len(args) else kwargs.get(a.name)
            if value is not None:
                out.append(value)
    return out


def _distinct(t: torch.Tensor) -> int:
    """Elements of the view ``t`` that are distinct memory (broadcast dimensions count once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n if t.numel() else 0


def _nbytes(t: torch.Tensor) -> int:
    return _distinct(t) * t.element_size()


def _view_part(t: torch.Tensor) -> tuple:
    """A view's region: equal for views over the same bytes (a matrix and its transpose)."""
    return ("span", t.storage_offset() * t.element_size(), _nbytes(t))


def _scattered_bytes(name: str, dest: torch.Tensor, args) -> int:
    """Bytes of ``dest`` a scatter touches: the rows (or elements) its index names."""
    if name in ("index_put_", "_index_put_impl_"):
        # the (broadcast) index tensors pick n_idx positions; a None index, and every dimension after
        # the list, is taken whole
        indices = list(args[1])
        n_idx = max((i.numel() for i in indices if i is not None), default=1)
        per = dest.element_size()
        for d, size in enumerate(dest.shape):
            if d >= len(indices) or indices[d] is None:
                per *= size
        return n_idx * per
    if name in ("scatter_", "scatter_add_", "scatter_reduce_"):
        return args[2].numel() * dest.element_size()
    dim, index = args[1], args[2]  # index_add_ / index_copy_ / index_fill_ (self, dim, index, ...)
    return index.numel() * (dest.numel() // max(dest.shape[dim], 1)) * dest.element_size()


def _gemm(name: str, args) -> Tuple[float, str]:
    a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
    batch = a.shape[0] if a.dim() == 3 else 1
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    shape = f"[{m}x{k}]·[{k}x{n}]" + (f" x{batch}" if batch > 1 else "")
    return 2.0 * batch * m * n * k, shape


def format_traffic(traffic: Dict[str, Any]) -> str:
    """The table ``shardfc plan --bytes`` prints: one row per kernel (GEMMs per shape)."""
    lines = [
        f"HBM traffic of one step (rank 0; L2 model of {format_bytes(traffic['l2_bytes'])}; time on paper at "
        f"{HBM_BYTES_PER_S / 1e12:.1f} TB/s and {MATMUL_FLOPS_PER_S / 1e12:.0f} TFLOP/s, launch overheads left out):",
        "",
        "| kernel | shape | launches | HBM read | HBM written | from L2 | TFLOP | ms on paper |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    small = [r for r in traffic["kernels"] if not r["fused"] and not r["shape"]
             and r["read"] + r["written"] + r["from_l2"] < SMALL_ROW_BYTES]
    rows = [r for r in traffic["kernels"] if all(r is not x for x in small)]
    if small:
        rows.append(dict(kernel=f"{len(small)} other torch operators", shape="", fused=False,
                         **{k: sum(r[k] for r in small) for k in ("launches", "read", "written", "from_l2", "flops", "ms")}))
    for r in rows:
        name = r["kernel"] + (" (fused)" if r["fused"] else "")
        lines.append(f"| {name} | {r['shape']} | {r['launches']:,} | {format_bytes(r['read'])} | "
                     f"{format_bytes(r['written'])} | {format_bytes(r['from_l2'])} | {r['flops'] / 1e12:.3f} | {r['ms']:.3f} |")
    lines.append(f"| **step** | | **{traffic['launches']:,}** | **{format_bytes(traffic['read'])}** | "
                 f"**{format_bytes(traffic['written'])}** | {format_bytes(traffic['from_l2'])} | "
                 f"{traffic['flops'] / 1e12:.3f} | **{traffic['ms']:.2f}** |")
    lines.append(f"HBM bytes a step: {traffic['hbm_bytes'] / 1e9:.2f} GB "
                 f"(largest region a torch operator touched: {format_bytes(traffic['largest_torch_region'])})")
    return "\n".join(lines)


def chunk_candidates(runs: Dict[int, Tuple[Dict[str, Any], int]]) -> Dict[str, Any]:
    """One row per chunk scale from ``runs`` (scale -> (its step's :func:`summarise`, its step
    peak in bytes)): launches, HBM bytes, GPU ms on paper, host issue ms (launches ×
    :data:`HOST_LAUNCH_US`), the step on paper — the slower of the two, as the host issues while
    the GPU runs — and ``pick``: the scale with the least step on paper (ties, to 1 ns: the smaller
    scale). What ``impl="auto"`` times on the device; the paper is what a plan can say."""
    rows = []
    for scale, (t, peak) in sorted(runs.items()):
        host = t["launches"] * HOST_LAUNCH_US / 1e3
        rows.append(dict(scale=scale, launches=t["launches"], hbm_bytes=t["hbm_bytes"], gpu_ms=t["ms"], host_ms=host,
                         step_ms=max(t["ms"], host), step_peak=int(peak)))
    pick = min(rows, key=lambda r: (round(r["step_ms"], 6), r["scale"]))["scale"] if rows else None
    return dict(host_launch_us=HOST_LAUNCH_US, rows=rows, pick=pick)


def format_chunk_candidates(c: Dict[str, Any]) -> str:
    """The table ``shardfc plan --bytes`` prints for the GPU paths' chunk scales."""
    lines = [
        f"Chunk sizes (the GPU paths' chunks as multiples of the L2-sized one; host issue at {c['host_launch_us']:g} µs a "
        "launch; a step takes the slower of GPU and host):",
        "",
        "| scale | launches | HBM bytes | GPU ms on paper | host issue ms | step ms on paper | step peak |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in c["rows"]:
        mark = " (picked)" if r["scale"] == c["pick"] else ""
        lines.append(f"| {r['scale']}{mark} | {r['launches']:,} | {r['hbm_bytes'] / 1e9:.2f} GB | {r['gpu_ms']:.2f} | "
                     f"{r['host_ms']:.2f} | {r['step_ms']:.2f} | {format_bytes(r['step_peak'])} |")
    lines.append(f"on paper: scale {c['pick']}; impl='auto' times every scale on the device and keeps the fastest")
    return "\n".join(lines)


def summarise(step: StepTraffic) -> Dict[str, Any]:
    """:class:`StepTraffic` as the plan's ``traffic`` dict (JSON-ready)."""
    kernels = step.table()
    return dict(
        l2_bytes=step.l2_bytes, kernels=kernels, launches=len(step.launches),
        read=int(step.total("read")), written=int(step.total("written")), from_l2=int(step.total("from_l2")),
        hbm_bytes=int(step.total("hbm")), flops=step.total("flops"), ms=sum(x.ms for x in step.launches),
        largest_torch_region=max((x.largest for x in step.launches if not x.fused), default=0),
    )


__all__ = ["DEFAULT_L2_BYTES", "HBM_BYTES_PER_S", "HOST_LAUNCH_US", "chunk_candidates", "format_chunk_candidates", "Launch", "MATMUL_FLOPS_PER_S", "StepTraffic", "TrafficCounter",
           "format_traffic", "summarise"]
