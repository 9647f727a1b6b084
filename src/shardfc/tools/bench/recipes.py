"""``shardfc bench --recipes``: one training workload under each multi-device recipe, measured.

A recipe is a launcher and a strategy of ``shardfc train`` (:data:`RECIPES`, a small registry:
a new strategy is one entry). Every recipe runs the real CLI as a subprocess, with ``--profile``,
its own output folder and its output in a log file; the numbers are read back from the
``profile/rank<R>.json`` files the trainer writes (:mod:`shardfc.train.observe.profile`). Each recipe runs
once per precision: ``fp32`` and ``amp`` (``--amp fp16`` with loss scaling on CUDA, ``--amp bf16`` on
the CPU, where fp16 autocast falls back to bf16 anyway).

A recipe that cannot run here is a row with its reason, never dropped: its launcher is missing,
this build of ``shardfc train`` does not accept its flags ("not available in this build: ..."),
the machine lacks what it needs (dp: >= 2 CUDA devices), or its run failed or timed out.

Per row (:data:`ROW_FIELDS`), over the timed steps (after ``warmup`` untimed ones):

* ``step_time_s``: median over steps of the slowest process's step time; ``step_time_std_s``
  the standard deviation of the same per-step values;
* ``samples_per_s``: images per step over all processes / ``step_time_s``;
* ``peak_rss_bytes_per_process``: each process's peak resident set size (its whole life);
  ``cuda_peak_bytes_per_process``: ``max_memory_allocated`` on CUDA, else None;
* ``comm_bytes_per_step``: the largest over processes of the median bytes a process
  communicated per step; ``comm_bytes_per_step_per_process`` each process's median;
  ``stage_bytes_per_step_per_process``: of those, what each process sent to its neighbouring
  pipeline stages (activations forward, their gradients backward; None for the recipes without
  stages), so the table shows what pipelining moves against what DDP all-reduces;
  ``comm_counted`` is False where the strategy's own traffic is not counted (dp's DataParallel
  copies).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from shardfc.checks import check_int, check_names, check_positive_int

#: the fields of one recipe row, in order (the JSON holds exactly these)
ROW_FIELDS = (
    "recipe", "launcher", "strategy", "precision", "processes", "status", "reason",
    "step_time_s", "step_time_std_s", "samples_per_s", "peak_rss_bytes_per_process",
    "cuda_peak_bytes_per_process", "comm_bytes_per_step", "comm_bytes_per_step_per_process",
    "stage_bytes_per_step_per_process", "comm_counted", "wall_s", "command", "log",
)
PRECISIONS = ("fp32", "amp")


@dataclass(frozen=True)
class Workload:
    """What every recipe trains: the same model, data, batch, steps and seed."""

    nproc: int = 2
    backbone: str = "resnet50"
    image_size: tuple = (32, 32)
    batch_size: int = 16
    classes: int = 1000
    embedding_dim: int = 128
    steps: int = 8
    warmup: int = 2
    seed: int = 0
    threads: int = 1
    device: str = "auto"

    def train_args(self, output_dir: Path) -> List[str]:
        """``shardfc train`` flags of the workload (strategy and launcher come from the recipe)."""
        images_per_class = max(2, -(-self.batch_size * self.nproc * (self.steps + self.warmup) // self.classes))
        return [
            "--dataset", "synthetic", "--synthetic-identities", str(self.classes),
            "--synthetic-images-per-identity", str(images_per_class), "--synthetic-val-pairs", "0",
            "--backbone", self.backbone, "--image-size", str(self.image_size[0]), str(self.image_size[1]),
            "--embedding-dim", str(self.embedding_dim), "--batch-size", str(self.batch_size),
            "--max-steps", str(self.steps + self.warmup), "--warmup-steps", "0", "--lr", "0.01",
            "--seed", str(self.seed), "--device", self.device, "--eval-every", "0", "--ckpt-every", "0",
            "--keep-last", "1", "--log-every", str(self.steps + self.warmup), "--no-progress", "--profile",
            "--resume", "none", "--output-dir", str(output_dir),
        ]


@dataclass(frozen=True)
class Recipe:
    """A way to run ``shardfc train`` on several devices."""

    name: str
    launcher: str  # "torchrun" | "spawn" | "horovodrun" | "one process"
    strategy: str
    flags: Callable[[int], List[str]]  # nproc -> the recipe's own train flags
    processes: Optional[Callable[[int], int]]  # nproc -> processes that train (profile files); None: as the run writes
    about: str


def _many(n: int) -> int:
    return n


def _one(n: int) -> int:
    return 1


RECIPES: Dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("ddp-torchrun", "torchrun", "ddp", lambda n: ["--strategy", "ddp"], _many,
               "DistributedDataParallel, one process per rank started by torchrun"),
        Recipe("ddp-spawn", "spawn", "ddp", lambda n: ["--strategy", "ddp", "--nproc", str(n)], _many,
               "DistributedDataParallel, one process per rank spawned by `shardfc train --nproc N`"),
        Recipe("dp", "one process", "dp", lambda n: ["--strategy", "dp"], _one,
               "nn.DataParallel: one process drives every visible CUDA device"),
        Recipe("horovod", "horovodrun", "horovod", lambda n: ["--strategy", "horovod"], _many,
               "Horovod DistributedOptimizer, one process per rank started by `horovodrun --gloo`"),
        # 2 micro-batches per batch; BatchNorm normalises each on its own (--micro-batch-stats), so the
        # step equals ddp's with half the batch and 2 accumulation steps.
        Recipe("pipeline", "spawn", "pipeline",
               lambda n: ["--strategy", "pipeline", "--pipeline-stages", "2", "--micro-batches", "2",
                          "--micro-batch-stats", "--nproc", str(n)], None,
               "the backbone cut into 2 stages (torch.distributed.pipelining, 1F1B over 2 micro-batches), "
               "nproc/2 data-parallel replicas"),
    )
}


def parse_recipes(names: Optional[str]) -> List[str]:
    """``"a,b"`` (or None: all) -> checked list of :data:`RECIPES` names."""
    if names is None:
        return list(RECIPES)
    return check_names("recipes", names, list(RECIPES))


def parse_precisions(text: str) -> List[str]:
    chosen = [p.strip() for p in text.split(",") if p.strip()]
    if not chosen or any(p not in PRECISIONS for p in chosen) or len(set(chosen)) != len(chosen):
        raise ValueError(f"precisions must be a comma-separated subset of {','.join(PRECISIONS)}, got {text!r}")
    return chosen


def amp_flag(device: str) -> str:
    """The ``--amp`` value of the ``amp`` precision: fp16 (with loss scaling) on CUDA, bf16 on the CPU."""
    import torch

    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    return "fp16" if cuda else "bf16"


# ---------------------------------------------------------------------- why a recipe cannot run


def horovodrun_path() -> Optional[str]:
    beside = Path(sys.executable).with_name("horovodrun")  # the launcher of this interpreter's venv
    return str(beside) if beside.is_file() else shutil.which("horovodrun")


def launcher_missing(recipe: Recipe) -> Optional[str]:
    """Why ``recipe``'s launcher cannot start here, or None."""
    if recipe.launcher != "horovodrun":
        return None
    try:
        import horovod.torch as hvd
    except ImportError as e:
        return f"horovod.torch is not importable ({e})"
    if not hvd.gloo_built():
        return "horovod is built without Gloo (`horovodrun --gloo` needs it)"
    if horovodrun_path() is None:
        return "the `horovodrun` launcher is not on PATH"
    return None


def train_refuses(argv: Sequence[str]) -> Optional[str]:
    """Why ``shardfc train argv`` would stop before training, or None: the config checks the CLI
    runs first (flags and values this build accepts), then whether this machine can run the strategy."""
    from shardfc.train.builder.strategy import dp_devices
    from shardfc.train.config import ConfigError, parse_config

    try:
        cfg, _ = parse_config(list(argv))
        cfg.validate()
    except ConfigError as e:
        return f"not available in this build: shardfc train: {e}"
    if cfg.strategy == "dp":
        try:
            dp_devices(cfg)
        except ConfigError as e:
            return f"cannot run here: {e}"
    return None


def check_workload(work: Workload, work_dir: Path) -> None:
    """A ValueError naming what is wrong with the workload itself, raised once before anything runs
    (the recipes and the split sweep both train it)."""
    from shardfc.models import input_size
    from shardfc.train.builder.factory import resolve_image_size
    from shardfc.train.config import parse_config
    from shardfc.train.loader.data import train_dataset

    for name in ("nproc", "batch_size", "classes", "embedding_dim", "steps", "threads"):
        check_positive_int(name, getattr(work, name))  # before train_args divides by the classes
    check_int("warmup", work.warmup, 0)
    input_size(work.backbone)  # names the valid backbones
    cfg, _ = parse_config(RECIPES["ddp-spawn"].flags(work.nproc) + work.train_args(work_dir / "check"))
    cfg.validate()
    train_dataset(cfg, resolve_image_size(cfg))  # the face backbones take only their own input size; the
    # synthetic identities need 4x4 pixels or more


# ---------------------------------------------------------------------- running one recipe


def command(recipe: Recipe, work: Workload, output_dir: Path) -> List[str]:
    train = ["-m", "shardfc", "train", *recipe.flags(work.nproc), *work.train_args(output_dir)]
    if recipe.launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={work.nproc}", *train]
    if recipe.launcher == "horovodrun":
        return [horovodrun_path() or "horovodrun", "-np", str(work.nproc), "--gloo", sys.executable, *train]
    return [sys.executable, *train]


def _env(threads: int) -> Dict[str, str]:
    import shardfc

    src = str(Path(shardfc.__file__).resolve().parents[1])  # this shardfc, in every process
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join([src] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _run(cmd: List[str], log: Path, threads: int, timeout_s: float) -> Optional[int]:
    """Run ``cmd`` with its output in ``log``; its exit code, or None when it timed out (then killed)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(threads), start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the ranks it started
            proc.wait()
            return None


def _why_failed(log: Path, lines: int = 3) -> str:
    """The CLI's one-line error if a process printed one (any launcher's prefix cut), else the log's last lines."""
    text = [t for t in log.read_text(errors="replace").splitlines() if t.strip()]
    marker = "shardfc train: error:"
    errors = [t[t.index(marker):] for t in text if marker in t]
    return errors[0] if errors else " | ".join(text[-lines:])


def run_recipe(recipe: Recipe, precision: str, work: Workload, work_dir: Path, timeout_s: float) -> Dict[str, Any]:
    """One row: ``recipe`` at ``precision``, measured, or the reason it could not be."""
    name = f"{recipe.name}-{precision}"
    out, log = work_dir / name, work_dir / f"{name}.log"
    cmd = command(recipe, work, out)
    # fp32 says so: the trainer's default ('auto') is bf16 on a GPU that has it.
    cmd += ["--amp", amp_flag(work.device) if precision == "amp" else "none"]
    row: Dict[str, Any] = dict.fromkeys(ROW_FIELDS)
    row.update(recipe=recipe.name, launcher=recipe.launcher, strategy=recipe.strategy,
               precision="fp32" if precision == "fp32" else f"{amp_flag(work.device)} autocast",
               processes=recipe.processes(work.nproc) if recipe.processes else None, command=" ".join(cmd), log=str(log))
    reason = launcher_missing(recipe) or train_refuses(cmd[cmd.index("train") + 1:])
    if reason:
        return dict(row, status="unavailable", reason=reason)
    if out.exists():
        shutil.rmtree(out)  # a fresh run: no stale profile files
    start = time.perf_counter()
    code = _run(cmd, log, work.threads, timeout_s)
    row["wall_s"] = time.perf_counter() - start
    if code != 0:
        why = f"timed out after {timeout_s:g} s" if code is None else f"exit code {code}"
        return dict(row, status="failed", reason=f"{why}: {_why_failed(log)} (log: {log})")
    try:
        return dict(row, status="ok", **measure(out, row["processes"], work.warmup))
    except ValueError as e:
        return dict(row, status="failed", reason=f"{e} (log: {log})")


def measure(output_dir: Path, processes: Optional[int], warmup: int) -> Dict[str, Any]:
    """The row's measurements from the ``profile/rank<R>.json`` files of one run (see the module
    docstring); ``processes``: how many files the run must have written (None: at least one)."""
    files = sorted((Path(output_dir) / "profile").glob("rank*.json"))
    if (processes is None and not files) or (processes is not None and len(files) != processes):
        raise ValueError(f"expected {processes or 'some'} profile file(s) in {output_dir}/profile, found {len(files)}")
    ranks = [json.loads(f.read_text()) for f in files]
    steps = len(ranks[0]["step_s"])
    if steps <= warmup or any(len(r["step_s"]) != steps for r in ranks):
        raise ValueError(f"the profiles hold {[len(r['step_s']) for r in ranks]} steps; need > {warmup} on every process")
    slowest = [max(r["step_s"][i] for r in ranks) for i in range(warmup, steps)]
    step_time = statistics.median(slowest)
    samples = statistics.median(ranks[0]["samples"][warmup:])
    cuda = [r["cuda_peak_bytes"] for r in ranks]
    return {
        "processes": len(ranks),
        "step_time_s": step_time,
        "step_time_std_s": statistics.pstdev(slowest),
        "samples_per_s": samples / step_time if step_time > 0 else None,
        "peak_rss_bytes_per_process": [r["peak_rss_bytes"] for r in ranks],
        "cuda_peak_bytes_per_process": None if any(c is None for c in cuda) else cuda,
        "comm_bytes_per_step": max(int(statistics.median(r["comm_bytes"][warmup:])) for r in ranks),
        "comm_bytes_per_step_per_process": [int(statistics.median(r["comm_bytes"][warmup:])) for r in ranks],
        "stage_bytes_per_step_per_process": _stage_bytes(ranks, warmup),
        "comm_counted": all(r["backbone_traffic_counted"] for r in ranks),
    }


#: the ``--profile`` kinds of the pipeline's stage-to-stage traffic (:mod:`shardfc.parallel.pipeline`)
STAGE_KINDS = ("pipeline_activations", "pipeline_activation_grads")


def _stage_bytes(ranks: Sequence[Dict[str, Any]], warmup: int) -> Optional[List[int]]:
    """Each process's median bytes per step sent to its neighbouring stages; None without stages."""
    if not all(r.get("strategy") == "pipeline" for r in ranks):
        return None
    out = []
    for r in ranks:
        per_step = r.get("comm_bytes_by_kind_per_step")
        if per_step is None:
            raise ValueError(f"rank {r.get('rank')}'s profile has no per-step traffic by kind (an older shardfc?)")
        out.append(int(statistics.median(sum(step.get(k, 0) for k in STAGE_KINDS) for step in per_step[warmup:])))
    return out


def run_recipes(
    names: Sequence[str],
    precisions: Sequence[str],
    work: Workload,
    work_dir: Path,
    timeout_s: float = 600.0,
    progress: bool = True,
) -> List[Dict[str, Any]]:
    """Every recipe of ``names`` at every precision of ``precisions``: one row each, in that order."""
    check_workload(work, Path(work_dir))
    rows = []
    for name in names:
        for precision in precisions:
            if progress:
                print(f"[bench --recipes] {name} {precision} ...", file=sys.stderr, flush=True)
            row = run_recipe(RECIPES[name], precision, work, Path(work_dir), timeout_s)
            if progress:
                done = f"{row['step_time_s']:.3f} s/step" if row["status"] == "ok" else f"{row['status']}: {row['reason']}"
                print(f"[bench --recipes]   {done}", file=sys.stderr, flush=True)
            rows.append(row)
    return rows
