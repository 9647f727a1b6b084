"""Backbone registry, shapes, parameter counts, input checks and trainability."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from shardfc.models import BACKBONES, build_backbone, input_size

NAMES = ["glyphnet", "iresnet18", "iresnet34", "iresnet50", "iresnet100", "mbf", "mbf_large", "mobilefacenet", "resnet50", "tiny"]


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_registry_names() -> None:
    assert sorted(BACKBONES) == sorted(NAMES)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "512", None])
def test_an_embedding_width_that_is_no_positive_int_is_refused_by_name(bad) -> None:
    # 0 built a model of 0-wide embeddings; -1 and 1.5 were torch's errors from inside a layer
    with pytest.raises(ValueError, match=f"^embedding_dim must be a positive integer, got {re.escape(repr(bad))}$"):
        build_backbone("tiny", embedding_dim=bad)


@pytest.mark.parametrize("name", NAMES)
def test_builds_and_output_shape(name: str) -> None:
    torch.manual_seed(0)
    model = build_backbone(name, embedding_dim=256).eval()
    h, w = input_size(name)
    assert model.input_size == (h, w)
    with torch.no_grad():
        out = model(torch.randn(2, 3, h, w))
    assert out.shape == (2, 256)
    assert torch.isfinite(out).all()
    assert model.embedding_dim == 256  # what the builder sizes the head by


def test_input_sizes() -> None:
    assert input_size("iresnet50") == (112, 112)
    assert input_size("mobilefacenet") == (112, 112)
    assert input_size("resnet50") == (256, 128)
    assert input_size("tiny") == (32, 32)
    assert input_size("glyphnet") == (32, 32)


def _insightface_iresnet_params(blocks, embedding_dim=512):
    """insightface arcface_torch's IResNet parameter count, from its layer list: a 3×3 stem (conv,
    BN, PReLU); per block BN → 3×3 conv → BN → PReLU → 3×3 conv (stride on the second) → BN, the
    first block of each stage with a 1×1 conv + BN shortcut; BN, a 7×7×512 → D linear, BN1d."""
    n = 3 * 64 * 9 + 2 * 64 + 64
    inplanes = 64
    for planes, count in zip((64, 128, 256, 512), blocks):
        for b in range(count):
            n += 2 * inplanes + inplanes * planes * 9 + 2 * planes + planes + planes * planes * 9 + 2 * planes
            if b == 0:
                n += inplanes * planes + 2 * planes
            inplanes = planes
    return n + 2 * 512 + 512 * 49 * embedding_dim + embedding_dim + 2 * embedding_dim


@pytest.mark.parametrize(("name", "blocks"), [("iresnet50", (3, 4, 14, 3)), ("iresnet100", (3, 13, 30, 3))])
def test_iresnet_param_count_matches_insightface(name: str, blocks) -> None:
    # Exactly (43,590,848 and 65,156,160 at 512-d): a dropped or extra block changes the count.
    assert _params(build_backbone(name, embedding_dim=512)) == _insightface_iresnet_params(blocks)


def test_iresnet_features_bn_scale_is_frozen() -> None:
    model = build_backbone("iresnet18")
    assert not model.features.weight.requires_grad
    assert model.features.bias.requires_grad


def test_mobilefacenet_paper_size() -> None:
    # Chen et al. report 0.99M parameters for the 128-d model.
    model = build_backbone("mobilefacenet", embedding_dim=128)
    assert 0.95e6 < _params(model) < 1.05e6


def test_resnet50_bnneck_and_last_stride() -> None:
    plain = build_backbone("resnet50", embedding_dim=2048)
    assert isinstance(plain.reduce, nn.Identity)
    assert not plain.neck.bias.requires_grad
    reduced = build_backbone("resnet50", embedding_dim=512)
    assert isinstance(reduced.reduce, nn.Linear)
    assert reduced.reduce.weight.shape == (512, 2048)

    x = torch.randn(1, 3, 256, 128)
    for last_stride, fmap in [(1, (16, 8)), (2, (8, 4))]:
        m = build_backbone("resnet50", embedding_dim=2048, last_stride=last_stride).eval()
        with torch.no_grad():
            f = m.layer4(m.layer3(m.layer2(m.layer1(m.stem(x)))))
        assert f.shape[-2:] == fmap


@pytest.mark.parametrize("name", ["resnet50", "tiny"])
def test_with_features_returns_the_feature_before_the_neck(name: str) -> None:
    m = build_backbone(name, embedding_dim=32).train()
    x = torch.randn(4, 3, 64, 32)
    feature, embedding = m(x, with_features=True)
    neck = m.neck if name == "resnet50" else m.features
    assert isinstance(neck, nn.BatchNorm1d)
    assert torch.allclose(embedding, neck(feature), atol=1e-6)
    # training-mode BN over the batch: the embedding is centred, the feature is not
    assert embedding.mean(0).abs().max() < 1e-4 < feature.mean(0).abs().max()
    m.eval()
    assert torch.equal(m(x), m(x, with_features=True)[1])


def test_resnet50_without_neck() -> None:
    m = build_backbone("resnet50", embedding_dim=16, neck="none").eval()
    assert isinstance(m.neck, nn.Identity)
    x = torch.randn(2, 3, 64, 32)
    feature, embedding = m(x, with_features=True)
    assert torch.equal(feature, embedding)
    with pytest.raises(ValueError, match="neck must be one of bnneck, none; got 'bn'"):
        build_backbone("resnet50", neck="bn")



def test_resnet50_last_stride_is_1_or_2() -> None:
    x = torch.randn(1, 3, 64, 32)
    maps = {s: build_backbone("resnet50", embedding_dim=8, last_stride=s).eval() for s in (1, 2)}
    with torch.no_grad():  # the final map: 4x2 at stride 1, 2x1 at stride 2
        assert [maps[s].layer4(maps[s].layer3(maps[s].layer2(maps[s].layer1(maps[s].stem(x))))).shape[-2:]
                for s in (1, 2)] == [(4, 2), (2, 1)]
    for bad in (0, 3, -1, 1.5, True):  # 0 failed in the first forward; 3 silently shrank the map
        with pytest.raises(ValueError, match=re.escape(f"last_stride must be 1 (re-ID's 16x8 final map) or 2 "
                                                       f"(ImageNet's), got {bad!r}")):
            build_backbone("resnet50", embedding_dim=8, last_stride=bad)


@pytest.mark.parametrize("name", ["iresnet18", "mobilefacenet"])
def test_wrong_input_size_raises(name: str) -> None:
    model = build_backbone(name).eval()
    with pytest.raises(ValueError, match=r"112, 112.*got \[1, 3, 128, 128\]"):
        model(torch.randn(1, 3, 128, 128))


def test_unknown_name() -> None:
    with pytest.raises(ValueError, match=r"'iresnet5'.*tiny.*did you mean 'iresnet50'"):
        build_backbone("iresnet5")
    with pytest.raises(ValueError, match="unknown backbone"):
        input_size("nope")


def test_tiny_input_size_kwarg() -> None:
    model = build_backbone("tiny", embedding_dim=64, input_size=(48, 64))
    assert model.input_size == (48, 64)
    assert model(torch.randn(4, 3, 48, 64)).shape == (4, 64)


@pytest.mark.parametrize("name", ["tiny", "glyphnet"])
@pytest.mark.parametrize("kwargs, message", [
    (dict(width=0), "width must be a positive integer, got 0"),  # a net of no channels, built silently
    (dict(width=1.5), "width must be a positive integer, got 1.5"),
    (dict(input_size=0), "input_size must be a positive int or an (H, W) pair of them, got 0"),
    (dict(input_size=(0, 0)), "input_size must be a positive int or an (H, W) pair of them, got (0, 0)"),
    (dict(input_size=(32, 32.5)), "input_size must be a positive int or an (H, W) pair of them, got (32, 32.5)"),
    (dict(input_size=True), "input_size must be a positive int or an (H, W) pair of them, got True"),
    (dict(input_size=(32,)), "input_size must be a positive int or an (H, W) pair of them, got (32,)"),
])
def test_a_small_net_of_no_width_or_size_is_refused(name, kwargs, message) -> None:
    with pytest.raises(ValueError) as e:
        build_backbone(name, embedding_dim=8, **kwargs)
    assert str(e.value) == message
    assert build_backbone(name, embedding_dim=8, input_size=[24, 16], width=2).input_size == (24, 16)


@pytest.mark.parametrize("bad, message", [
    (float("nan"), "dropout must be a finite number, got nan"),  # every training output was NaN
    (1.0, "dropout must be in [0, 1), got 1.0"), (-0.1, "dropout must be in [0, 1), got -0.1"),
    ("0.1", "dropout must be a finite number, got '0.1'"),
])
def test_an_iresnet_dropout_outside_0_1_is_refused(bad, message) -> None:
    with pytest.raises(ValueError) as e:
        build_backbone("iresnet18", embedding_dim=8, dropout=bad)
    assert str(e.value) == message


def test_tiny_gradients_flow() -> None:
    torch.manual_seed(0)
    model = build_backbone("tiny", embedding_dim=32)
    model(torch.randn(8, 3, 32, 32)).pow(2).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_tiny_trains() -> None:
    torch.manual_seed(0)
    model = build_backbone("tiny", embedding_dim=32)
    head = nn.Linear(32, 10)
    x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
    opt = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.1, momentum=0.9)
    losses = []
    for _ in range(10):
        loss = nn.functional.cross_entropy(head(model(x)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_glyphnet_keeps_the_layout_and_takes_its_input_size() -> None:
    """GlyphNet flattens its 4x4 map (where the strokes are matters for a character), so its linear
    layer follows the input size: width·4 channels x ceil(H/8) x ceil(W/8)."""
    model = build_backbone("glyphnet", embedding_dim=32, input_size=(40, 24)).eval()
    assert model.input_size == (40, 24) and model.fc.in_features == 64 * 5 * 3
    x = torch.randn(2, 3, 40, 24)
    with torch.no_grad():
        assert model(x).shape == (2, 32)
        # a mirrored input is another input: no pooling makes the embedding mirror-invariant
        assert not torch.allclose(model(x), model(x.flip(-1)), atol=1e-3)
    assert 250_000 < _params(build_backbone("glyphnet", embedding_dim=128)) < 300_000


# ------------------------------------------------------------------ the architectures, counted and shaped
@pytest.mark.parametrize(("name", "blocks"), [("iresnet18", (2, 2, 2, 2)), ("iresnet34", (3, 4, 6, 3))])
def test_small_iresnet_param_counts_match_insightface(name: str, blocks) -> None:
    for dim in (512, 96):
        assert _params(build_backbone(name, embedding_dim=dim)) == _insightface_iresnet_params(blocks, dim)


def _torchvision_resnet_trunk_params(blocks) -> int:
    """torchvision's ResNet (Bottleneck) up to the pooling: a 7×7 stem conv + BN; per block 1×1, 3×3
    and 1×1 (4×) convs, each with BN, the first block of each stage with a 1×1 conv + BN shortcut."""
    n = 3 * 64 * 49 + 2 * 64
    inplanes = 64
    for planes, count in zip((64, 128, 256, 512), blocks):
        for b in range(count):
            n += inplanes * planes + 2 * planes + planes * planes * 9 + 2 * planes + planes * 4 * planes + 8 * planes
            if b == 0:
                n += inplanes * 4 * planes + 8 * planes
            inplanes = 4 * planes
    return n


def test_resnet50_is_torchvisions_trunk_with_its_neck() -> None:
    # torchvision documents ResNet-50 at 25,557,032 parameters, 2,049,000 of them its 1000-class fc
    assert _torchvision_resnet_trunk_params((3, 4, 6, 3)) == 25_557_032 - 2_049_000
    trunk = _torchvision_resnet_trunk_params((3, 4, 6, 3))
    assert _params(build_backbone("resnet50", embedding_dim=2048)) == trunk + 2 * 2048  # + the BNNeck
    assert _params(build_backbone("resnet50", embedding_dim=512)) == trunk + 2048 * 512 + 2 * 512  # + reduce, neck
    assert _params(build_backbone("resnet50", embedding_dim=2048, neck="none")) == trunk
    m = build_backbone("resnet50").eval()
    assert m.embedding_dim == 512 and isinstance(m.neck, nn.BatchNorm1d)
    with torch.no_grad():  # a 4x downsampling stem (stride-2 conv, stride-2 pool), last stride 1 by default
        stem = m.stem(torch.randn(1, 3, 256, 128))
        assert stem.shape == (1, 64, 64, 32)
        assert m.layer4(m.layer3(m.layer2(m.layer1(stem)))).shape == (1, 2048, 16, 8)
    from shardfc.models import ReIDResNet

    small = ReIDResNet((1, 1, 1, 1))  # the class's own defaults: the strong baseline's
    assert small.embedding_dim == 2048 and isinstance(small.neck, nn.BatchNorm1d) and small.layer4[0].conv2.stride == (1, 1)


def test_mobilefacenet_and_the_small_nets_have_their_layout() -> None:
    # Chen et al.: 0.99M parameters at 128-d (a dense 3x3 where a depthwise one belongs adds 36k)
    assert 0.98e6 < _params(build_backbone("mobilefacenet", embedding_dim=128)) < 1.01e6
    # tiny: three stride-2 3x3 convs of width w, 2w, 4w (BN each), global pooling, a bias-free fc, BN1d
    w, d = 8, 24
    tiny_model = build_backbone("tiny", embedding_dim=d, width=w)
    assert _params(tiny_model) == (3 * w * 9 + 2 * w) + (w * 2 * w * 9 + 4 * w) + (2 * w * 4 * w * 9 + 8 * w) \
        + 4 * w * d + 2 * d
    assert tiny_model.embedding_dim == d
    assert tiny_model.body(torch.randn(1, 3, 32, 40)).shape == (1, 4 * w, 4, 5)
    # glyphnet: a 3x3 conv of width w, then three stages (stride 2, then stride 1) of 2w, 4w, 4w
    g = build_backbone("glyphnet", embedding_dim=d, width=w, input_size=64)
    convs = 3 * w * 9 + w * 2 * w * 9 + 2 * w * 2 * w * 9 + 2 * w * 4 * w * 9 + 3 * (4 * w) ** 2 * 9
    bns = 2 * (w + 2 * 2 * w + 2 * 4 * w + 2 * 4 * w) + 2 * 4 * w
    assert _params(g) == convs + bns + 4 * w * 8 * 8 * d + 2 * d
    assert g.input_size == (64, 64) and g.embedding_dim == d
    assert build_backbone("tiny", input_size=40).input_size == (40, 40)


@pytest.mark.parametrize("name", ["iresnet18", "iresnet34", "iresnet50", "iresnet100"])
def test_iresnet_takes_its_dropout(name: str) -> None:
    assert build_backbone(name, embedding_dim=8, dropout=0.25).dropout.p == 0.25


def _silence(bn: nn.BatchNorm2d) -> None:
    nn.init.zeros_(bn.weight)
    nn.init.zeros_(bn.bias)


def test_each_residual_block_adds_its_shortcut() -> None:
    """With its branch's last BN silenced, a block is its shortcut (the identity, or the projection)."""
    from shardfc.models.iresnet import IBasicBlock
    from shardfc.models.mobilefacenet import Bottleneck as MobileBottleneck
    from shardfc.models.resnet import Bottleneck

    torch.manual_seed(0)
    x = torch.randn(2, 16, 8, 8)
    for block in (IBasicBlock(16, 16), IBasicBlock(16, 32, stride=2)):
        block.eval()
        _silence(block.bn3)
        with torch.no_grad():
            shortcut = x if block.downsample is None else block.downsample(x)
            assert torch.equal(block(x), shortcut)
    assert IBasicBlock(16, 16).downsample is None and IBasicBlock(16, 16, stride=2).downsample is not None
    for block in (Bottleneck(64, 16), Bottleneck(16, 16), Bottleneck(64, 16, stride=2)):
        block.eval()
        _silence(block.bn3)
        inp = torch.randn(2, block.conv1.in_channels, 8, 8)
        with torch.no_grad():
            shortcut = inp if block.downsample is None else block.downsample(inp)
            assert torch.equal(block(inp), torch.relu(shortcut))
    assert Bottleneck(64, 16).downsample is None  # 4 x 16 = 64 in, stride 1: the identity
    assert Bottleneck(16, 16).downsample is not None and Bottleneck(64, 16, stride=2).downsample is not None
    residual = MobileBottleneck(16, 16, stride=1, expansion=2)
    assert residual.use_residual and not MobileBottleneck(16, 32, stride=1, expansion=2).use_residual
    assert not MobileBottleneck(16, 16, stride=2, expansion=2).use_residual
    residual.eval()
    with torch.no_grad():
        assert torch.equal(residual(x), x + residual.block(x))
        _silence(residual.block[-1][1])
        assert torch.equal(residual(x), x)


def _mobilefacenet_params(dim: int) -> int:
    """Chen et al.'s Table 1, counted: conv-BN(-PReLU) layers, bottlenecks of a 1x1 expansion, a 3x3
    depthwise conv and a linear 1x1 projection (PReLU after all but the linear layers), the 1x1 conv to
    512, the linear 7x7 depthwise GDC (+ BN), a bias-free linear layer to ``dim`` and a BN1d."""
    def conv(cin, cout, k, groups=1, act=True):
        return cin // groups * cout * k * k + 2 * cout + (cout if act else 0)

    n = conv(3, 64, 3) + conv(64, 64, 3, groups=64)
    cin = 64
    for t, c, repeats in ((2, 64, 5), (4, 128, 1), (2, 128, 6), (4, 128, 1), (2, 128, 2)):
        for _ in range(repeats):
            n += conv(cin, cin * t, 1) + conv(cin * t, cin * t, 3, groups=cin * t) + conv(cin * t, c, 1, act=False)
            cin = c
    return n + conv(128, 512, 1) + conv(512, 512, 7, groups=512, act=False) + 512 * dim + 2 * dim


def test_mobilefacenet_is_the_papers_table() -> None:
    for dim in (128, 512):
        assert _params(build_backbone("mobilefacenet", embedding_dim=dim)) == _mobilefacenet_params(dim)


def test_weights_start_kaiming_normal_by_fan_out() -> None:
    """Convolutions (and the Linear layers of resnet50 and mbf) start N(0, 2 / fan_out); BN as the identity."""
    torch.manual_seed(0)
    conv = build_backbone("iresnet18", embedding_dim=8).layer2[0].conv1  # 64 -> 128, 3x3: fan-in != fan-out
    assert conv.weight.std().item() == pytest.approx((2 / (128 * 9)) ** 0.5, rel=0.03)
    for name in ("resnet50", "mbf"):
        linear = next(m for m in build_backbone(name, embedding_dim=512).modules() if isinstance(m, nn.Linear))
        assert linear.weight.std().item() == pytest.approx((2 / 512) ** 0.5, rel=0.03), name
    bn = build_backbone("tiny", embedding_dim=8).body[1]
    assert torch.equal(bn.weight, torch.ones(16)) and torch.equal(bn.bias, torch.zeros(16))


def test_each_factorys_defaults() -> None:
    """Called with no argument (the API, not the trainer, which always passes the width): 512-d faces and
    glyphs, resnet50's 2048-d pooled feature (the strong baseline's), no dropout."""
    for name, factory in BACKBONES.items():
        model = factory()
        assert model.embedding_dim == (2048 if name == "resnet50" else 512), name
        if name.startswith("iresnet"):
            assert model.dropout.p == 0.0, name
        del model


def test_the_classes_own_defaults() -> None:
    from shardfc.models import ArcfaceMobileFaceNet, GlyphNet, IResNet, MobileFaceNet, TinyNet, tiny

    for model in (ArcfaceMobileFaceNet(), MobileFaceNet(), GlyphNet()):
        assert model.embedding_dim == 512
    assert ArcfaceMobileFaceNet().scale == 2 and tuple(ArcfaceMobileFaceNet().blocks) == (1, 4, 6, 2)  # arcface_torch's mbf
    small = IResNet((1, 1, 1, 1))
    assert small.embedding_dim == 512 and small.dropout.p == 0.0
    for model in (TinyNet(), tiny()):
        assert model.embedding_dim == 512 and model.body[0].out_channels == 16 and model.input_size == (32, 32)


def test_resnet50s_stem_pools_by_3x3_and_ends_in_relu() -> None:
    stem = build_backbone("resnet50", embedding_dim=8).stem.eval()
    with torch.no_grad():
        out = stem(torch.randn(2, 3, 250, 126))  # odd maps after the conv: a 4x4 pool would give 62 x 31
    assert out.shape == (2, 64, 63, 32) and out.min() >= 0


def test_a_bad_name_or_size_is_named() -> None:
    from shardfc.models import ArcfaceMobileFaceNet

    names = ", ".join(sorted(BACKBONES))
    with pytest.raises(ValueError, match="^" + re.escape(f"unknown backbone 'vgg16'; valid names: {names}") + "$"):
        build_backbone("vgg16")
    with pytest.raises(ValueError, match=re.escape("embedding_dim must be a positive integer, got 0")):
        ArcfaceMobileFaceNet(0)
    with pytest.raises(ValueError, match=re.escape("blocks[2] must be a positive integer, got 0")):
        ArcfaceMobileFaceNet(8, (1, 4, 0, 2))
