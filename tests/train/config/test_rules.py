"""``TrainConfig.validate``'s rules, one at a time: each value a choice names is accepted, each bound
is accepted at its value and refused one step past it, and each refusal is one message, word for word.
``test_config.py`` holds the reading of TOML files, presets and flags."""

from __future__ import annotations

import dataclasses
import math

import pytest

from shardfc.train.config import MAX_EMBEDDING_DIM, MAX_IMAGE_SIDE, ConfigError, TrainConfig


def _refused(**fields) -> str:
    with pytest.raises(ConfigError) as info:
        TrainConfig(**fields).validate()
    return str(info.value)


# ------------------------------------------------------------------ choices

#: Each choice field, its values, and what else a value needs to validate.
CHOICES = {
    "dataset": {"synthetic": {}, "folder": {"data_root": "d"}, "recordio": {"data_root": "d"},
                "list": {"list_file": "l.txt"}, "market1501": {"data_root": "d"}},
    "sampler": {"random": {}, "pk": {}},
    "loader": {"torch": {}, "auto": {}},  # dali: below (it needs DALI installed)
    "neck": {"auto": {}, "bnneck": {"backbone": "resnet50"}, "none": {"backbone": "resnet50"}},
    "margin": {m: {} for m in ("arcface", "cosface", "sphereface", "combined", "adaface", "magface", "normsoftmax",
                               "softmax")},
    "optimizer": {"sgd": {}, "adamw": {}},
    "scheduler": {"poly": {}, "cosine": {}},
    "strategy": {"ddp": {}, "dp": {}, "horovod": {}, "pipeline": {}},
    "pipeline_schedule": {"gpipe": {}, "1f1b": {}},
    "amp": {"auto": {}, "none": {}, "bf16": {}, "fp16": {}},
    "device": {"auto": {}, "cpu": {}, "cuda": {}},
    "head_impl": {"auto": {}, "triton": {}, "gemm": {}, "torch": {}},
    "head_update": {"auto": {}, "fused": {}, "optimizer": {}},
    "cuda_graph": {"off": {}, "head": {"nproc": 1}},
    "head_dtype": {"float32": {}, "bfloat16": {}, "float16": {}},
    "head_rounding": {"nearest": {}, "stochastic": {}},
    "head_idle_rows": {"exact": {}, "lazy": {}},
    "head_init": {"random": {}, "imprint": {}},
    "on_missing_classes": {"error": {}, "keep": {}, "fresh": {}},
}


@pytest.mark.parametrize("name, value", [(n, v) for n, values in CHOICES.items() for v in values])
def test_each_choice_is_accepted(name, value):
    cfg = TrainConfig(**{name: value, **CHOICES[name][value]}).validate()
    assert getattr(cfg, name) == value


@pytest.mark.parametrize("name", list(CHOICES))
def test_a_value_outside_the_choices_is_refused_naming_them(name):
    choices = ", ".join(CHOICES[name]) if name != "loader" else "torch, dali, auto"
    assert _refused(**{name: "zzz"}) == f"{name} must be one of {choices}; got 'zzz'"
    close = "torch" if name == "loader" else list(CHOICES[name])[-1]
    assert _refused(**{name: close + "x"}) == f"{name} must be one of {choices}; got {close + 'x'!r}; did you mean {close!r}?"


def test_margin_aliases_are_the_margins_they_name():
    assert TrainConfig(margin="amsoftmax").validate().margin == "cosface"


def test_dali_reads_recordio_and_folders_when_installed(monkeypatch):
    from shardfc.train.loader import dali_loader

    monkeypatch.setattr(dali_loader, "dali_missing", lambda: None)
    for dataset in ("recordio", "folder"):
        assert TrainConfig(loader="dali", dataset=dataset, data_root="d").validate().loader == "dali"
    for dataset, more in (("synthetic", {}), ("list", {"list_file": "l"}), ("market1501", {"data_root": "d"})):
        assert _refused(loader="dali", dataset=dataset, **more) == (
            f"loader='dali' reads the 'recordio' and 'folder' datasets, not dataset={dataset!r}")
    monkeypatch.setattr(dali_loader, "dali_missing", lambda: "NVIDIA DALI is not installed: pip install x")
    assert _refused(loader="dali", dataset="recordio", data_root="d") == (
        "loader='dali': NVIDIA DALI is not installed: pip install x")
    assert TrainConfig(loader="auto", dataset="recordio", data_root="d").validate().loader == "auto"


# ------------------------------------------------------------------ bounds

AT_LEAST_1 = ("synthetic_identities", "synthetic_images_per_identity", "embedding_dim", "batch_size", "grad_accum",
              "nproc", "log_every", "eval_batch_size", "subcenters", "pipeline_stages", "micro_batches")
AT_LEAST_0 = ("num_workers", "threads", "max_steps", "epochs", "warmup_steps", "eval_every", "ckpt_every", "keep_last",
              "synthetic_val_pairs", "seed", "head_warmup_steps")


@pytest.mark.parametrize("name, low", [(n, 1) for n in AT_LEAST_1] + [(n, 0) for n in AT_LEAST_0]
                         + [("max_corrupt_images", -1)])
def test_each_count_at_its_least_and_one_below(name, low):
    more = {"max_steps": 1} if name == "epochs" else {}  # not both 0 (below)
    assert getattr(TrainConfig(**{name: low}, **more).validate(), name) == low
    assert _refused(**{name: low - 1}) == f"{name} must be >= {low}, got {low - 1}"


def test_chunk_size_takes_minus_one_for_auto():
    assert TrainConfig(chunk_size=-1).validate().chunk_size == -1
    assert _refused(chunk_size=-2) == "chunk_size must be >= 1, 0 (no chunking) or -1 (auto), got -2"


@pytest.mark.parametrize("name", ["lr", "scale", "eps", "pg_timeout"])
def test_each_positive_number(name):
    assert getattr(TrainConfig(**{name: 1e-12}).validate(), name) == 1e-12
    assert _refused(**{name: 0.0}) == f"{name} must be > 0, got 0.0"
    assert _refused(**{name: math.nan}) == f"{name} must be a finite number, got nan"


@pytest.mark.parametrize("name", ["weight_decay", "grad_clip", "head_grad_clip", "poly_power", "sphereface_lambda"])
def test_each_number_at_least_0(name):
    assert getattr(TrainConfig(**{name: 0.0}).validate(), name) == 0.0
    assert _refused(**{name: -0.5}) == f"{name} must be >= 0, got -0.5"


def test_backbone_lr_mult_at_least_0():
    assert TrainConfig(backbone_lr_mult=0.0).validate().backbone_lr_mult == 0.0
    assert _refused(backbone_lr_mult=-0.5) == "backbone_lr_mult must be >= 0, got -0.5"
    assert _refused(backbone_lr_mult=math.nan) == "backbone_lr_mult must be a finite number, got nan"


@pytest.mark.parametrize("name, low, high, message", [
    ("momentum", 0.0, 0.999, "momentum must be in [0, 1), got {!r}"),
    ("label_smoothing", 0.0, 0.999, "label_smoothing must be in [0, 1), got {!r}"),
])
def test_each_fraction_below_1(name, low, high, message):
    for ok in (low, high):
        assert getattr(TrainConfig(**{name: ok}).validate(), name) == ok
    for bad in (1.0, -0.001):
        assert _refused(**{name: bad}) == message.format(bad)


def test_head_momentum_is_sgds_and_below_1():
    for ok in (-1.0, 0.0, 0.99):
        assert TrainConfig(head_momentum=ok).validate().head_momentum == ok
    assert _refused(head_momentum=1.0) == "head_momentum must be in [0, 1), or negative for momentum's, got 1.0"
    assert TrainConfig(head_momentum=-1.0, optimizer="adamw").validate().optimizer == "adamw"
    assert _refused(head_momentum=0.0, optimizer="adamw") == (
        "head_momentum applies to optimizer='sgd', got optimizer='adamw' (head_momentum=0.0)")


def test_pk_instances_from_2():
    assert TrainConfig(pk_instances=2).validate().pk_instances == 2
    assert _refused(pk_instances=1) == "pk_instances must be >= 2 (an identity needs a positive pair), got 1"


@pytest.mark.parametrize("name", ["random_erasing", "flip_prob"])
def test_each_probability(name):
    for ok in (0.0, 1.0):
        assert getattr(TrainConfig(**{name: ok}).validate(), name) == ok
    for bad in (1.001, -0.001):
        assert _refused(**{name: bad}) == f"{name} must be a probability in [0, 1], got {bad!r}"


def test_interclass_filter_threshold_in_0_1_with_0_off():
    for ok in (0.0, 1.0, 0.3):
        assert TrainConfig(interclass_filter_threshold=ok).validate().interclass_filter_threshold == ok
    for bad in (1.001, -0.001):
        assert _refused(interclass_filter_threshold=bad) == (
            f"interclass_filter_threshold must be in (0, 1] (0: off), got {bad!r}")


def test_betas_are_two_numbers_below_1():
    for ok in ([0.0, 0.999], [0.9, 0.0]):
        assert TrainConfig(betas=ok).validate().betas == ok
    for bad in ([0.9], [0.9, 0.99, 0.9], [0.9, 1.0], [-0.1, 0.9]):
        assert _refused(betas=bad) == f"betas must be two numbers in [0, 1), got {bad!r}"


def test_image_size_is_two_sides_within_the_cap():
    for ok in ([], [1, MAX_IMAGE_SIDE], [MAX_IMAGE_SIDE, 1]):
        assert TrainConfig(image_size=ok).validate().image_size == ok
    for bad in ([112], [112, 112, 3], [0, 5], [5, 0], [5, MAX_IMAGE_SIDE + 1], [MAX_IMAGE_SIDE + 1, 5]):
        assert _refused(image_size=bad) == (
            f"image_size must be empty or two ints 'H W' in [1, {MAX_IMAGE_SIDE}], got {bad!r}")


def test_embedding_dim_within_the_cap():
    assert TrainConfig(embedding_dim=MAX_EMBEDDING_DIM).validate().embedding_dim == MAX_EMBEDDING_DIM
    assert _refused(embedding_dim=MAX_EMBEDDING_DIM + 1) == (
        f"embedding_dim must be <= {MAX_EMBEDDING_DIM}, got {MAX_EMBEDDING_DIM + 1}")


def test_pg_timeout_seed_and_threads_within_what_torch_takes():
    """Past these, every rank's group init overflowed (pg_timeout 1e15), a seed past int64 failed in a
    rank's generator ('Overflow when unpacking long long'), and 100,000 threads killed the process."""
    top = TrainConfig(pg_timeout=1e9, seed=2**63 - 1, threads=1024).validate()
    assert (top.pg_timeout, top.seed, top.threads) == (1e9, 2**63 - 1, 1024)
    assert _refused(pg_timeout=1000000000.5) == "pg_timeout must be at most 1e+09 seconds (31 years), got 1000000000.5"
    assert _refused(seed=2**63) == ("seed must be at most 2**63 - 1 (torch's generators take a signed 64-bit seed), "
                                    "got 9223372036854775808")
    assert _refused(threads=1025) == "threads must be at most 1024 (0: one per core), got 1025"


@pytest.mark.parametrize("name", ["lr", "scale", "weight_decay", "pg_timeout", "m"])
def test_a_number_past_float32s_range_is_refused(name):
    """lr 1e308 raised 'value cannot be converted to type float without overflow' in the first step."""
    assert _refused(**{name: 1e39}) == f"{name} must be within float32's range (|x| <= 3.4e38), got 1e+39"
    assert _refused(**{name: -1e39}) == f"{name} must be within float32's range (|x| <= 3.4e38), got -1e+39"


def test_float32s_largest_is_the_bound():
    import numpy as np

    from shardfc.train.config import fields

    assert fields.FLOAT32_MAX == float(np.finfo(np.float32).max)
    assert _refused(betas=[0.9, fields.FLOAT32_MAX * 1.0000001]).startswith("betas must be within float32's range")
    TrainConfig(lr=0.1, weight_decay=fields.FLOAT32_MAX).validate()  # at the bound: taken by this rule


def test_how_long_to_train_is_said_once_at_least():
    assert TrainConfig(max_steps=1, epochs=0).validate().max_steps == 1
    assert TrainConfig(max_steps=0, epochs=1).validate().epochs == 1
    assert _refused(max_steps=0, epochs=0) == "max_steps and epochs are both 0: set one of them to say how long to train"


# ------------------------------------------------------------------ the head and its margin


def test_sparse_grad_needs_partial_fc_and_no_fp16():
    assert TrainConfig(sparse_grad=True, sample_rate=0.5).validate().sparse_grad
    assert _refused(sparse_grad=True) == "sparse_grad needs Partial FC (sample_rate < 1), got sample_rate=1.0"
    assert _refused(sparse_grad=True, sample_rate=0.5, amp="fp16") == (
        "sparse_grad does not work with amp='fp16' (the loss scaler unscales .grad only): use --amp bf16 or none")
    assert TrainConfig(sparse_grad=True, sample_rate=0.5, amp="bf16").validate().amp == "bf16"


@pytest.mark.parametrize("m", [-1.0, 1.0, 4.0])
def test_sphereface_takes_an_integer_m_from_1(m):
    assert TrainConfig(margin="sphereface", m=m).validate().m == m


@pytest.mark.parametrize("m", [0.0, 0.5, 2.5])
def test_sphereface_refuses_another_m(m):
    assert _refused(margin="sphereface", m=m) == f"m must be an integer >= 1 for margin='sphereface', got {m!r}"


def test_margin_params_per_margin():
    assert TrainConfig(margin="arcface", m=0.0, scale=10.0).margin_params() == {"scale": 10.0, "margin": 0.0,
                                                                               "easy_margin": False}
    assert TrainConfig(margin="arcface", m=-0.5).margin_params()["margin"] == 0.5  # negative: the class's default
    params = TrainConfig(margin="sphereface", m=3.0, sphereface_lambda=2.0).margin_params()
    assert params == {"margin": 3, "lambda_": 2.0} and type(params["margin"]) is int
    assert TrainConfig(margin="normsoftmax", scale=7.0).margin_params() == {"scale": 7.0}
    assert TrainConfig(margin="softmax").margin_params() == {}
    assert TrainConfig(margin="combined", m1=0.9, m2=0.4, m3=0.1).margin_params() == {
        "scale": 32.0, "m1": 0.9, "m2": 0.4, "m3": 0.1}


# ------------------------------------------------------------------ data


@pytest.mark.parametrize("dataset, message", [
    ("recordio", "dataset='recordio' needs data_root (the folder with train.rec and train.idx, or the .rec)"),
    ("folder", "dataset='folder' needs data_root (the folder with one sub-folder per identity)"),
    ("market1501", "dataset='market1501' needs data_root (the folder holding bounding_box_train/)"),
    ("list", "dataset='list' needs list_file (lines of 'path label')"),
])
def test_each_dataset_names_what_it_needs(dataset, message):
    assert _refused(dataset=dataset) == message


def test_synthetic_data_reads_no_data_root():
    assert _refused(data_root="faces") == (
        "data_root='faces' is set but dataset='synthetic' reads no files: pass --dataset folder "
        "(one sub-folder per identity) or --dataset list")
    assert TrainConfig(dataset="list", list_file="l.txt", data_root="base").validate().data_root == "base"


def test_output_dir_is_needed():
    assert _refused(output_dir="") == "output_dir must not be empty"


# ------------------------------------------------------------------ strategies


def test_compile_is_refused_by_dp_only():
    assert _refused(strategy="dp", compile=True) == (
        "compile=True is not supported by strategy='dp': nn.DataParallel's replicas copy the module's compiled "
        "forward, which runs the original module with the first device's weights; use --strategy ddp")
    assert TrainConfig(strategy="ddp", compile=True).validate().compile
    assert TrainConfig(strategy="pipeline", compile=True).validate().compile


def test_a_pipeline_has_two_stages_at_least():
    assert TrainConfig(strategy="pipeline", pipeline_stages=2, micro_batches=2).validate().pipeline_stages == 2
    assert _refused(strategy="pipeline", pipeline_stages=1, micro_batches=2) == (
        "pipeline_stages must be >= 2 for strategy='pipeline' (one stage: use ddp), got 1")
    assert TrainConfig(strategy="ddp", pipeline_stages=1).validate().pipeline_stages == 1  # not a pipeline: unread


def test_a_pipeline_cuts_the_batch_into_equal_micro_batches():
    assert TrainConfig(strategy="pipeline", batch_size=6, micro_batches=3, pipeline_stages=3).validate().micro_batches == 3
    assert _refused(strategy="pipeline", batch_size=7, micro_batches=2) == (
        "batch_size=7 is not divisible by micro_batches=2: pipeline micro-batches have a fixed shape")
    assert TrainConfig(strategy="ddp", batch_size=7, micro_batches=2).validate().batch_size == 7


def test_1f1b_needs_a_micro_batch_per_stage():
    assert _refused(strategy="pipeline", pipeline_stages=3, micro_batches=2) == (
        "pipeline_schedule='1f1b' needs micro_batches >= pipeline_stages, got micro_batches=2 for pipeline_stages=3 "
        "(raise --micro-batches, or --pipeline-schedule gpipe)")
    assert TrainConfig(strategy="pipeline", pipeline_stages=3, micro_batches=2,
                       pipeline_schedule="gpipe").validate().pipeline_schedule == "gpipe"
    assert TrainConfig(strategy="pipeline", pipeline_stages=3, micro_batches=3, batch_size=63).validate().micro_batches == 3


@pytest.mark.parametrize("name, value", [("triplet_weight", 1.0), ("triplet_margin", 0.5), ("triplet_soft", True)])
def test_a_pipeline_refuses_the_triplet_loss(name, value):
    assert _refused(strategy="pipeline", **{name: value}) == (
        f"{name}={value!r} is not supported by strategy='pipeline' (its last stage hands the head the embeddings "
        "only, not the feature before the neck the triplet loss reads): use --strategy ddp")
    assert getattr(TrainConfig(strategy="ddp", **{name: value}).validate(), name) == value


def test_a_pipelines_split_points_name_a_cut_per_stage_boundary():
    assert TrainConfig(strategy="pipeline", split_points=["layer2"]).validate().split_points == ["layer2"]
    assert TrainConfig(strategy="pipeline", pipeline_stages=3, micro_batches=3, batch_size=63,
                       split_points=["a", "b"]).validate().split_points == ["a", "b"]
    assert _refused(strategy="pipeline", split_points=["a", "b"]) == (
        "split_points=['a', 'b'] names 2 cut(s), but pipeline_stages=2 needs 1")
    assert _refused(strategy="pipeline", pipeline_stages=3, micro_batches=3, batch_size=63, split_points=["a"]) == (
        "split_points=['a'] names 1 cut(s), but pipeline_stages=3 needs 2")


def test_imprinting_is_refused_by_a_pipeline():
    assert _refused(strategy="pipeline", head_init="imprint") == (
        "strategy='pipeline' cuts the backbone into stages: head_init='imprint' needs every image's embedding on the "
        "head's ranks, which a pipeline computes only inside its training schedule. Imprint with --strategy ddp "
        "(e.g. --max-steps 1, or the head-only warm-up), then --resume that run with --strategy pipeline: its "
        "checkpoint resumes under any strategy")
    assert TrainConfig(strategy="pipeline", head_init="random").validate().head_init == "random"


# ------------------------------------------------------------------ the fused update and the captured step


@pytest.mark.parametrize("changes, why", [
    (dict(grad_accum=2), "grad_accum=2 (several backward passes add into one step's gradient)"),
    (dict(strategy="pipeline", micro_batches=2), "strategy='pipeline' with micro_batches=2 (a backward per micro-batch)"),
    (dict(head_grad_clip=1.5), "head_grad_clip=1.5 (clipping reads the stored gradient)"),
    (dict(amp="fp16"), "amp='fp16' (the loss scaler unscales and checks the stored gradient)"),
    (dict(head_rounding="stochastic", head_dtype="bfloat16"),
     "head_rounding='stochastic' (the fused update rounds to nearest)"),
    (dict(head_impl="torch"), "head_impl='torch' (the fused update is the GPU implementations')"),
    (dict(device="cpu"), "the run is on the CPU (the fused update needs CUDA)"),
])
def test_each_reason_the_update_cannot_be_fused(changes, why):
    assert TrainConfig(**changes).head_update_not_fusable() == why
    assert _refused(head_update="fused", **changes) == f"head_update='fused': {why}; use head_update 'auto' or 'optimizer'"


@pytest.mark.parametrize("changes", [
    dict(), dict(strategy="pipeline", micro_batches=1, pipeline_schedule="gpipe"), dict(head_grad_clip=0.0),
    dict(amp="bf16"), dict(head_rounding="stochastic"), dict(head_rounding="stochastic", head_dtype="float32"),
    dict(head_dtype="bfloat16"),
    dict(head_impl="gemm"), dict(device="cuda"),
])
def test_what_leaves_the_update_fusable(changes):
    assert TrainConfig(**changes).head_update_not_fusable() is None
    assert TrainConfig(head_update="fused", **changes).validate().head_update == "fused"


def test_the_runs_device_decides_over_the_configs():
    assert TrainConfig(device="cpu").head_update_not_fusable("cuda") is None
    assert TrainConfig(device="cuda").head_update_not_fusable("cpu") == "the run is on the CPU (the fused update needs CUDA)"
    assert TrainConfig(device="auto").head_update_not_fusable("cpu") == "the run is on the CPU (the fused update needs CUDA)"


@pytest.mark.parametrize("strategy", ["dp", "horovod", "pipeline"])
def test_a_captured_step_is_ddps(strategy):
    assert _refused(cuda_graph="head", nproc=1, strategy=strategy) == (
        f"cuda_graph='head' is not supported by strategy={strategy!r}: the captured step is one head on one device in "
        "one process (strategy ddp with nproc 1)")


def test_a_captured_step_with_adamw_needs_partial_fc_for_the_catch_up_refusal():
    assert _refused(cuda_graph="head", nproc=1, optimizer="adamw", sample_rate=0.5) == (
        "cuda_graph='head': optimizer='adamw' with head_idle_rows='exact' under Partial FC (its catch-up iterates a "
        "number of missed steps the host counts; use sgd, or head_idle_rows lazy); use cuda_graph 'off'")
    assert TrainConfig(cuda_graph="head", nproc=1, optimizer="adamw").validate().optimizer == "adamw"  # dense: no catch-up


# ------------------------------------------------------------------ what the config tells the builder


def test_backbone_params():
    assert TrainConfig(backbone="tiny").backbone_params([16, 24]) == {"input_size": (16, 24)}
    assert TrainConfig(backbone="glyphnet").backbone_params((32.0, 32)) == {"input_size": (32, 32)}
    assert TrainConfig(backbone="iresnet50").backbone_params([112, 112]) == {}
    assert TrainConfig(backbone="resnet50", neck="none").backbone_params([256, 128]) == {"neck": "none"}
    assert TrainConfig(backbone="resnet50").backbone_params([256, 128]) == {}


# ------------------------------------------------------------------ finite numbers

#: Every float field (and ``betas``'s numbers), from the dataclass itself: a field added later is covered.
FLOAT_FIELDS = [f.name for f in dataclasses.fields(TrainConfig) if isinstance(f.default, float)]


def test_the_float_fields_are_found():
    assert {"lr", "weight_decay", "grad_clip", "poly_power", "scale", "sample_rate"} <= set(FLOAT_FIELDS)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("name", FLOAT_FIELDS)
def test_a_non_finite_number_is_refused_in_every_float_field(name, value):
    # weight_decay, grad_clip, poly_power... took NaN (they were compared with < 0) and trained to NaN.
    assert _refused(**{name: value}) == f"{name} must be a finite number, got {value!r}"


@pytest.mark.parametrize("betas", [[0.9, math.nan], [math.inf, 0.999]])
def test_a_non_finite_beta_is_refused(betas):
    assert _refused(betas=betas) == f"betas must be a finite number, got {betas!r}"
