"""The GPU-speed options of ``shardfc train`` as the CPU can check them: channels_last changes no
output, the precision 'auto' resolves per device, --compile keeps the checkpoint's names."""

from __future__ import annotations

import pytest
import torch

from shardfc.models import build_backbone
from shardfc.parallel.context import DistContext
from shardfc.train.builder.factory import build_run, resolve_amp_dtype, use_channels_last
from shardfc.train.config import ConfigError, TrainConfig, parse_config

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU


@pytest.mark.parametrize("name,size", [("tiny", (16, 16)), ("iresnet18", (112, 112)), ("mbf", (112, 112))])
def test_a_channels_last_backbone_gives_the_contiguous_ones_outputs(name, size):
    torch.manual_seed(0)
    kwargs = {"input_size": size} if name == "tiny" else {}
    model = build_backbone(name, 32, **kwargs).eval()
    x = torch.randn(2, 3, *size)
    with torch.no_grad():
        expected = model(x)
        model = model.to(memory_format=torch.channels_last)
        conv = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size != (1, 1))
        assert conv.weight.is_contiguous(memory_format=torch.channels_last) and not conv.weight.is_contiguous()
        got = model(x.contiguous(memory_format=torch.channels_last))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_channels_last_is_for_cuda_convolutional_backbones_unless_turned_off():
    conv = build_backbone("tiny", 16, input_size=(16, 16))
    flat = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 4))
    assert use_channels_last(TrainConfig(), CUDA, conv) is True
    assert use_channels_last(TrainConfig(), CPU, conv) is False
    assert use_channels_last(TrainConfig(channels_last=False), CUDA, conv) is False
    assert use_channels_last(TrainConfig(), CUDA, flat) is False
    cfg, _ = parse_config(["--no-channels-last", "--compile"])
    assert (cfg.channels_last, cfg.compile) == (False, True)
    assert (TrainConfig().channels_last, TrainConfig().compile) == (True, False)


def test_precision_auto_is_bf16_on_a_bf16_gpu_fp16_on_others_fp32_on_the_cpu(monkeypatch):
    assert TrainConfig().amp == "auto" and resolve_amp_dtype(TrainConfig(), CPU) is None
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_amp_dtype(TrainConfig(), CUDA) is torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_amp_dtype(TrainConfig(), CUDA) is torch.float16
    # fp16's scaler cannot unscale sparse row gradients: fp32 there
    assert resolve_amp_dtype(TrainConfig(sample_rate=0.5, sparse_grad=True), CUDA) is None
    with pytest.raises(ConfigError, match=r"amp must be one of auto, none, bf16, fp16; got 'fast'"):
        parse_config(["--amp", "fast"])


def test_compile_keeps_the_backbone_state_dict_names(tmp_path):
    base = TrainConfig(synthetic_identities=6, synthetic_images_per_identity=2, image_size=[16, 16], embedding_dim=8,
                       batch_size=4, nproc=1, output_dir=str(tmp_path), synthetic_val_pairs=0)
    plain = build_run(base.validate(), DistContext()).parts.module
    compiled = build_run(TrainConfig(**{**base.__dict__, "compile": True}).validate(), DistContext()).parts.module
    assert plain._compiled_call_impl is None and compiled._compiled_call_impl is not None  # compiled, in place
    assert list(compiled.state_dict()) == list(plain.state_dict())  # what a checkpoint saves
    assert not any("_orig_mod" in k for k in compiled.state_dict())
    assert not any(p.is_contiguous(memory_format=torch.channels_last) and not p.is_contiguous()
                   for p in compiled.parameters())  # the CPU keeps NCHW
