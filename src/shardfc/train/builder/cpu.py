"""CPU performance defaults of a run: intra-op threads per process, and whether bf16 is native.

Threads: every process of a machine runs its own intra-op pool; torch's default (all cores in
every process) oversubscribes the cores as soon as there are two processes. So each process takes
``usable cores // processes on this machine`` threads, unless the user chose: ``--threads N``
first, then ``OMP_NUM_THREADS`` (which torchrun sets to 1 itself when it starts several processes
and the variable is unset). The same rule holds for spawned ranks, torchrun, horovodrun and one
process.

bf16: autocast to bf16 is only fast where the CPU computes in bf16 (x86 ``avx512_bf16`` or
``amx_bf16``, Arm ``bf16``); elsewhere oneDNN converts every operand through fp32 in software and
a step is slower than in fp32.
"""

from __future__ import annotations

import os
import platform
from typing import Mapping, Optional, Tuple

import torch

from shardfc.checks import digits_value

__all__ = ["usable_cores", "local_processes", "resolve_threads", "apply_threads", "bf16_support"]

#: /proc/cpuinfo flags of CPUs that compute in bf16 (x86 AVX512-BF16 / AMX; Arm's feature "bf16").
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. under taskset or a container's cpuset)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def local_processes(strategy: str, world_size: int, env: Mapping[str, str] = os.environ) -> int:
    """Training processes on this machine: torchrun's LOCAL_WORLD_SIZE, Horovod's local size, one for
    'dp', else every rank (spawned here with --nproc)."""
    local = digits_value(env.get("LOCAL_WORLD_SIZE", ""))
    if local is not None:
        return max(1, local)
    if strategy == "horovod":
        from shardfc.train.builder.strategy import horovod_module

        return max(1, horovod_module().local_size())
    return 1 if strategy == "dp" else max(1, world_size)


def resolve_threads(
    threads: int, processes: int, cores: int, env: Mapping[str, str] = os.environ
) -> Tuple[int, str]:
    """``(threads per process, why)``: ``threads`` if > 0, else a valid OMP_NUM_THREADS, else cores // processes."""
    if threads > 0:
        return threads, "--threads"
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if (digits_value(omp) or 0) > 0:
        why = f"OMP_NUM_THREADS={omp}"
        if "LOCAL_WORLD_SIZE" in env:
            why += " (torchrun sets 1 when it is unset; --threads N overrides)"
        return int(omp), why
    ignored = f"; OMP_NUM_THREADS={omp!r} is not a positive integer, ignored" if omp else ""
    return max(1, cores // processes), f"{cores} usable core(s) / {processes} process(es) on this machine{ignored}"


def apply_threads(threads: int, strategy: str, world_size: int) -> str:
    """Set this process's intra-op threads as :func:`resolve_threads` says; returns the log line."""
    processes = local_processes(strategy, world_size)
    n, why = resolve_threads(threads, processes, usable_cores())
    torch.set_num_threads(n)
    return f"threads: {n} per process ({why})"


def _cpuinfo_flags(path: str = "/proc/cpuinfo") -> Optional[set]:
    """The CPU's feature flags (x86 'flags', Arm 'Features'); None where there is no /proc/cpuinfo."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        return None
    return set()


def bf16_support() -> Tuple[Optional[bool], str]:
    """``(native, what was found)``: ``native`` is None where the flags cannot be read (not Linux)."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = _cpuinfo_flags()
    if flags is None:
        return None, f"torch CPU capability {capability} on {platform.machine() or 'an unknown CPU'}"
    found = [f for f in NATIVE_BF16_FLAGS if f in flags]
    if found:
        return True, f"torch CPU capability {capability}, CPU flags {', '.join(found)}"
    return False, f"torch CPU capability {capability}, no {'/'.join(NATIVE_BF16_FLAGS)} among the CPU flags"
