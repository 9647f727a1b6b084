"""Model parallelism in one process: stages, split_model, PipelinedModel, split_bench.

Everything runs on CPU with every "device" being "cpu" (the logic is the same; what moves is
checked by the CUDA tests at the end, which need a GPU). Outputs and gradients are compared
with the unsplit model in float64: bit for bit where the same ops run in the same order
(stages, SplitModel, one micro-batch), to 1e-12 where micro-batches change the summation
order of the parameter gradients.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
from torch import nn

from shardfc.models import BACKBONES, build_backbone, input_size
from shardfc.models.iresnet import IResNet
from shardfc.models.resnet import ReIDResNet
from shardfc.parallel.model_split import (
    PipelinedModel,
    SplitModel,
    Stage,
    _check_not_shared,
    available_split_points,
    model_segments,
    split_model,
    stages,
)

RTOL, ATOL = 1e-12, 1e-12


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # These models are tiny: intra-op threads buy nothing, and on a loaded machine OpenMP's
    # barriers made the file 10x slower. Every comparison runs under the same setting.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --------------------------------------------------------------------------- models
def _shrink_iresnet(model: IResNet, size: int = 16) -> IResNet:
    # IResNet's FC sees the whole final map, which ties it to 112x112. At 16x16 the map is 1x1;
    # swapping in the matching FC keeps the class and its forward, at a fraction of the CPU time.
    model.input_size = (size, size)
    model.fmap_size = (size // 16, size // 16)
    model.fc = nn.Linear(512 * (size // 16) ** 2, model.embedding_dim)
    return model


def _iresnet() -> IResNet:
    """A reduced IResNet (one block per stage) at 16x16."""
    torch.manual_seed(0)
    return _shrink_iresnet(IResNet((1, 1, 1, 1), embedding_dim=8)).double()


def _resnet() -> ReIDResNet:
    """A resnet50-like ReIDResNet (one bottleneck per stage, BNNeck, reduce to 8-d); any input size."""
    torch.manual_seed(0)
    return ReIDResNet((1, 1, 1, 1), embedding_dim=8).double()


def _tiny() -> nn.Module:
    torch.manual_seed(0)
    return build_backbone("tiny", embedding_dim=8, input_size=16, width=4).double()


def _plain() -> nn.Sequential:
    """No batch-coupled layers: micro-batching is exact in training mode too."""
    torch.manual_seed(0)
    return nn.Sequential(
        OrderedDict(
            conv1=nn.Conv2d(3, 4, 3, stride=2, padding=1),
            act1=nn.Tanh(),
            conv2=nn.Conv2d(4, 6, 3, stride=2, padding=1),
            act2=nn.Tanh(),
            pool=nn.AdaptiveAvgPool2d(1),
            flat=nn.Flatten(1),
            fc=nn.Linear(6, 5),
        )
    ).double()


# name -> (builder, input [C, H, W], split points for a 3-device (or 2-device) cut)
MODELS = {
    "iresnet": (_iresnet, (3, 16, 16), ["stem", "layer3"]),
    "resnet": (_resnet, (3, 16, 8), ["layer1", "layer4"]),
    "tiny": (_tiny, (3, 16, 16), ["body"]),
    "plain": (_plain, (3, 8, 8), ["act1", "flat"]),
}


def _warm(model: nn.Module, shape) -> nn.Module:
    """One training-mode forward, so that eval-mode BatchNorms use non-trivial running stats."""
    with torch.no_grad():
        model.train()(torch.randn(6, *shape, dtype=torch.float64))
    return model


def _step(model_fn, params_of: nn.Module, x: torch.Tensor, w: torch.Tensor):
    """Output, input gradient and parameter gradients (by name in ``params_of``) of sum(out * w)."""
    for p in params_of.parameters():
        p.grad = None
    x = x.clone().requires_grad_(True)
    out = model_fn(x)
    (out * w).sum().backward()
    grads = {n: p.grad for n, p in params_of.named_parameters() if p.requires_grad}
    return out.detach(), x.grad, grads


def _assert_same(a, b, exact: bool) -> None:
    (out_a, gx_a, g_a), (out_b, gx_b, g_b) = a, b
    check = (lambda u, v: torch.equal(u, v)) if exact else (lambda u, v: torch.allclose(u, v, rtol=RTOL, atol=ATOL))
    assert check(out_a, out_b), (out_a - out_b).abs().max()
    assert check(gx_a, gx_b), (gx_a - gx_b).abs().max()
    assert g_a.keys() == g_b.keys()
    for n in g_a:
        assert g_a[n] is not None and g_b[n] is not None, n
        assert check(g_a[n], g_b[n]), (n, (g_a[n] - g_b[n]).abs().max())


def _assert_buffers_same(a: nn.Module, b: nn.Module) -> None:
    for (n, u), (_, v) in zip(a.named_buffers(), b.named_buffers()):
        assert torch.equal(u, v), n


# --------------------------------------------------------------------------- stages / segments
def _registry_model(name: str):
    torch.manual_seed(0)
    model = build_backbone(name, embedding_dim=8)
    h, w = input_size(name)
    if isinstance(model, IResNet):
        _shrink_iresnet(model)
        h = w = 16
    elif name == "resnet50":
        h, w = 32, 16  # global pooling: any size
    return model, (3, h, w)


@pytest.mark.parametrize("name", sorted(BACKBONES))
def test_stages_reproduce_forward_for_every_backbone(name: str) -> None:
    model, shape = _registry_model(name)
    points = available_split_points(model)
    assert len(points) >= 1
    if hasattr(type(model), "split_points"):
        assert tuple(type(model).split_points) == points
    cut = stages(model, points)
    assert len(cut) == len(points) + 1
    assert [s.segment_names for s in cut] == [(n,) for n, _ in model_segments(model)]
    # Every parameter and buffer lands in exactly one stage, under the model's own key.
    keys = [k for s in cut for k in s.state_dict()]
    assert sorted(keys) == sorted(model.state_dict()) and len(keys) == len(set(keys))

    x = torch.randn(2, *shape)
    buffers = dict(model.named_buffers())
    for mode in ("train", "eval"):  # train: batch statistics, and running stats updated alike
        model.train(mode == "train")
        before = {n: b.clone() for n, b in buffers.items()}
        with torch.no_grad():
            expected = model(x)
            after = {n: b.clone() for n, b in buffers.items()}
            for n, b in buffers.items():
                b.copy_(before[n])
            y = x
            for s in cut:
                y = s(y)
        assert torch.equal(y, expected), (name, mode)
        for n, b in buffers.items():
            assert torch.equal(b, after[n]), (name, mode, n)


def test_backbone_split_points() -> None:
    assert IResNet.split_points == ("stem", "layer1", "layer2", "layer3", "layer4")
    assert ReIDResNet.split_points == ("stem", "layer1", "layer2", "layer3", "layer4")
    assert available_split_points(build_backbone("tiny")) == ("body",)
    assert available_split_points(build_backbone("mobilefacenet")) == ("stem", "blocks")
    assert available_split_points(build_backbone("mbf")) == ("trunk", "conv_sep")
    assert available_split_points(_plain()) == ("conv1", "act1", "conv2", "act2", "pool", "flat")


def test_stages_group_segments_between_cuts() -> None:
    model = _iresnet()
    cut = stages(model, ["layer1", "layer3"])
    assert [s.segment_names for s in cut] == [("stem", "layer1"), ("layer2", "layer3"), ("layer4", "head")]
    assert all(isinstance(s, Stage) for s in cut)
    assert list(cut[0]._modules) == ["conv1", "bn1", "prelu", "layer1"]
    assert list(cut[2]._modules) == ["layer4", "bn2", "dropout", "flatten", "fc", "features"]
    assert cut[0].conv1 is model.conv1  # shared, not copied
    assert len(stages(model, [])) == 1


# --------------------------------------------------------------------------- split model
@pytest.mark.parametrize("name", sorted(MODELS))
def test_split_model_equals_unsplit_bit_for_bit(name: str) -> None:
    build, shape, points = MODELS[name]
    model = _warm(build(), shape)
    ref = copy.deepcopy(model)
    split = split_model(model, ["cpu"] * (len(points) + 1), points)
    assert isinstance(split, SplitModel) and split.split_points == tuple(points)
    assert split.devices == (torch.device("cpu"),) * (len(points) + 1)
    torch.manual_seed(1)
    x, w = torch.randn(4, *shape, dtype=torch.float64), torch.randn(4, 8 if name != "plain" else 5, dtype=torch.float64)
    # Training mode: BatchNorm on batch statistics, exact because the batch is not cut.
    _assert_same(_step(split, model, x, w), _step(ref, ref, x, w), exact=True)
    _assert_buffers_same(model, ref)
    # The split model's parameters are the model's own.
    assert {id(p) for p in split.parameters()} == {id(p) for p in model.parameters()}


# --------------------------------------------------------------------------- pipelined
@pytest.mark.parametrize("name", ["iresnet", "resnet", "tiny"])
def test_pipelined_equals_unsplit_in_eval(name: str) -> None:
    build, shape, points = MODELS[name]
    model = _warm(build(), shape)
    ref = copy.deepcopy(model).eval()
    piped = PipelinedModel(split_model(model, ["cpu"] * (len(points) + 1), points), split_size=3).eval()
    torch.manual_seed(1)
    x, w = torch.randn(4, *shape, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    expected = _step(ref, ref, x, w)
    # 3 does not divide 4 (micro-batches of 3 and 1); 1 is a micro-batch per row.
    for split_size in (3, 1) if name == "tiny" else (3,):
        piped.split_size = split_size
        _assert_same(_step(piped, model, x, w), expected, exact=False)
    _assert_buffers_same(model, ref)  # eval: running stats untouched


@pytest.mark.parametrize("name", ["iresnet", "resnet", "tiny"])
def test_pipelined_one_micro_batch_is_exact_in_training(name: str) -> None:
    # split_size >= batch: one micro-batch, so BatchNorm sees the full batch; no opt-in needed.
    build, shape, points = MODELS[name]
    model = _warm(build(), shape)
    ref = copy.deepcopy(model)
    piped = PipelinedModel(split_model(model, ["cpu"] * (len(points) + 1), points), split_size=7)
    torch.manual_seed(1)
    x, w = torch.randn(4, *shape, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    _assert_same(_step(piped, model, x, w), _step(ref, ref, x, w), exact=True)
    _assert_buffers_same(model, ref)


@pytest.mark.parametrize("split_size", [1, 2, 3, 4, 6, 7, 50])
def test_pipelined_equals_unsplit_in_training_without_batch_norm(split_size: int) -> None:
    build, shape, points = MODELS["plain"]
    model = build()
    ref = copy.deepcopy(model)
    piped = PipelinedModel(split_model(model, ["cpu"] * 3, points), split_size)
    torch.manual_seed(1)
    x, w = torch.randn(7, *shape, dtype=torch.float64), torch.randn(7, 5, dtype=torch.float64)
    _assert_same(_step(piped, model, x, w), _step(ref, ref, x, w), exact=split_size >= 7)


def test_pipelined_runs_the_wavefront_schedule() -> None:
    split = split_model(_plain(), ["cpu"] * 3, ["act1", "flat"])
    calls: list[tuple[int, torch.Tensor]] = []
    for k, stage in enumerate(split.stages):
        stage.register_forward_pre_hook(lambda mod, args, k=k: calls.append((k, args[0])))
    # Row i is filled with the value i, so stage 0's input names its micro-batch.
    x = torch.arange(4, dtype=torch.float64)[:, None, None, None].expand(4, 3, 8, 8).contiguous()
    PipelinedModel(split, split_size=1)(x)
    assert [int(a[0, 0, 0, 0]) for k, a in calls if k == 0] == [0, 1, 2, 3]
    # Tick t runs stage k on micro-batch t - k, the deepest stage first: while stage k runs
    # micro-batch i, stage k - 1 runs i + 1.
    assert [k for k, _ in calls] == [0, 1, 0, 2, 1, 0, 2, 1, 0, 2, 1, 2]


def test_pipelined_refuses_micro_batch_statistics_by_default() -> None:
    model = _tiny()
    piped = PipelinedModel(split_model(model, ["cpu", "cpu"], ["body"]), split_size=2)
    x = torch.randn(5, 3, 16, 16, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"BatchNorm2d 'stages\.0\.body\.1' normalises with batch statistics.*split_size=2 cuts this batch of 5 rows into 3 micro-batches.*\.eval\(\).*allow_micro_batch_stats=True"):
        piped(x)
    # BatchNorm without running stats uses batch statistics in eval mode too.
    bn_free = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, track_running_stats=False)).double().eval()
    with pytest.raises(RuntimeError, match="BatchNorm1d '.*1' normalises with batch statistics"):
        PipelinedModel(split_model(bn_free, ["cpu", "cpu"], ["0"]), 2)(torch.randn(4, 4, dtype=torch.float64))


def test_pipelined_micro_batch_statistics_on_request_are_gpipes() -> None:
    # allow_micro_batch_stats=True: the unsplit model run on each micro-batch in turn.
    model = _tiny()
    ref = copy.deepcopy(model)
    piped = PipelinedModel(split_model(model, ["cpu", "cpu"], ["body"]), split_size=2, allow_micro_batch_stats=True)
    x = torch.randn(6, 3, 16, 16, dtype=torch.float64)
    piped.split_size = 4  # micro-batches of 4 and 2 rows (BatchNorm1d cannot take 1 in training)
    out = piped(x)
    expected = torch.cat([ref(chunk) for chunk in x.split(4)])
    assert torch.equal(out, expected)
    _assert_buffers_same(model, ref)  # running stats: updated once per micro-batch, in order
    assert not torch.allclose(out, copy.deepcopy(ref)(x))  # and that is not the full-batch forward


def test_pipelined_from_a_list_of_stages() -> None:
    model = _plain()
    ref = copy.deepcopy(model)
    piped = PipelinedModel(stages(model, ["act2"]), split_size=2)  # devices inferred: cpu, cpu
    assert piped.devices == (torch.device("cpu"),) * 2 and piped.split.split_points is None
    x = torch.randn(5, 3, 8, 8, dtype=torch.float64)
    assert torch.allclose(piped(x), ref(x), rtol=RTOL, atol=ATOL)
    with_devices = PipelinedModel(stages(model, ["act2"]), 3, devices=["cpu", "cpu"])
    assert torch.allclose(with_devices(x), ref(x), rtol=RTOL, atol=ATOL)


def test_pipelined_empty_batch_and_split_size_setter() -> None:
    model = _plain()
    piped = PipelinedModel(split_model(model, ["cpu"] * 3, ["act1", "flat"]), 2)
    assert piped(torch.randn(0, 3, 8, 8, dtype=torch.float64)).shape == (0, 5)
    piped.split_size = 5
    assert piped.split_size == 5
    with pytest.raises(ValueError, match=r"split_size must be a positive int \(rows per micro-batch\), got 0"):
        piped.split_size = 0


# --------------------------------------------------------------------------- errors
def test_split_point_errors() -> None:
    model = _iresnet()
    with pytest.raises(ValueError, match=r"split_points: unknown split point 'layer5' for IResNet; valid split points, in forward order: stem, layer1, layer2, layer3, layer4; did you mean 'layer4'\?$"):
        split_model(model, ["cpu", "cpu"], ["layer5"])
    with pytest.raises(ValueError, match=r"split_points: unknown split point 'fc' for IResNet"):
        stages(model, ["fc"])
    with pytest.raises(ValueError, match=r"split_points: 'head' is the last segment of IResNet, so nothing follows it"):
        split_model(model, ["cpu", "cpu"], ["head"])
    with pytest.raises(ValueError, match=r"split_points lists 'layer2' more than once: \['layer2', 'layer2'\]"):
        split_model(model, ["cpu"] * 3, ["layer2", "layer2"])
    with pytest.raises(ValueError, match=r"split_points must be in forward order \(stem, layer1, layer2, layer3, layer4\), got \['layer3', 'layer1'\]"):
        split_model(model, ["cpu"] * 3, ["layer3", "layer1"])
    with pytest.raises(TypeError, match=r"split_points must be a sequence of segment names \(e\.g\. \['layer2'\]\), got 'layer2'"):
        split_model(model, ["cpu", "cpu"], "layer2")
    with pytest.raises(TypeError, match=r"split_points\[1\] must be a segment name \(str\), got 3"):
        split_model(model, ["cpu"] * 3, ["layer2", 3])
    with pytest.raises(ValueError, match=r"valid split points, in forward order: \(none: the model is a single segment\)"):
        stages(nn.Sequential(nn.Linear(2, 2)), ["0"])


def test_device_errors() -> None:
    model = _tiny()
    with pytest.raises(ValueError, match=r"devices: got 3 \(\['cpu', 'cpu', 'cpu'\]\) but len\(split_points\) \+ 1 \(split_points=\['body'\]\) = 2, one device per stage"):
        split_model(model, ["cpu"] * 3, ["body"])
    with pytest.raises(ValueError, match=r"devices: got 1 .* = 2"):
        split_model(model, ["cpu"], ["body"])
    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU: never exists
    with pytest.raises(ValueError, match=rf"devices\[1\]='{missing}' does not exist: this machine has "):
        split_model(model, ["cpu", missing], ["body"])
    with pytest.raises(ValueError, match=r"devices\[0\]='cpu:1' does not exist: there is one CPU device"):
        split_model(model, ["cpu:1", "cpu"], ["body"])
    with pytest.raises(ValueError, match=r"devices\[1\]='gpu0' is not a device"):
        split_model(model, ["cpu", "gpu0"], ["body"])
    with pytest.raises(ValueError, match=r"devices\[1\]='meta': the meta device holds no data"):
        split_model(model, ["cpu", "meta"], ["body"])
    with pytest.raises(TypeError, match=r"devices must be a sequence with one device per stage .*, got 'cpu'"):
        split_model(model, "cpu", ["body"])
    with pytest.raises(ValueError, match=r"devices: got 1 .* but len\(stages\) = 2"):
        SplitModel(stages(model, ["body"]), ["cpu"])
    # Nothing moved or changed on error: the model still runs whole.
    model.eval()(torch.randn(1, 3, 16, 16, dtype=torch.float64))


@pytest.mark.parametrize("bad", [0, -2, 2.5, 4.0, True, "4", None])
def test_split_size_errors(bad) -> None:
    split = split_model(_plain(), ["cpu", "cpu"], ["pool"])
    with pytest.raises(ValueError, match=rf"split_size must be a positive int \(rows per micro-batch\), got {repr(bad).replace('.', '[.]')}$"):
        PipelinedModel(split, bad)


def test_model_and_stage_argument_errors() -> None:
    with pytest.raises(TypeError, match=r"Linear declares no segments, so it cannot be cut"):
        split_model(nn.Linear(2, 2), ["cpu"], [])
    with pytest.raises(TypeError, match=r"model must be an nn\.Module, got str"):
        split_model("tiny", ["cpu"], [])
    with pytest.raises(TypeError, match=r"single IResNet; cut it first: PipelinedModel\(split_model\(model, devices, split_points\), split_size\)$"):
        PipelinedModel(_iresnet(), 2)
    split = split_model(_plain(), ["cpu", "cpu"], ["pool"])
    with pytest.raises(ValueError, match=r"^devices: a SplitModel already places its stages; pass devices only with a list of stages$"):
        PipelinedModel(split, 2, devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match=r"cannot infer the device of stages\[1\], which has no parameters or buffers; pass devices"):
        PipelinedModel([nn.Linear(2, 2), nn.Tanh()], 2)
    with pytest.raises(TypeError, match=r"stages_or_split_model\[0\] must be an nn\.Module, got str"):
        PipelinedModel(["x"], 2)
    with pytest.raises(TypeError, match=r"stages must be a sequence of modules, got a single Linear.*; use split_model\(model, devices, split_points\) to cut a model$"):
        SplitModel(nn.Linear(2, 2), ["cpu"])
    with pytest.raises(ValueError, match="^stages is empty: a SplitModel needs at least one stage$"):
        SplitModel([], [])
    with pytest.raises(TypeError, match=r"stages\[1\] must be an nn\.Module, got int"):
        SplitModel([nn.Linear(2, 2), 3], ["cpu", "cpu"])
    with pytest.raises(TypeError, match=r"stage 0's output is a tuple; stages pass a single tensor"):
        SplitModel([_TupleOut(), nn.Identity()], ["cpu", "cpu"])(torch.randn(2, 2))
    with pytest.raises(TypeError, match=r"the input is a list"):
        split([torch.randn(2, 3, 8, 8)])
    shared = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"stages\[0\] and stages\[1\] share the tensor 'weight' but are on different devices \(cpu, meta\)"):
        _check_not_shared([shared, shared], [torch.device("cpu"), torch.device("meta")])
    _check_not_shared([shared, shared], [torch.device("cpu")] * 2)  # same device: fine


class _TupleOut(nn.Module):
    def forward(self, x):
        return x, x


class _Declared(nn.Module):
    def __init__(self, segments) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)
        self.segments = segments

    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize(
    ("segments", "message"),
    [
        ((("one", ("a",)),), r"_Declared\.segments does not place the children \['b'\]"),
        ((("one", ("a",)), ("two", ("a", "b"))), r"child 'a' is in both 'one' and 'two'"),
        ((("one", ("a", "c")), ("two", ("b",))), r"segment 'one' names 'c', which is not a child of the model"),
        ((("one", ("a",)), ("one", ("b",))), r"repeats a segment name: \['one', 'one'\]"),
        ((), r"_Declared\.segments is empty"),
    ],
)
def test_segment_declaration_errors(segments, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        stages(_Declared(segments), [])


def test_model_with_own_parameters_cannot_be_cut() -> None:
    model = _Declared((("one", ("a",)), ("two", ("b",))))
    model.scale = nn.Parameter(torch.ones(1))
    with pytest.raises(ValueError, match=r"holds parameters/buffers directly \(scale\)"):
        stages(model, ["one"])


# --------------------------------------------------------------------------- split_bench
def test_time_split_sweep_smoke() -> None:
    from shardfc.parallel.split_bench import FIELDS, time_split_sweep

    rows = time_split_sweep("tiny", batch=6, image_size=16, devices=["cpu", "cpu"], split_sizes=[2, 4], steps=1, warmup=0)
    assert [(r["config"], r["split_size"]) for r in rows] == [("single", None), ("split", None), ("pipelined", 2), ("pipelined", 4)]
    for r in rows:
        assert tuple(r) == FIELDS
        assert r["model"] == "tiny" and r["batch"] == 6 and r["image_size"] == [16, 16]
        assert len(r["times_s"]) == 1 and r["median_s"] > 0 and r["samples_per_s"] > 0
        assert r["split_points"] == ([] if r["config"] == "single" else ["body"])
        assert r["devices"] == (["cpu"] if r["config"] == "single" else ["cpu", "cpu"])


def test_time_split_sweep_eval_mode_and_errors() -> None:
    from shardfc.parallel.split_bench import time_split_sweep

    rows = time_split_sweep("tiny", 3, (16, 8), ["cpu"] * 2, [1], 1, warmup=0, train=False, split_points=["body"])
    assert [r["config"] for r in rows] == ["single", "split", "pipelined"] and rows[0]["image_size"] == [16, 8]
    with pytest.raises(ValueError, match=r"split_size=2 leaves a 1-row micro-batch \(batch=5\)"):
        time_split_sweep("tiny", 5, 16, ["cpu"] * 2, [2], 1)
    with pytest.raises(ValueError, match=r"split_size must be a positive int"):
        time_split_sweep("tiny", 4, 16, ["cpu"] * 2, [0], 1)
    with pytest.raises(ValueError, match=r"steps must be an integer >= 1, got 0"):
        time_split_sweep("tiny", 4, 16, ["cpu"] * 2, [2], 0)
    with pytest.raises(ValueError, match=r"devices\[1\]='cuda:\d+' does not exist"):
        time_split_sweep("tiny", 4, 16, ["cpu", f"cuda:{torch.cuda.device_count()}"], [2], 1)


def test_balanced_split_points() -> None:
    from shardfc.parallel.split_bench import balanced_split_points

    model = _iresnet()
    sample = torch.randn(1, 3, 16, 16, dtype=torch.float64)
    assert balanced_split_points(model, 1, sample) == []
    assert balanced_split_points(_tiny(), 2, torch.randn(1, 3, 16, 16, dtype=torch.float64)) == ["body"]
    three = balanced_split_points(model, 3, sample)
    assert len(three) == 2 and stages(model, three)  # valid, in forward order
    # All six segments: one per stage.
    assert balanced_split_points(model, 6, sample) == list(available_split_points(model))
    with pytest.raises(ValueError, match=r"n_stages=7 but IResNet has only 6 segments"):
        balanced_split_points(model, 7, sample)
    assert model.training  # restored after counting in eval mode


# --------------------------------------------------------------------------- real devices
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("pipelined", [False, True])
def test_stages_and_activations_move_with_a_second_device_stubbed(pipelined: bool, monkeypatch) -> None:
    """The movement itself, on a CPU-only machine: the meta device stands in for a second device
    (the device check, which refuses meta for real use, is let through). Stage 1 must be moved
    there and every activation must follow it, or its meta weights meet a CPU input and the
    forward fails; the output ends on the last stage's device."""
    from shardfc.parallel import model_split

    monkeypatch.setattr(model_split, "check_devices", lambda devices, n, what: tuple(map(torch.device, devices)))
    split = split_model(_plain(), ["cpu", "meta"], ["act1"])
    assert {p.device.type for p in split.stages[0].parameters()} == {"cpu"}
    assert {p.device.type for p in split.stages[1].parameters()} == {"meta"}
    net = PipelinedModel(split, 2) if pipelined else split
    out = net(torch.randn(5, 3, 8, 8, dtype=torch.float64))
    assert out.device.type == "meta" and out.shape == (5, 5)


@needs_cuda
@pytest.mark.parametrize("pipelined", [False, True])
def test_split_over_cpu_and_cuda_moves_stages_and_activations(pipelined: bool) -> None:
    gpus = [f"cuda:{i}" for i in range(min(torch.cuda.device_count(), 2))]
    devices = ["cpu", *gpus]
    points = ["act1", "flat"][: len(devices) - 1]
    model = _plain()
    ref = copy.deepcopy(model)
    split = split_model(model, devices, points)
    for stage, dev in zip(split.stages, devices):
        assert all(p.device == torch.device(dev) for p in stage.parameters())
    net = PipelinedModel(split, 2) if pipelined else split
    torch.manual_seed(1)
    x, w = torch.randn(5, 3, 8, 8, dtype=torch.float64), torch.randn(5, 5, dtype=torch.float64)
    got = _step(net, model, x, w.to(devices[-1]))
    assert got[0].device == torch.device(devices[-1])
    got = (got[0].cpu(), got[1], {n: g.cpu() for n, g in got[2].items()})
    _assert_same(got, _step(ref, ref, x, w), exact=False)


def test_cuts_between_blocks() -> None:
    torch.manual_seed(0)
    model = _shrink_iresnet(IResNet((2, 2, 2, 2), embedding_dim=8)).double().eval()
    assert available_split_points(model, blocks=True) == (
        "stem", "layer1.0", "layer1", "layer2.0", "layer2", "layer3.0", "layer3", "layer4.0", "layer4")
    cut = stages(model, ["layer2.0", "layer3"])
    assert [s.segment_names for s in cut] == [("stem", "layer1", "layer2[0:1]"), ("layer2[1:2]", "layer3"), ("layer4", "head")]
    assert list(cut[1].layer2._modules) == ["1"] and cut[1].layer2[0] is model.layer2[1]  # keeps its key, shared
    keys = [k for s in cut for k in s.state_dict()]
    assert keys == list(model.state_dict())  # every tensor once, under the model's key, in order
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    with torch.no_grad():
        y = x
        for s in cut:
            y = s(y)
        assert torch.equal(y, model(x))
    with pytest.raises(ValueError, match=r"unknown split point 'layer2.1' for IResNet; .*IResNet may also be cut between "
                                         r"the blocks of layer1, layer2, layer3, layer4 \('layer1.0': after block 0 of layer1\)"):
        stages(model, ["layer2.1"])
    with pytest.raises(ValueError, match=r"split_points must be in forward order"):
        stages(model, ["layer3.0", "layer2.0"])


# --------------------------------------------------------------------------- devices stood in for


def _resolve(value):
    from shardfc.parallel.model_split import _resolve_device

    return _resolve_device(value, "devices[1]")


def test_a_device_type_this_machine_lacks_or_has_too_few_of_is_named_with_what_there_is(monkeypatch) -> None:
    import re
    from types import SimpleNamespace

    with pytest.raises(ValueError, match=r"^devices\[1\]=True is not a device$"):
        _resolve(True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # counted, but not usable: none
    with pytest.raises(ValueError, match=r"^devices\[1\]='cuda:0' does not exist: this machine has no cuda device$"):
        _resolve("cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match=r"^devices\[1\]='cuda:2' does not exist: this machine has 2 cuda device\(s\), "
                                         r"cuda:0 \.\. cuda:1$"):
        _resolve("cuda:2")
    if not torch.backends.cuda.is_built():  # counted but absent: the allocation says so, as one error
        with pytest.raises(ValueError, match=r"^devices\[1\]='cuda:1' is not usable on this machine: \S"):
            _resolve("cuda:1")
    # A backend that counts its devices but has no is_available, and one torch has no module for.
    monkeypatch.setattr(torch, "xpu", SimpleNamespace(device_count=lambda: 1), raising=False)
    with pytest.raises(ValueError, match=re.escape("devices[1]='xpu:1' does not exist: this machine has 1 xpu device(s), xpu:0 .. xpu:0")):
        _resolve("xpu:1")
    monkeypatch.delattr(torch, "hpu", raising=False)
    with pytest.raises(ValueError, match=r"^devices\[1\]='hpu' is not usable on this machine: "):
        _resolve("hpu")


class _Recorder(nn.Module):
    """A stage that keeps the shape of each input it is given."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append(tuple(x.shape))
        return x * 2


def test_micro_batches_are_cut_along_the_first_dimension_and_a_scalar_goes_whole() -> None:
    first, second = _Recorder(), _Recorder()
    piped = PipelinedModel([first, second], 2, devices=["cpu", "cpu"])
    x = torch.arange(5.0)
    assert torch.equal(piped(x), 4 * x)
    assert first.seen == second.seen == [(2,), (2,), (1,)]
    assert torch.equal(piped(torch.tensor(3.0)), torch.tensor(12.0))  # 0-d: one micro-batch, not split
    assert first.seen[-1] == second.seen[-1] == ()


def test_an_input_or_a_stage_output_that_is_not_one_tensor_is_named() -> None:
    piped = PipelinedModel([nn.Identity(), _TupleOut(), nn.Identity()], 2, devices=["cpu"] * 3)
    with pytest.raises(TypeError, match=r"^the input is a list; stages pass a single tensor from one to the next$"):
        piped([torch.ones(2)])
    with pytest.raises(TypeError, match=r"^stage 1's output is a tuple; stages pass a single tensor from one to the next$"):
        piped(torch.ones(2))


def test_the_batch_statistics_refusal_says_all_three_ways_out() -> None:
    model = _tiny().train()
    piped = PipelinedModel(split_model(model, ["cpu", "cpu"], ["body"]), split_size=2)
    with pytest.raises(RuntimeError) as refused:
        piped(torch.randn(5, 3, 16, 16, dtype=torch.float64))
    assert str(refused.value).endswith(
        "cuts this batch of 5 rows into 3 micro-batches, each of which it would normalise with its own statistics, "
        "unlike the unsplit model. Call .eval() (exact), use split_size >= the batch (exact, no pipelining), or "
        "pass allow_micro_batch_stats=True to accept micro-batch statistics (GPipe's behaviour)")


def _refused(call) -> str:
    with pytest.raises((TypeError, ValueError)) as e:
        call()
    return f"{type(e.value).__name__}: {e.value}"


def test_what_cannot_be_cut_is_said_in_full_with_the_way_out() -> None:
    from shardfc.parallel.model_split import FLATTEN

    assert _refused(lambda: model_segments(3)) == "TypeError: model must be an nn.Module, got int"
    assert _refused(lambda: split_model(nn.Linear(2, 2), ["cpu"], [])) == (
        "TypeError: Linear declares no segments, so it cannot be cut: give the class a `segments` attribute (see "
        "shardfc.models.IResNet.segments), or build the model as an nn.Sequential, or cut it yourself and pass the "
        "stage modules to SplitModel")
    own = _Declared((("one", ("a",)), ("two", ("b",))))
    own.scale = nn.Parameter(torch.ones(1))
    own.register_buffer("count", torch.zeros(1))
    assert _refused(lambda: stages(own, ["one"])) == (
        "ValueError: _Declared holds parameters/buffers directly (scale, count), outside any child module, so no "
        "stage could own them")
    reserved = _Declared((("one", ("a",)), ("two", ("b",))))
    reserved.add_module(FLATTEN, nn.Flatten())
    assert _refused(lambda: stages(reserved, ["one"])) == "ValueError: _Declared has a child named 'flatten', a reserved segment item"
    assert _refused(lambda: stages(_Declared((("one", ("a",)),)), [])) == (
        "ValueError: _Declared.segments does not place the children ['b']; every child must be in a segment (else "
        "it would stay behind on its device, unused)")
    for names, why in [(("three",), "is not one of its segments"),
                       (("one",), "is not a single nn.Sequential child: only a plain sequence of blocks can be cut "
                                  "between its blocks")]:
        blocks = _Declared((("one", ("a",)), ("two", ("b",))))
        blocks.block_segments = names
        assert _refused(lambda: stages(blocks, ["one"])) == f"ValueError: _Declared.block_segments names {names[0]!r}, which {why}"
    torch.manual_seed(0)
    model = _shrink_iresnet(IResNet((2, 2, 2, 2), embedding_dim=8)).double().eval()
    assert _refused(lambda: stages(model, ["layer2.1"])) == (
        "ValueError: split_points: unknown split point 'layer2.1' for IResNet; valid split points, in forward order: "
        "stem, layer1, layer2, layer3, layer4; did you mean 'layer2'? IResNet may also be cut between the blocks of "
        "layer1, layer2, layer3, layer4 ('layer1.0': after block 0 of layer1)")
    assert _refused(lambda: stages(model, ["zzz"])) == (  # nothing close: a sentence of its own
        "ValueError: split_points: unknown split point 'zzz' for IResNet; valid split points, in forward order: "
        "stem, layer1, layer2, layer3, layer4. IResNet may also be cut between the blocks of "
        "layer1, layer2, layer3, layer4 ('layer1.0': after block 0 of layer1)")


class _OwnForward(nn.Sequential):
    def forward(self, x):
        return super().forward(x) * 2


def test_only_a_plain_sequential_alone_in_its_segment_can_be_cut_between_blocks() -> None:
    refusal = "which is not a single nn.Sequential child: only a plain sequence of blocks can be cut between its blocks"
    two = _Declared((("one", ("a", "b")),))
    two.a = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))  # a Sequential, but beside another child
    two.block_segments = ("one",)
    assert _refused(lambda: stages(two, [])) == f"ValueError: _Declared.block_segments names 'one', {refusal}"
    own = _Declared((("one", ("a",)), ("two", ("b",))))
    own.a = _OwnForward(nn.Linear(2, 2), nn.Linear(2, 2))  # its forward is not the blocks in turn
    own.block_segments = ("one",)
    assert _refused(lambda: stages(own, ["one"])) == f"ValueError: _Declared.block_segments names 'one', {refusal}"


def test_each_flatten_item_of_a_stage_gets_a_key_of_its_own() -> None:
    from shardfc.parallel.model_split import FLATTEN

    model = _Declared((("one", ("a", FLATTEN, FLATTEN, "b", FLATTEN)),))
    (stage,) = stages(model, [])
    assert list(stage._modules) == ["a", "flatten", "flatten1", "b", "flatten2"]
    assert all(isinstance(stage._modules[k], nn.Flatten) for k in ("flatten", "flatten1", "flatten2"))


def test_a_split_model_refuses_stages_that_share_a_tensor_across_devices(monkeypatch) -> None:
    from shardfc.parallel import model_split

    monkeypatch.setattr(model_split, "check_devices", lambda devices, n, what: tuple(map(torch.device, devices)))
    shared = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"^stages\[0\] and stages\[1\] share the tensor '0\.weight' but are on different "
                                         r"devices \(cpu, meta\); a tensor cannot live on both$"):
        SplitModel([shared, nn.Sequential(shared)], ["cpu", "meta"])
    assert shared.weight.device.type == "cpu"  # refused before anything moved
