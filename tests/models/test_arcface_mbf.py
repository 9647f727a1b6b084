"""``mbf`` / ``mbf_large``: arcface_torch's MobileFaceNet, key for key, and trainable like the others."""

from __future__ import annotations

import pytest
import torch

from shardfc.models import BACKBONES, ArcfaceMobileFaceNet, build_backbone, input_size
from shardfc.parallel.model_split import available_split_points, stages


# --------------------------------------------------------------------------- arcface_torch's keys
# Written from arcface_torch's backbones/mobilefacenet.py: ConvBlock = layers.{0 conv, 1 BN, 2 PReLU},
# LinearBlock = layers.{0 conv, 1 BN}, DepthWise = layers.{0 ConvBlock 1x1 to `groups`, 1 ConvBlock
# 3x3 depthwise, 2 LinearBlock 1x1}, Residual = layers.{i DepthWise}, MobileFaceNet = layers.{0..7},
# conv_sep (ConvBlock to 512), features = GDC layers.{0 LinearBlock 7x7 dw, 1 Flatten, 2 Linear, 3 BN1d}.
def _bn(keys, p, c):
    keys += [(f"{p}.weight", (c,)), (f"{p}.bias", (c,)), (f"{p}.running_mean", (c,)),
             (f"{p}.running_var", (c,)), (f"{p}.num_batches_tracked", ())]


def _conv_block(keys, p, cin, cout, k, groups=1, prelu=True):
    keys.append((f"{p}.layers.0.weight", (cout, cin // groups, k, k)))
    _bn(keys, f"{p}.layers.1", cout)
    if prelu:
        keys.append((f"{p}.layers.2.weight", (cout,)))


def _depth_wise(keys, p, cin, cout, groups):
    _conv_block(keys, f"{p}.layers.0", cin, groups, 1)
    _conv_block(keys, f"{p}.layers.1", groups, groups, 3, groups=groups)
    _conv_block(keys, f"{p}.layers.2", groups, cout, 1, prelu=False)


def _residual(keys, p, c, n, groups):
    for i in range(n):
        _depth_wise(keys, f"{p}.layers.{i}", c, c, groups)


def arcface_mbf_keys(dim, blocks=(1, 4, 6, 2), scale=2):
    """[(key, shape)] of arcface_torch's ``MobileFaceNet(fp16, dim, blocks, scale)``, in order."""
    keys, a, b = [], 64 * scale, 128 * scale
    _conv_block(keys, "layers.0", 3, a, 3)
    if blocks[0] == 1:
        _conv_block(keys, "layers.1", a, a, 3, groups=64)
    else:
        _residual(keys, "layers.1", a, blocks[0], 128)
    _depth_wise(keys, "layers.2", a, a, 128)
    _residual(keys, "layers.3", a, blocks[1], 128)
    _depth_wise(keys, "layers.4", a, b, 256)
    _residual(keys, "layers.5", b, blocks[2], 256)
    _depth_wise(keys, "layers.6", b, b, 512)
    _residual(keys, "layers.7", b, blocks[3], 256)
    _conv_block(keys, "conv_sep", b, 512, 1)
    _conv_block(keys, "features.layers.0", 512, 512, 7, groups=512, prelu=False)
    keys.append(("features.layers.2.weight", (dim, 512)))
    _bn(keys, "features.layers.3", dim)
    return keys


def _ours(model):
    return [(k, tuple(v.shape)) for k, v in model.state_dict().items()]


@pytest.mark.parametrize(("name", "blocks", "scale"), [("mbf", (1, 4, 6, 2), 2), ("mbf_large", (2, 8, 12, 4), 4)])
def test_state_dict_is_arcface_torchs(name, blocks, scale):
    assert _ours(build_backbone(name, embedding_dim=64)) == arcface_mbf_keys(64, blocks, scale)


def test_first_and_last_keys_spelled_out():
    keys = dict(_ours(build_backbone("mbf", embedding_dim=128)))
    assert keys["layers.0.layers.0.weight"] == (128, 3, 3, 3)
    assert keys["layers.1.layers.0.weight"] == (128, 2, 3, 3)  # 64 groups over 128 channels
    assert keys["layers.2.layers.0.layers.0.weight"] == (128, 128, 1, 1)
    assert keys["layers.2.layers.1.layers.0.weight"] == (128, 1, 3, 3)
    assert keys["layers.2.layers.2.layers.1.running_var"] == (128,)
    assert "layers.2.layers.2.layers.2.weight" not in keys  # the projection has no PReLU
    assert keys["layers.3.layers.3.layers.2.layers.0.weight"] == (128, 128, 1, 1)
    assert keys["layers.4.layers.2.layers.0.weight"] == (256, 256, 1, 1)
    assert keys["layers.6.layers.0.layers.0.weight"] == (512, 256, 1, 1)
    assert "layers.7.layers.2.layers.0.layers.0.weight" not in keys  # blocks[3] = 2
    assert keys["conv_sep.layers.0.weight"] == (512, 256, 1, 1)
    assert keys["features.layers.0.layers.0.weight"] == (512, 1, 7, 7)
    assert keys["features.layers.2.weight"] == (128, 512)
    assert keys["features.layers.3.num_batches_tracked"] == ()
    large = dict(_ours(build_backbone("mbf_large")))
    assert large["layers.1.layers.1.layers.0.layers.0.weight"] == (128, 256, 1, 1)  # blocks[0] = 2 residuals


def test_parameter_counts_are_arcface_torchs():
    # Summed by hand from the structure (a DepthWise(in, out, g) holds g * (in + out + 15) + 2 * out):
    # mbf: stem 3,840 + grouped conv 2,688 + 34,944 + 4 x 34,944 + 102,656 + 6 x 135,424 + 270,336
    #      + 2 x 135,424 + conv_sep 132,608 + GDC/Linear/BN 289,280 = 2,059,520.
    # mbf_large: 7,680 + 2 x 67,968 + 67,968 + 8 x 67,968 + 201,472 + 12 x 267,008 + 532,992
    #      + 4 x 267,008 + 263,680 + 289,280 = 6,314,880.
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(build_backbone("mbf")) == 2_059_520
    assert count(build_backbone("mbf_large")) == 6_314_880
    assert sum(torch.Size(s).numel() for k, s in arcface_mbf_keys(512) if "running" not in k and "batches" not in k) \
        == 2_059_520


def test_registered_at_112():
    assert {"mbf", "mbf_large"} <= set(BACKBONES)
    assert input_size("mbf") == input_size("mbf_large") == (112, 112)
    assert isinstance(build_backbone("mbf"), ArcfaceMobileFaceNet)
    with pytest.raises(ValueError, match=r"mbf expects input of shape \[N, 3, 112, 112\].*got \[1, 3, 96, 96\]"):
        build_backbone("mbf").eval()(torch.randn(1, 3, 96, 96))
    with pytest.raises(ValueError, match="blocks must give the depth of 4 stages"):
        ArcfaceMobileFaceNet(blocks=(1, 2, 3))
    with pytest.raises(ValueError, match="scale must be a positive integer, got 0"):
        ArcfaceMobileFaceNet(scale=0)


# --------------------------------------------------------------------------- trains, and cuts
def test_backward_at_batch_2_reaches_every_parameter():
    torch.manual_seed(0)
    model = build_backbone("mbf", embedding_dim=32).train()
    out = model(torch.randn(2, 3, 112, 112))
    assert out.shape == (2, 32)
    (out * torch.randn_like(out)).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_residuals_add_their_input():
    model = build_backbone("mbf", embedding_dim=8).eval()
    block = model.layers[3].layers[0]
    x = torch.randn(1, 128, 28, 28)
    with torch.no_grad():
        assert torch.allclose(block(x), x + block.layers(x))
        transition = model.layers[2]  # stride 2: no shortcut
        y = torch.randn(1, 128, 56, 56)
        assert torch.equal(transition(y), transition.layers(y)) and transition(y).shape == (1, 128, 28, 28)


@pytest.mark.parametrize("name", ["mbf", "mbf_large"])
def test_stages_cut_at_each_split_point_equal_forward_in_float64(name):
    torch.manual_seed(0)
    model = build_backbone(name, embedding_dim=16).double().train()
    assert available_split_points(model) == ArcfaceMobileFaceNet.split_points == ("trunk", "conv_sep")
    x = torch.randn(2, 3, 112, 112, dtype=torch.float64)
    with torch.no_grad():
        model(x)  # move the running stats off their initial values
        model.eval()
        expected = model(x)
    for points in (["trunk"], ["conv_sep"], ["trunk", "conv_sep"]):
        y = x
        with torch.no_grad():
            for stage in stages(model, points):
                y = stage(y)
        assert torch.equal(y, expected), points
