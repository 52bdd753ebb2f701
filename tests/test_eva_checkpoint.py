"""EVA MIM checkpoints reach the right trunk tensors in every source format, or loading fails loudly.

Source models are depth-reduced random timm models of the reference architectures; their weights are written
in each on-disk format (EVA repository names are the inverse of timm's renaming, written out here).
"""

import argparse
import logging
import re

import open_clip
import pytest
import timm
import torch
from safetensors.torch import save_file
from timm.layers import resample_abs_pos_embed, resample_patch_embed

from eva_fastclip.config import ConfigError, ModelConfig
from eva_fastclip.models import create_model, load_vision_checkpoint

TOLERATED = re.compile(r"^(head\.|blocks\.\d+\.attn\.norm\.)")


def randomized(model):
    """Every parameter random, LayerNorms included, so that an unloaded tensor cannot pass as loaded."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


def timm_to_eva_repo(state):
    """The EVA repository's names for a timm EVA-02 state dict (inverse of timm's checkpoint_filter_fn)."""
    out = {}
    for k, v in state.items():
        for timm_name, eva_name in (
            ("mlp.fc1_g.", "mlp.w1."),
            ("mlp.fc1_x.", "mlp.w2."),
            ("mlp.fc2.", "mlp.w3."),
            ("mlp.norm.", "mlp.ffn_ln."),
            ("attn.norm.", "attn.inner_attn_ln."),
            ("attn.q_proj.bias", "attn.q_bias"),
            ("attn.v_proj.bias", "attn.v_bias"),
        ):
            k = k.replace(timm_name, eva_name)
        out[k] = v
    return out


def mim_extras(state, width):
    """MIM checkpoints: final norm named `norm` (timm calls it fc_norm), plus heads and RoPE buffers."""
    state = {("norm" + k[len("fc_norm") :] if k.startswith("fc_norm.") else k): v for k, v in state.items()}
    state["lm_head.weight"] = torch.randn(24, width)
    state["lm_head.bias"] = torch.randn(24)
    state["mask_token"] = torch.randn(1, 1, width)
    state["rope.freqs_cos"] = torch.randn(256, 64)
    state["rope.freqs_sin"] = torch.randn(256, 64)
    return state


def expected_from(source_model):
    """Trunk name -> source tensor (the source's avg-pool fc_norm is the CLIP trunk's final norm)."""
    return {
        ("norm" + k[len("fc_norm") :] if k.startswith("fc_norm.") else k): v.clone()
        for k, v in source_model.state_dict().items()
    }


def check_arrival(trunk, expected, report, resampled=()):
    """Each backbone tensor equals its source (or timm's resampling of it); only tolerated gaps."""
    got = trunk.state_dict()
    assert set(report.loaded) == set(expected)
    assert set(got) - set(expected) == set(report.missing)
    assert all(TOLERATED.match(k) for k in report.missing), report.missing
    assert set(report.resampled) == set(resampled)
    grid = trunk.patch_embed.grid_size
    for k, src in expected.items():
        if k == "pos_embed" and k in resampled:
            old = int((src.shape[1] - 1) ** 0.5)
            want = resample_abs_pos_embed(
                src, new_size=grid, old_size=(old, old), num_prefix_tokens=1, interpolation="bicubic"
            )
            assert torch.equal(got[k][:, :1], src[:, :1])  # CLS row kept
        elif k == "patch_embed.proj.weight" and k in resampled:
            want = resample_patch_embed(src, got[k].shape[-2:], interpolation="bicubic", antialias=True)
        else:
            want = src
        assert got[k].shape == want.shape, k
        assert torch.equal(got[k], want), k
    for k in report.missing:  # the attention sub-LN stays at LayerNorm's identity init
        if ".attn.norm." in k:
            assert torch.equal(got[k], torch.full_like(got[k], 1.0 if k.endswith("weight") else 0.0))


def test_eva02_base_mim_from_eva_repository_resamples_patch_14_to_16(tmp_path):
    source = randomized(timm.create_model("eva02_base_patch14_224", depth=2, num_classes=0))
    state = mim_extras(timm_to_eva_repo(source.state_dict()), 768)
    path = tmp_path / "eva02_B_pt_in21k_p14.pt"
    torch.save({"model": state, "args": argparse.Namespace(lr=1e-3), "epoch": 3}, path)

    # num_classes=512: the trunk head is the CLIP projection, as in open_clip's EVA02-B-16
    trunk = timm.create_model("eva02_base_patch16_clip_224", depth=2, num_classes=512)
    report = load_vision_checkpoint(trunk, path)

    assert report.source_format == "eva02" and report.wrappers == ["model"]
    assert set(report.dropped) == {"lm_head.weight", "lm_head.bias", "mask_token", "rope.freqs_cos"} | {
        "rope.freqs_sin"
    }
    assert set(report.missing) == {"head.weight", "head.bias"} | {
        f"blocks.{i}.attn.norm.{p}" for i in range(2) for p in ("weight", "bias")
    }
    assert report.resampled == {
        "pos_embed": ((1, 257, 768), (1, 197, 768)),
        "patch_embed.proj.weight": ((768, 3, 14, 14), (768, 3, 16, 16)),
    }
    check_arrival(trunk, expected_from(source), report, resampled=("pos_embed", "patch_embed.proj.weight"))
    assert "lm_head.weight" in report.summary() and "resampled pos_embed" in report.summary()
    trunk(torch.randn(1, 3, 224, 224))  # RoPE rebuilt from the trunk's own grid: the forward runs


def test_eva02_large_mim_module_wrapped_resamples_pos_embed_to_336(tmp_path):
    source = randomized(timm.create_model("eva02_large_patch14_224", depth=1, num_classes=0))
    state = mim_extras(timm_to_eva_repo(source.state_dict()), 1024)
    path = tmp_path / "eva02_L_pt_m38m_p14.pt"
    torch.save({"module": {f"module.{k}": v for k, v in state.items()}}, path)

    trunk = timm.create_model("eva02_large_patch14_clip_336", depth=1, num_classes=0)
    report = load_vision_checkpoint(trunk, path)

    assert report.source_format == "eva02" and report.wrappers == ["module"]
    assert report.resampled == {"pos_embed": ((1, 257, 1024), (1, 577, 1024))}
    check_arrival(trunk, expected_from(source), report, resampled=("pos_embed",))


def test_eva01_giant_fused_qkv(tmp_path):
    source = randomized(timm.create_model("eva_giant_patch14_224", depth=1, num_classes=0))
    state = mim_extras(source.state_dict(), 1408)  # EVA-01 names are timm's
    del state["rope.freqs_cos"], state["rope.freqs_sin"]  # EVA-01 has no RoPE
    path = tmp_path / "eva_psz14.pt"
    torch.save({"state_dict": state}, path)

    trunk = timm.create_model("eva_giant_patch14_clip_224", depth=1, num_classes=0)
    report = load_vision_checkpoint(trunk, path)

    assert report.source_format == "eva01"
    assert "blocks.0.attn.q_bias" in report.loaded and "blocks.0.attn.qkv.weight" in report.loaded
    assert report.missing == []
    check_arrival(trunk, expected_from(source), report)


def test_timm_eva02_safetensors_moves_fc_norm_to_norm(tmp_path):
    source = randomized(timm.create_model("eva02_base_patch14_224", depth=2, num_classes=0))
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(path))

    trunk = timm.create_model("eva02_base_patch16_clip_224", depth=2, num_classes=0)
    report = load_vision_checkpoint(trunk, path)

    assert report.source_format == "timm" and report.renamed == {"fc_norm": "norm"}
    check_arrival(trunk, expected_from(source), report, resampled=("pos_embed", "patch_embed.proj.weight"))


def test_open_clip_checkpoint_loads_whole_trunk_including_projection(tmp_path):
    source = randomized(open_clip.create_model("test-eva02-xs"))
    path = tmp_path / "epoch_1.pt"
    torch.save({"state_dict": {f"module.{k}": v for k, v in source.state_dict().items()}}, path)

    target = open_clip.create_model("test-eva02-xs")
    report = load_vision_checkpoint(target.visual.trunk, path)

    assert report.source_format == "open_clip" and report.missing == [] and report.unexpected == []
    prefix = "visual.trunk."
    want = {k[len(prefix) :]: v for k, v in source.state_dict().items() if k.startswith(prefix)}
    check_arrival(target.visual.trunk, want, report)
    text_weight = "text.transformer.resblocks.0.mlp.c_fc.weight"
    assert not torch.equal(target.state_dict()[text_weight], source.state_dict()[text_weight])  # untouched


def test_eva_clip_checkpoint_takes_visual_keys_in_eva_names(tmp_path):
    source = randomized(timm.create_model("eva02_test_xs_patch8_clip_32", num_classes=32))
    state = {f"visual.{k}": v for k, v in timm_to_eva_repo(source.state_dict()).items()}
    state["visual.rope.freqs_cos"] = torch.randn(16, 16)
    state["text.token_embedding.weight"] = torch.randn(10, 32)
    state["logit_scale"] = torch.tensor(4.6)
    path = tmp_path / "EVA02_CLIP_xs.pt"
    torch.save(state, path)

    trunk = timm.create_model("eva02_test_xs_patch8_clip_32", num_classes=32)
    report = load_vision_checkpoint(trunk, path)

    assert report.source_format == "eva_clip" and report.dropped == ["visual.rope.freqs_cos"]
    assert report.missing == [] and report.unexpected == []  # the CLIP projection (head) is loaded too
    check_arrival(trunk, expected_from(source), report)


def tiny_mim_file(tmp_path, **kwargs):
    """A MIM-style checkpoint (EVA repository names) of a tiny EVA-02 trunk: no attn sub-LN, avg pool."""
    source = randomized(
        timm.create_model(
            "eva02_test_xs_patch8_clip_32", scale_attn_inner=False, global_pool="avg", num_classes=0, **kwargs
        )
    )
    state = mim_extras(timm_to_eva_repo(source.state_dict()), 32)
    path = tmp_path / "tiny_mim.pt"
    torch.save({"model": state}, path)
    return source, state, path


def test_create_model_loads_vision_checkpoint_and_logs(tmp_path, caplog):
    source, _, path = tiny_mim_file(tmp_path, img_size=28, patch_size=7)  # patch 7 -> 8 resampled
    with caplog.at_level(logging.INFO, logger="eva_fastclip.models.eva"):
        model = create_model(ModelConfig(name="test-eva02-xs", vision_checkpoint=str(path))).model
    assert "vision checkpoint" in caplog.text and "dropped" in caplog.text
    trunk = model.visual.trunk
    assert torch.equal(trunk.blocks[1].mlp.fc2.weight, source.blocks[1].mlp.fc2.weight)
    assert torch.equal(trunk.norm.weight, source.fc_norm.weight)
    assert torch.equal(trunk.pos_embed, source.pos_embed)  # same 4x4 grid: not resampled
    src_patch = source.patch_embed.proj.weight
    want = resample_patch_embed(src_patch, (8, 8), interpolation="bicubic", antialias=True)
    assert torch.equal(trunk.patch_embed.proj.weight, want)

    with pytest.raises(ConfigError, match="timm EVA trunk"):
        create_model(ModelConfig(name="test-vit-xs", vision_checkpoint=str(path)))


def test_non_eva_checkpoint_raises_naming_missing_blocks(tmp_path):
    path = tmp_path / "vit.pt"
    torch.save({"state_dict": open_clip.create_model("test-vit-xs").state_dict()}, path)
    trunk = timm.create_model("eva02_test_xs_patch8_clip_32")
    with pytest.raises(ValueError, match=r"vit\.pt.*'unknown'.*blocks\.0\.norm1\.weight"):
        load_vision_checkpoint(trunk, path)


def test_renamed_blocks_raise(tmp_path):
    _, state, path = tiny_mim_file(tmp_path)
    state = {k.replace("mlp.w3.", "mlp.w_out."): v for k, v in state.items()}
    torch.save(state, path)
    trunk = timm.create_model("eva02_test_xs_patch8_clip_32")
    message = r"'eva02'.*blocks\.0\.mlp\.fc2\.weight.*no place in the trunk.*w_out"
    with pytest.raises(ValueError, match=message):
        load_vision_checkpoint(trunk, path)


def test_depth_and_width_mismatches_raise(tmp_path):
    _, _, path = tiny_mim_file(tmp_path)
    with pytest.raises(ValueError, match=r"blocks\.2\.attn\.q_proj\.weight"):
        load_vision_checkpoint(timm.create_model("eva02_test_xs_patch8_clip_32", depth=3), path)
    with pytest.raises(ValueError, match=r"no place in the trunk: blocks\.1\."):
        load_vision_checkpoint(timm.create_model("eva02_test_xs_patch8_clip_32", depth=1), path)
    with pytest.raises(ValueError, match="shape mismatches"):
        load_vision_checkpoint(timm.create_model("eva02_test_xs_patch8_clip_32", embed_dim=64), path)


def test_partial_attention_sub_ln_is_not_tolerated(tmp_path):
    source = randomized(timm.create_model("eva02_test_xs_patch8_clip_32"))
    state = timm_to_eva_repo(source.state_dict())
    del state["blocks.1.attn.inner_attn_ln.weight"], state["blocks.1.attn.inner_attn_ln.bias"]
    path = tmp_path / "eva_clip_visual.pt"
    torch.save(state, path)
    with pytest.raises(ValueError, match=r"blocks\.1\.attn\.norm\.weight"):
        load_vision_checkpoint(timm.create_model("eva02_test_xs_patch8_clip_32"), path)


def test_patch_dropout_keeps_half_the_tokens_with_matching_rope():
    model = create_model(ModelConfig(name="test-eva02-xs", patch_dropout=0.5)).model
    trunk = model.visual.trunk
    num_patches = trunk.patch_embed.num_patches  # 16
    with torch.no_grad():  # tokens entering block 0 carry their own position index in channel 0
        trunk.patch_embed.proj.weight.zero_()
        trunk.patch_embed.proj.bias.zero_()
        trunk.cls_token.zero_()
        trunk.pos_embed.zero_()
        trunk.pos_embed[0, 1:, 0] = torch.arange(num_patches, dtype=torch.float32)
    seen = []
    trunk.blocks[0].register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append((args[0].detach(), kwargs["rope"])), with_kwargs=True
    )
    full_rope = trunk.rope.get_embed()  # [16, dim]
    images = torch.randn(3, 3, 32, 32)

    model.train()
    model.encode_image(images)
    x, rope = seen[-1]
    assert x.shape[1] == 1 + num_patches // 2  # CLS + half the patches
    kept = x[:, 1:, 0].round().long()  # [B, 8] positions of the kept patches
    assert len({tuple(row.tolist()) for row in kept}) > 1  # a different random keep per image
    assert rope.shape == (3, 1, num_patches // 2, full_rope.shape[-1])
    assert torch.equal(rope[:, 0], full_rope[kept])  # each kept token keeps its own RoPE row

    model.eval()
    model.encode_image(images)
    x, rope = seen[-1]
    assert x.shape[1] == 1 + num_patches and torch.equal(rope, full_rope)
