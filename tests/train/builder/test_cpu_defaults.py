"""CPU performance defaults: threads per process, and the precision chosen where bf16 is not native."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from shardfc.train.builder import cpu
from shardfc.train.builder.factory import resolve_amp_dtype
from shardfc.train.config import ConfigError, TrainConfig, parse_config
from shardfc.train.loop import train

from ..tiny import tiny_config

CPU = torch.device("cpu")
EMULATED = (False, "torch CPU capability AVX2, no avx512_bf16/amx_bf16/bf16 among the CPU flags")


@pytest.fixture(autouse=True)
def _keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_come_from_the_flag_then_omp_num_threads_then_cores_per_process():
    assert cpu.resolve_threads(3, processes=2, cores=16, env={"OMP_NUM_THREADS": "5"}) == (3, "--threads")
    n, why = cpu.resolve_threads(0, processes=2, cores=16, env={"OMP_NUM_THREADS": "5"})
    assert (n, why) == (5, "OMP_NUM_THREADS=5")
    assert cpu.resolve_threads(0, processes=4, cores=16, env={}) == (4, "16 usable core(s) / 4 process(es) on this machine")
    assert cpu.resolve_threads(0, processes=3, cores=2, env={})[0] == 1  # never 0
    n, why = cpu.resolve_threads(0, processes=2, cores=8, env={"OMP_NUM_THREADS": "lots"})
    assert n == 4 and "'lots' is not a positive integer, ignored" in why
    # "²" is a digit to str.isdigit but no number to int(): it stopped the run with a bare ValueError
    n, why = cpu.resolve_threads(0, processes=2, cores=8, env={"OMP_NUM_THREADS": "²"})
    assert n == 4 and "'²' is not a positive integer, ignored" in why
    n, why = cpu.resolve_threads(0, processes=2, cores=8, env={"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2"})
    assert n == 1 and "torchrun sets 1" in why and "--threads N overrides" in why


def test_processes_on_this_machine_per_launcher():
    assert cpu.local_processes("ddp", 4, env={"LOCAL_WORLD_SIZE": "2"}) == 2  # torchrun over 2 machines
    assert cpu.local_processes("ddp", 3, env={}) == 3  # spawned with --nproc 3
    assert cpu.local_processes("dp", 1, env={}) == 1
    assert cpu.local_processes("ddp", 1, env={}) == 1
    assert cpu.local_processes("ddp", 3, env={"LOCAL_WORLD_SIZE": "²"}) == 3  # not a count: as if unset


def test_threads_flag_is_validated():
    cfg, _ = parse_config(["--threads", "3", "--nproc", "1"])
    assert cfg.threads == 3
    with pytest.raises(ConfigError, match="threads must be >= 0, got -1"):
        TrainConfig(threads=-1).validate()


def test_cpu_flags_are_read_from_cpuinfo(tmp_path, monkeypatch):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile\n\nprocessor\t: 1\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve\n")
    assert "amx_bf16" in cpu._cpuinfo_flags(str(x86)) and cpu._cpuinfo_flags(str(arm)) == {"fp", "asimd", "sve"}
    assert cpu._cpuinfo_flags(str(tmp_path / "missing")) is None
    monkeypatch.setattr(cpu, "_cpuinfo_flags", lambda: {"avx2", "fma"})
    native, found = cpu.bf16_support()
    assert native is False and "no avx512_bf16" in found and torch.backends.cpu.get_cpu_capability() in found
    monkeypatch.setattr(cpu, "_cpuinfo_flags", lambda: {"avx512f", "avx512_bf16"})
    assert cpu.bf16_support()[0] is True
    monkeypatch.setattr(cpu, "_cpuinfo_flags", lambda: None)
    assert cpu.bf16_support()[0] is None


@pytest.mark.parametrize("support", [(True, "flags avx512_bf16"), (None, "unknown")], ids=["native", "unknown"])
def test_where_bf16_is_native_or_unknown_fp16_falls_back_to_bf16(support, monkeypatch, caplog):
    monkeypatch.setattr(cpu, "bf16_support", lambda: support)
    with caplog.at_level(logging.WARNING, logger="shardfc.train"):
        assert resolve_amp_dtype(TrainConfig(amp="bf16"), CPU) is torch.bfloat16
        assert caplog.text == ""
        assert resolve_amp_dtype(TrainConfig(amp="fp16"), CPU) is torch.bfloat16
    assert "using bf16 autocast instead" in caplog.text


def test_without_native_bf16_bf16_warns_and_fp16_trains_in_fp32(monkeypatch, caplog):
    monkeypatch.setattr(cpu, "bf16_support", lambda: EMULATED)
    with caplog.at_level(logging.WARNING, logger="shardfc.train"):
        assert resolve_amp_dtype(TrainConfig(amp="bf16"), CPU) is torch.bfloat16  # as asked, with a warning
    assert "amp='bf16' on a CPU without native bf16 (torch CPU capability AVX2" in caplog.text
    assert "slower than in fp32" in caplog.text and "--amp none" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shardfc.train"):
        assert resolve_amp_dtype(TrainConfig(amp="fp16"), CPU) is None
    assert "training in fp32, the faster of the two" in caplog.text and "no avx512_bf16" in caplog.text
    assert resolve_amp_dtype(TrainConfig(amp="none"), CPU) is None


def test_a_run_says_its_threads_and_precision_once(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu, "bf16_support", lambda: EMULATED)
    cfg = tiny_config(tmp_path / "run", nproc=1, max_steps=2, grad_accum=1, synthetic_val_pairs=0, amp="fp16",
                      threads=1, eval_every=0)
    assert train(cfg)["step"] == 2
    assert torch.get_num_threads() == 1
    log = (tmp_path / "run" / "train.log").read_text()
    assert log.count("threads: 1 per process (--threads)") == 1
    assert log.count("training in fp32, the faster of the two") == 1 and "precision fp32" in log


def test_cpuinfo_is_read_whatever_its_bytes_and_by_default_from_proc(tmp_path):
    """A byte that is not UTF-8 (a vendor string) is replaced, not an error; a flag with a colon in it
    is kept whole (the key ends at the first colon); the default is this machine's /proc/cpuinfo."""
    odd = tmp_path / "odd"
    odd.write_bytes(b"model name\t: Vendor \xff\xfe CPU\nflags\t\t: fpu sse4:2 avx512_bf16\n")
    assert cpu._cpuinfo_flags(str(odd)) == {"fpu", "sse4:2", "avx512_bf16"}
    if os.path.isfile("/proc/cpuinfo"):
        assert cpu._cpuinfo_flags() == cpu._cpuinfo_flags("/proc/cpuinfo") is not None


def test_bf16_support_says_what_it_found(monkeypatch):
    capability = torch.backends.cpu.get_cpu_capability()
    monkeypatch.setattr(cpu, "_cpuinfo_flags", lambda: {"avx512_bf16", "amx_bf16"})
    assert cpu.bf16_support() == (True, f"torch CPU capability {capability}, CPU flags avx512_bf16, amx_bf16")
    monkeypatch.setattr(cpu, "_cpuinfo_flags", lambda: {"avx2"})
    assert cpu.bf16_support() == (
        False, f"torch CPU capability {capability}, no avx512_bf16/amx_bf16/bf16 among the CPU flags")
    monkeypatch.setattr(cpu, "_cpuinfo_flags", lambda: None)
    monkeypatch.setattr(cpu.platform, "machine", lambda: "")
    assert cpu.bf16_support() == (None, f"torch CPU capability {capability} on an unknown CPU")
    monkeypatch.setattr(cpu.platform, "machine", lambda: "riscv64")
    assert cpu.bf16_support() == (None, f"torch CPU capability {capability} on riscv64")


def test_usable_cores_from_the_affinity_mask_else_the_cpu_count(monkeypatch):
    monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda pid: {5}, raising=False)
    assert cpu.usable_cores() == 1
    monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert cpu.usable_cores() == 3

    def refused(pid):
        raise OSError("not here")

    monkeypatch.setattr(cpu.os, "sched_getaffinity", refused, raising=False)
    for count, usable in ((3, 3), (1, 1), (None, 1)):  # None: the count is unknown
        monkeypatch.setattr(cpu.os, "cpu_count", lambda: count)
        assert cpu.usable_cores() == usable
    monkeypatch.delattr(cpu.os, "sched_getaffinity", raising=False)  # not Linux
    assert cpu.usable_cores() == 1


def test_local_processes_under_horovod_and_never_fewer_than_one(monkeypatch):
    from types import SimpleNamespace

    from shardfc.train.builder import strategy

    local = SimpleNamespace(local_size=lambda: 2)
    monkeypatch.setattr(strategy, "import_horovod", lambda: local)
    assert cpu.local_processes("horovod", 8, env={}) == 2
    local.local_size = lambda: 0
    assert cpu.local_processes("horovod", 8, env={}) == 1
    assert cpu.local_processes("ddp", 4, env={"LOCAL_WORLD_SIZE": "0"}) == 1
    assert cpu.local_processes("dp", 3, env={}) == 1  # one process drives every device
    assert cpu.local_processes("ddp", 0, env={}) == 1


def test_threads_said_in_full():
    assert cpu.resolve_threads(0, processes=2, cores=8, env={"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2"}) == (
        1, "OMP_NUM_THREADS=1 (torchrun sets 1 when it is unset; --threads N overrides)")
    assert cpu.resolve_threads(0, processes=2, cores=8, env={"OMP_NUM_THREADS": "0"}) == (
        4, "8 usable core(s) / 2 process(es) on this machine; OMP_NUM_THREADS='0' is not a positive integer, ignored")
    assert cpu.resolve_threads(0, processes=2, cores=7, env={}) == (3, "7 usable core(s) / 2 process(es) on this machine")


@pytest.mark.parametrize("strategy, world, threads", [("dp", 4, 6), ("ddp", 3, 2)])
def test_apply_threads_divides_this_machines_cores_among_its_processes(monkeypatch, strategy, world, threads):
    for key in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(cpu, "usable_cores", lambda: 6)
    processes = 6 // threads
    assert cpu.apply_threads(0, strategy, world) == (
        f"threads: {threads} per process (6 usable core(s) / {processes} process(es) on this machine)")
    assert torch.get_num_threads() == threads
