"""``shardfc train --strategy ddp | dp | horovod``: the same loss curve, checkpoints and resume, clear errors.

Processes: one 2-rank ddp run (spawned), one horovodrun -np 2 run of the same config and its
resume from the middle, one horovod world of one outside horovodrun. dp needs >= 2 GPUs; here it is
tested for its error, and its code path (DataParallel is a pass-through without CUDA, the head in
devices mode over two CPU "devices", its checkpoints) on the CPU.
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from shardfc.checkpoint import find_checkpoints
from shardfc.cli import train as train_cli
from shardfc.train.builder import strategy as strategy_module
from shardfc.train.config import ConfigError, TrainConfig, parse_config, to_toml
from shardfc.train.loop import load_parts, train

from ..tiny import STEPS, tiny_config

RTOL = 1e-4


def _losses(out: Path) -> dict:
    rows = csv.DictReader(open(Path(out) / "metrics.csv"))
    return {int(r["step"]): float(r["value"]) for r in rows if r["name"] == "train/loss"}


def _head(ckpt: Path) -> dict:
    """The logical head state of a checkpoint: every rank's file, concatenated in class order."""
    files = sorted(ckpt.glob("head_*.pt"), key=lambda p: int(p.stem.split("_")[1]))
    shards = [torch.load(p, weights_only=False)["tensors"] for p in files]
    return {k: torch.cat([s[k] for s in shards]) for k in shards[0]}


def _horovod_train(horovodrun, cfg: TrainConfig, log: Path, *flags: str):
    config = Path(cfg.output_dir).parent / f"{Path(cfg.output_dir).name}.toml"
    config.write_text(to_toml(cfg))
    code, text = horovodrun(2, ["-m", "shardfc", "train", "--config", str(config), *flags], log, timeout_s=600)
    assert code == 0, f"horovodrun exited with {code} (None: timed out):\n{text[-4000:]}"
    return text


# ---------------------------------------------------------------------------- config and launch errors


def test_strategy_flag_and_choices():
    cfg, _ = parse_config(["--strategy", "horovod"])
    assert cfg.strategy == "horovod" and TrainConfig().strategy == "ddp"
    with pytest.raises(ConfigError, match=r"strategy must be one of ddp, dp, horovod, pipeline; got 'horovd'; did you mean 'horovod'\?"):
        parse_config(["--strategy", "horovd"])


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine can run dp")
def test_dp_without_two_gpus_says_why_and_what_to_use(tmp_path, capsys):
    cfg = tiny_config(tmp_path / "dp", strategy="dp")
    with pytest.raises(ConfigError, match=r"nn\.DataParallel .* replicates nothing\. Use --strategy ddp"):
        train_cli.run(cfg)
    assert not (tmp_path / "dp").exists()  # refused before anything started
    assert train_cli.main(["--strategy", "dp", "--device", "cpu", "--output-dir", str(tmp_path / "dp")]) == 2
    err = capsys.readouterr().err
    assert "shardfc train: error: strategy='dp'" in err and "device='cpu' was asked for" in err


def test_horovod_not_installed_says_how_to_install(tmp_path, monkeypatch):
    def missing():
        raise ImportError("Horovod with PyTorch support is not importable here (No module named 'horovod'); "
                          "install it with `bash scripts/install_horovod.sh` ...")

    monkeypatch.setattr(strategy_module, "import_horovod", missing)
    with pytest.raises(ConfigError, match=r"strategy='horovod' needs Horovod: .*bash scripts/install_horovod\.sh"):
        train_cli.run(tiny_config(tmp_path / "h", strategy="horovod"))


def test_wrong_launcher_for_the_strategy(tmp_path, monkeypatch):
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=r"strategy='horovod' under torchrun: launch it with `horovodrun -np N"):
        train_cli.run(tiny_config(tmp_path / "h", strategy="horovod"))
    with pytest.raises(ConfigError, match=r"strategy='dp' is one process driving every GPU"):
        train_cli.run(tiny_config(tmp_path / "d", strategy="dp"))


# ---------------------------------------------------------------------------- dp's code path on the CPU


@pytest.fixture
def dp_on_two_cpu_devices(monkeypatch):
    """dp with two CPU "devices": the backbone in a (pass-through) DataParallel, the head in devices mode."""
    monkeypatch.setattr(strategy_module, "_dp_device_list", lambda cfg: [torch.device("cpu"), torch.device("cpu")])


def test_dp_code_path_trains_checkpoints_and_resumes(dp_on_two_cpu_devices, run2, tmp_path):
    cfg = tiny_config(tmp_path / "dp", strategy="dp", max_steps=3, ckpt_every=0, eval_every=0, synthetic_val_pairs=0)
    summary = train_cli.run(cfg)  # nproc=2 is not used: one process
    assert summary["step"] == 3
    log = (tmp_path / "dp" / "train.log").read_text()
    assert "1 rank(s) on 2 cpu devices (no process group), strategy dp" in log
    assert "of 32 images (16 per rank x 1 rank(s) x 2 accumulated)" in log  # batch_size is per device
    ckpt = Path(summary["checkpoint"])
    saved = _head(ckpt)
    assert saved["weight"].shape == (24, 16) and saved["optimizer.momentum_buffer"].shape == (24, 16)

    # Its own checkpoint and a 2-rank ddp one both load into the two shards, row for row.
    for source in (ckpt, Path(run2[0].output_dir) / "checkpoints" / "step_00000003"):
        parts, state = load_parts(dataclasses.replace(cfg, output_dir=str(tmp_path / "load")), source)
        expected = _head(source)
        assert parts.head.mode == "devices" and len(parts.head.shard_weights) == 2
        assert torch.equal(torch.cat([w.detach() for w in parts.head.shard_weights]), expected["weight"])
        momentum = torch.cat([parts.opt_head.state[w]["momentum_buffer"] for w in parts.head.shard_weights])
        assert torch.equal(momentum, expected["optimizer.momentum_buffer"])
        assert state.step == int(source.name.split("_")[1])

    # Training on from its checkpoint: 3 more steps.
    more = train(dataclasses.replace(cfg, max_steps=6))
    assert more["step"] == 6


def test_dp_replicas_compute_in_the_callers_autocast_dtype(monkeypatch):
    """DataParallel's replica threads start with the default autocast dtype; ours pass the caller's on."""
    import threading

    def threaded_parallel_apply(self, replicas, inputs, kwargs):  # torch's, minus the devices: a thread per replica
        out = [None] * len(replicas)

        def work(i):
            with torch.autocast("cpu", enabled=True):  # what torch re-enters: the flag, not the dtype
                out[i] = replicas[i](*inputs[i], **kwargs[i])

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(replicas))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    monkeypatch.setattr(torch.nn.DataParallel, "parallel_apply", threaded_parallel_apply)
    lin = torch.nn.Linear(4, 4)
    dp = strategy_module.AutocastDataParallel(lin)
    dp.src_device_obj = torch.device("cpu")  # set by DataParallel only when it has devices
    x = ((torch.randn(2, 4),), (torch.randn(2, 4),))
    torch.set_autocast_dtype("cpu", torch.float16)  # this thread's choice; a new thread defaults to bf16
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            outs = dp.parallel_apply([lin, lin], x, [{}, {}])
        plain = threaded_parallel_apply(dp, [lin, lin], x, [{}, {}])
    finally:
        torch.set_autocast_dtype("cpu", torch.bfloat16)
    assert [o.dtype for o in outs] == [torch.float16, torch.float16]
    assert [o.dtype for o in plain] == [torch.bfloat16, torch.bfloat16]  # what plain DataParallel would do


# ---------------------------------------------------------------------------- the same run under ddp and horovod


@pytest.fixture(scope="module")
def ddp_and_horovod(horovodrun, tmp_path_factory):
    """The tiny run, logged every step, under ddp (2 spawned processes) and horovod (horovodrun -np 2).

    Without gradient clipping: clipped at every step, a backbone gradient W times too large (a sum
    where an average is due) would give the same updates. The clipping under Horovod is tested in
    tests/head/test_module_horovod.py.
    """
    root = tmp_path_factory.mktemp("strategies")
    ddp = tiny_config(root / "ddp", log_every=1, grad_clip=0.0)
    train_cli.run(ddp)
    hvd = dataclasses.replace(ddp, output_dir=str(root / "horovod"), strategy="horovod")
    log = _horovod_train(horovodrun, hvd, root / "horovod.log")
    return ddp, hvd, log


def test_horovod_run_has_the_ddp_loss_curve(ddp_and_horovod):
    ddp, hvd, log = ddp_and_horovod
    assert "shardfc train: 2 rank(s) on cpu (horovod), strategy horovod" in log
    assert log.count("shardfc train: 2 rank(s)") == 1  # rank 0 alone logs
    a, b = _losses(ddp.output_dir), _losses(hvd.output_dir)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([b[s] for s in sorted(b)], [a[s] for s in sorted(a)], rtol=RTOL)


def test_horovod_checkpoints_equal_ddp_checkpoints(ddp_and_horovod):
    ddp, hvd, _ = ddp_and_horovod
    names = [p.name for p in find_checkpoints(Path(hvd.output_dir) / "checkpoints")]
    assert names == ["step_00000003", "step_00000006"]
    for name in names:
        a = _head(Path(ddp.output_dir) / "checkpoints" / name)
        b = _head(Path(hvd.output_dir) / "checkpoints" / name)
        assert set(a) == set(b) and b["weight"].shape == (24, 16)
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=RTOL, atol=1e-6, msg=f"{name} {key}")
        common = torch.load(Path(hvd.output_dir) / "checkpoints" / name / "common.pt", weights_only=False)
        assert common["world_size"] == 2


def test_horovod_resume_continues_the_same_curve(ddp_and_horovod, horovodrun, tmp_path):
    _, hvd, _ = ddp_and_horovod
    out = tmp_path / "resumed"
    shutil.copytree(hvd.output_dir, out)
    step3 = out / "checkpoints" / "step_00000003"
    resumed = dataclasses.replace(hvd, output_dir=str(out), resume=str(step3))
    log = _horovod_train(horovodrun, resumed, tmp_path / "resume.log")
    assert "restored step 3" in log
    # metrics.csv keeps the copied run's steps up to the checkpoint (1..3), then the resumed run's.
    rows = [r for r in csv.DictReader(open(out / "metrics.csv")) if r["name"] == "train/loss"]
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    again = [(int(r["step"]), float(r["value"])) for r in rows[3:]]
    assert [s for s, _ in again] == [4, 5, 6]
    uninterrupted = _losses(hvd.output_dir)
    np.testing.assert_allclose([v for _, v in again], [uninterrupted[s] for s, _ in again], rtol=RTOL)
    final = _head(out / "checkpoints" / "step_00000006")
    torch.testing.assert_close(final["weight"], _head(Path(hvd.output_dir) / "checkpoints" / "step_00000006")["weight"],
                               rtol=RTOL, atol=1e-6)


def test_horovod_outside_horovodrun_is_a_world_of_one(horovodrun, tmp_path):
    cfg = tiny_config(tmp_path / "one", strategy="horovod", max_steps=2, ckpt_every=0, eval_every=0,
                      synthetic_val_pairs=0)
    config = tmp_path / "one.toml"
    config.write_text(to_toml(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[3] / "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "shardfc", "train", "--config", str(config)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "outside horovodrun: training as a world of one process" in done.stderr
    assert "shardfc train: 1 rank(s) on cpu (horovod), strategy horovod" in done.stderr
    assert [p.name for p in find_checkpoints(tmp_path / "one" / "checkpoints")] == ["step_00000002"]


# ---------------------------------------------------------------------------- the strategy's questions, in this process
# (What the spawned and horovodrun runs above decide, asked here with the launcher's environment and
# CUDA stood in for: mutation testing traces only the test's own process.)

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "HOROVOD_RANK",
                 "OMPI_COMM_WORLD_RANK", "PMI_RANK")


@pytest.fixture
def launched(monkeypatch):
    """``launched("torchrun" | "horovodrun" | None)``: this process as if that launcher started it."""
    def launch(by):
        for key in LAUNCHER_VARS:
            monkeypatch.delenv(key, raising=False)
        if by == "torchrun":
            for key, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
                monkeypatch.setenv(key, value)
        elif by == "horovodrun":
            monkeypatch.setenv("HOROVOD_RANK", "0")
    launch(None)
    return launch


class FakeHorovod:
    """What the strategy asks of ``horovod.torch``, recorded."""

    Average = "average"

    def __init__(self):
        self.calls = []
        self.initialized = False

    def is_initialized(self):
        return self.initialized

    def init(self):
        self.calls.append("init")
        self.initialized = True

    def local_rank(self):
        return 3

    def local_size(self):
        return 2

    def broadcast_parameters(self, state, root_rank):
        self.calls.append(("broadcast_parameters", sorted(state), root_rank))

    def broadcast_optimizer_state(self, opt, root_rank):
        self.calls.append(("broadcast_optimizer_state", opt, root_rank))

    def DistributedOptimizer(self, opt, named_parameters, op, backward_passes_per_step):
        self.calls.append(("DistributedOptimizer", opt, [n for n, _ in named_parameters], op, backward_passes_per_step))
        return "wrapped"


@pytest.fixture
def hvd(monkeypatch):
    fake = FakeHorovod()
    monkeypatch.setattr(strategy_module, "import_horovod", lambda: fake)
    return fake


def test_launch_checks_say_what_to_use_instead(launched, hvd, caplog, monkeypatch):
    check = strategy_module.check_launch
    dp_refused = ("strategy='dp' is one process driving every GPU; do not start it under torchrun or horovodrun "
                  "(use --strategy ddp under torchrun, --strategy horovod under horovodrun)")
    for by in ("torchrun", "horovodrun"):
        launched(by)
        with pytest.raises(ConfigError) as err:
            check(TrainConfig(strategy="dp"))
        assert str(err.value) == dp_refused
    with pytest.raises(ConfigError) as err:
        check(TrainConfig(strategy="pipeline"))
    assert str(err.value) == "strategy='pipeline' runs over torch.distributed: launch it with --nproc or torchrun"
    launched("torchrun")
    with pytest.raises(ConfigError) as err:
        check(TrainConfig(strategy="horovod"))
    assert str(err.value) == ("strategy='horovod' under torchrun: launch it with `horovodrun -np N --gloo shardfc train "
                              "--strategy horovod ...`, or use --strategy ddp under torchrun")
    # pipeline: its layout is checked before any process starts, with --nproc; under torchrun, by the ranks
    bad = TrainConfig(strategy="pipeline", pipeline_stages=2, nproc=3, micro_batches=2, batch_size=8,
                      micro_batch_stats=True)
    monkeypatch.setenv("WORLD_SIZE", "3")  # torchrun's world as --nproc says (one that disagrees: refused, below)
    check(bad)
    launched(None)
    with pytest.raises(ConfigError, match=r"^strategy='pipeline' on 3 rank\(s\) with backbone='tiny': "):
        check(bad)
    check(dataclasses.replace(bad, nproc=2))
    # horovod outside horovodrun: a world of one, said once; under horovodrun, nothing said
    with caplog.at_level(logging.WARNING, logger="shardfc.train"):
        check(TrainConfig(strategy="horovod"))
        assert caplog.messages == [
            "strategy='horovod' outside horovodrun: training as a world of one process (--nproc is not used). "
            "For N processes: horovodrun -np N --gloo shardfc train --strategy horovod ..."]
        caplog.clear()
        launched("horovodrun")
        check(TrainConfig(strategy="horovod"))
        assert caplog.messages == []


@pytest.mark.parametrize("available, count, device, where", [
    (False, 4, "auto", "CUDA is not available here"),
    (True, 1, "auto", "this machine has 1 CUDA device(s)"),
    (True, 0, "auto", "CUDA is not available here"),
    (True, 2, "cpu", "device='cpu' was asked for"),
])
def test_dp_needs_two_cuda_devices_and_says_what_it_found(monkeypatch, available, count, device, where):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    with pytest.raises(ConfigError) as err:
        strategy_module.dp_devices(TrainConfig(strategy="dp", device=device))
    assert str(err.value) == (
        "strategy='dp' replicates the backbone over CUDA devices with nn.DataParallel in one process and shards "
        f"the head over them, but {where}: on the CPU or a single device DataParallel replicates nothing. Use "
        "--strategy ddp (one process per device or CPU share: --nproc N, or torchrun), or --strategy horovod "
        "under horovodrun")


@pytest.mark.parametrize("count", [2, 3])
def test_dp_replicates_over_every_visible_cuda_device(monkeypatch, count):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    for device in ("auto", "cuda"):
        assert strategy_module.dp_devices(TrainConfig(strategy="dp", device=device)) == [
            torch.device("cuda", i) for i in range(count)]


def test_the_signal_deadline_is_horovodruns_only(launched):
    assert strategy_module.signal_deadline_note() is None
    launched("horovodrun")
    assert strategy_module.signal_deadline_note() == (
        "horovodrun kills its workers 5 s after passing a stop signal on, and the checkpoint comes first "
        "(metrics.csv holds every value: shardfc.train.observe.runlog.plot_metrics draws it)")


def test_a_restore_under_horovod_broadcasts_rank_0s_backbone_and_its_optimizer_once_it_has_state(hvd):
    from types import SimpleNamespace

    module = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    parts = SimpleNamespace(module=module, opt_backbone=opt)
    strategy_module.sync_after_restore(SimpleNamespace(is_horovod=False), parts)
    assert hvd.calls == []
    strategy_module.sync_after_restore(SimpleNamespace(is_horovod=True), parts)
    assert hvd.calls == [("broadcast_parameters", ["bias", "weight"], 0)]  # no state yet: not broadcast
    module(torch.ones(1, 2)).sum().backward()
    opt.step()
    hvd.calls.clear()
    strategy_module.sync_after_restore(SimpleNamespace(is_horovod=True), parts)
    assert hvd.calls == [("broadcast_parameters", ["bias", "weight"], 0), ("broadcast_optimizer_state", opt, 0)]


@pytest.mark.parametrize("device, available, wanted", [
    ("cuda", True, True), ("cuda", False, True), ("auto", True, True), ("auto", False, False),
    ("cpu", True, False), ("cpu", False, False),
])
def test_cuda_is_wanted_when_asked_for_or_auto_finds_it(monkeypatch, device, available, wanted):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    assert strategy_module.wants_cuda(TrainConfig(device=device)) is wanted


class StubContext:
    """``DistContext``'s constructors, their arguments returned."""

    backend = "gloo"

    def __init__(self, device=None):
        self.made = ("plain", device)

    @classmethod
    def resolve(cls, group, device):
        ctx = cls()
        ctx.made = ("resolve", group, device)
        return ctx

    @classmethod
    def horovod(cls, device):
        ctx = cls()
        ctx.made = ("horovod", device)
        return ctx


@pytest.fixture
def fake_cuda(monkeypatch):
    """``fake_cuda(available, count)``: torch.cuda as a machine with ``count`` devices would answer."""
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.setattr(strategy_module, "DistContext", StubContext)
    chosen = []

    def fake(available, count=0):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: chosen[-1] if chosen else 0)
    fake.chosen = chosen
    return fake


def test_the_run_context_on_the_device_asked_for(fake_cuda):
    run_context = strategy_module.run_context
    fake_cuda(False)
    with pytest.raises(ConfigError) as err:
        run_context(TrainConfig(device="cuda"), None)
    assert str(err.value) == "device='cuda' but CUDA is not available here; use --device cpu or auto"
    assert run_context(TrainConfig(device="auto"), "group").made == ("resolve", "group", torch.device("cpu"))
    assert torch.backends.cudnn.benchmark is False
    fake_cuda(True, 2)
    assert run_context(TrainConfig(device="auto"), None).made == ("resolve", None, torch.device("cuda", 0))
    assert torch.backends.cudnn.benchmark is True
    StubContext.backend = "nccl"
    try:
        with pytest.raises(ConfigError) as err:
            run_context(TrainConfig(device="cpu"), None)
        assert str(err.value) == "the process group uses NCCL but device is the CPU; use gloo for CPU runs"
        assert run_context(TrainConfig(device="cuda"), None).made[2] == torch.device("cuda", 0)
    finally:
        StubContext.backend = "gloo"


def test_the_dp_context_is_its_first_device_in_one_process(fake_cuda, monkeypatch):
    devices = [torch.device("cpu"), torch.device("meta")]
    monkeypatch.setattr(strategy_module, "_dp_device_list", lambda cfg: devices)
    assert strategy_module.run_context(TrainConfig(strategy="dp", device="cpu"), None).made == ("plain", devices[0])
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    with pytest.raises(ConfigError) as err:
        strategy_module.run_context(TrainConfig(strategy="dp", device="cpu"), None)
    assert str(err.value) == "strategy='dp' is one process; torch.distributed is initialised here (use --strategy ddp)"


def test_the_horovod_context_inits_horovod_once_on_its_local_device(fake_cuda, hvd, monkeypatch):
    run_context = strategy_module.run_context
    cfg = TrainConfig(strategy="horovod", device="auto")
    fake_cuda(False)
    assert run_context(cfg, None).made == ("horovod", torch.device("cpu"))
    assert hvd.calls == ["init"]
    assert run_context(cfg, None).made == ("horovod", torch.device("cpu")) and hvd.calls == ["init"]
    fake_cuda(True, 2)
    assert run_context(cfg, None).made == ("horovod", torch.device("cuda", 1))  # local rank 3 of 2 devices
    assert fake_cuda.chosen == [1]
    refused = "strategy='horovod' but a torch.distributed group is in use; use --strategy ddp with it"
    with pytest.raises(ConfigError) as err:
        run_context(cfg, "group")
    assert str(err.value) == refused
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    with pytest.raises(ConfigError) as err:
        run_context(cfg, None)
    assert str(err.value) == refused


def test_dp_loads_a_batch_per_device(monkeypatch):
    monkeypatch.setattr(strategy_module, "_dp_device_list", lambda cfg: [torch.device("cpu")] * 3)
    assert strategy_module.loader_batch_size(TrainConfig(strategy="dp", batch_size=8)) == 24
    assert strategy_module.loader_batch_size(TrainConfig(strategy="ddp", batch_size=8)) == 8


def test_a_horovod_optimizer_is_known_by_both_its_methods():
    class Both:
        def synchronize(self):
            pass

        def skip_synchronize(self):
            pass

    class Synchronize:
        def synchronize(self):
            pass

    class Skip:
        def skip_synchronize(self):
            pass

    assert strategy_module.is_horovod_optimizer(Both())
    assert not strategy_module.is_horovod_optimizer(Synchronize())
    assert not strategy_module.is_horovod_optimizer(Skip())
    assert not strategy_module.is_horovod_optimizer(object())


def test_the_backbone_is_wrapped_as_its_strategy_trains_it(monkeypatch, hvd):
    from types import SimpleNamespace

    import torch.nn.parallel

    monkeypatch.setattr(strategy_module, "AutocastDataParallel",
                        lambda module, device_ids, output_device: ("dp", module, device_ids, output_device))
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel",
                        lambda module, device_ids, process_group: ("ddp", module, device_ids, process_group))
    wrap = strategy_module.wrap_backbone
    backbone = torch.nn.Linear(2, 2)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 1)
    dp = TrainConfig(strategy="dp")
    for devices, ids in (([cpu, cpu], None), ([torch.device("cuda", 0), cuda], [0, 1]), ([cuda, cpu], None)):
        monkeypatch.setattr(strategy_module, "_dp_device_list", lambda cfg: devices if cfg is dp else pytest.fail())
        assert wrap(dp, None, backbone) == ("dp", backbone, ids, ids[0] if ids else None)
    assert wrap(TrainConfig(strategy="horovod"), None, backbone) is backbone
    assert hvd.calls == [("broadcast_parameters", ["bias", "weight"], 0)]
    ranks = SimpleNamespace(distributed=True, world_size=2, device=cpu, group="group")
    assert wrap(TrainConfig(), ranks, backbone) == ("ddp", backbone, None, "group")
    ranks.device = cuda
    assert wrap(TrainConfig(), ranks, backbone) == ("ddp", backbone, [cuda], "group")
    for distributed, world in ((True, 1), (False, 2)):
        assert wrap(TrainConfig(), SimpleNamespace(distributed=distributed, world_size=world, device=cpu),
                    backbone) is backbone


def test_the_head_is_placed_and_the_optimizer_wrapped_as_the_strategy_says(monkeypatch, hvd):
    devices, dp = [torch.device("cpu")] * 2, TrainConfig(strategy="dp")
    monkeypatch.setattr(strategy_module, "_dp_device_list", lambda cfg: devices if cfg is dp else pytest.fail())
    assert strategy_module.head_placement(dp, "ctx") == {"devices": devices}
    for strategy in ("ddp", "horovod", "pipeline"):
        assert strategy_module.head_placement(TrainConfig(strategy=strategy), "ctx") == {"context": "ctx"}
    backbone = torch.nn.Linear(2, 2)
    opt = object()  # the optimizer, passed on as it is
    for strategy in ("ddp", "dp", "pipeline"):
        assert strategy_module.wrap_backbone_optimizer(TrainConfig(strategy=strategy), None, backbone, opt) is opt
    assert hvd.calls == []
    assert strategy_module.wrap_backbone_optimizer(TrainConfig(strategy="horovod", grad_accum=3), None, backbone,
                                                   opt) == "wrapped"
    assert hvd.calls == [("DistributedOptimizer", opt, ["weight", "bias"], "average", 3)]


@pytest.mark.parametrize("strategy", ["ddp", "pipeline"])
def test_an_nproc_that_disagrees_with_torchruns_world_is_refused(launched, monkeypatch, strategy):
    """torchrun makes the ranks: --nproc 4 under a 2-process torchrun was dropped without a word."""
    launched("torchrun")
    monkeypatch.setenv("WORLD_SIZE", "3")
    kw = {}
    for nproc in (1, 4):
        with pytest.raises(ConfigError) as err:
            strategy_module.check_launch(TrainConfig(strategy=strategy, nproc=nproc, **kw))
        assert str(err.value) == (f"--nproc {nproc} under torchrun, which started 3 process(es) (WORLD_SIZE): "
                                  "torchrun's --nproc-per-node and --nnodes set the ranks; leave --nproc out")
    strategy_module.check_launch(TrainConfig(strategy=strategy, nproc=3, **kw))  # the same world
    strategy_module.check_launch(TrainConfig(strategy=strategy, **kw))  # the default: cannot be told from unset
    assert TrainConfig().nproc == 2
    launched(None)
    strategy_module.check_launch(TrainConfig(strategy="ddp", nproc=1))  # spawned: --nproc makes the ranks
