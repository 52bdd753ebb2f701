"""Kernel selection falls back cleanly and never mistakes PyPI's "apex" for NVIDIA apex; token masking can
be switched off at run time (EVA-CLIP's unmasked final phase), in the model and through the trainer."""

import sys

import pytest
import torch
from stand_ins import StandInBatches, toy_config, toy_trainer
from torch import nn

from eva_fastclip.config import ModelConfig
from eva_fastclip.models import create_model, kernels
from eva_fastclip.models.masking import patch_dropout_modules, set_patch_dropout


def tokens_seen_by_first_block(model, images, tokens, train: bool) -> int:
    """How many tokens reach the vision tower's first transformer block (open_clip ViT or timm EVA)."""
    visual = model.visual
    blocks = visual.trunk.blocks if hasattr(visual, "trunk") else visual.transformer.resblocks
    seen = []
    handle = blocks[0].register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[1]))
    model.train(train)
    with torch.no_grad():
        model(images, tokens)
    handle.remove()
    return seen[0]


@pytest.mark.parametrize("arch", ["test-vit-xs", "test-eva02-xs"])
def test_patch_dropout_halves_tokens_in_training_and_can_be_switched_off(arch):
    torch.manual_seed(0)
    bundle = create_model(ModelConfig(name=arch, patch_dropout=0.5))
    model = bundle.model
    images, tokens = torch.randn(2, 3, 32, 32), bundle.tokenizer(["a red circle", "two blue squares"])
    patches = (32 // 8) ** 2
    assert len(patch_dropout_modules(model)) == 1
    assert tokens_seen_by_first_block(model, images, tokens, train=True) == 1 + patches // 2
    assert tokens_seen_by_first_block(model, images, tokens, train=False) == 1 + patches

    assert set_patch_dropout(model, 0.0) == 1
    assert tokens_seen_by_first_block(model, images, tokens, train=True) == 1 + patches
    model.train()
    with torch.no_grad():
        trained = model(images, tokens)
    model.eval()
    with torch.no_grad():
        evaluated = model(images, tokens)
    torch.testing.assert_close(trained[0], evaluated[0])  # nothing else is random in these towers


def test_set_patch_dropout_rejects_bad_values():
    bundle = create_model(ModelConfig(name="test-vit-xs", patch_dropout=0.5))
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        set_patch_dropout(bundle.model, 1.0)


def test_pypi_apex_is_not_nvidia_apex(tmp_path, monkeypatch):
    fake = tmp_path / "apex"
    fake.mkdir()
    (fake / "__init__.py").write_text("# the unrelated PyPI project of that name\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "apex", raising=False)
    assert kernels.nvidia_apex_layer_norm() is None


def test_nvidia_apex_is_detected_by_its_compiled_extension(tmp_path, monkeypatch):
    (tmp_path / "apex" / "normalization").mkdir(parents=True)
    (tmp_path / "apex" / "__init__.py").write_text("")
    (tmp_path / "apex" / "normalization" / "__init__.py").write_text(
        "import torch\nclass FusedLayerNorm(torch.nn.LayerNorm):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("apex", "apex.normalization", "fused_layer_norm_cuda"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert kernels.nvidia_apex_layer_norm() is None  # no fused_layer_norm_cuda: not a CUDA build
    (tmp_path / "fused_layer_norm_cuda.py").write_text("")
    cls = kernels.nvidia_apex_layer_norm()
    assert cls is not None and cls.__name__ == "FusedLayerNorm"


def test_replace_layer_norms_keeps_outputs():
    torch.manual_seed(0)
    model = create_model(ModelConfig(name="test-vit-xs")).model.eval()
    for module in model.modules():  # non-trivial affine parameters, so a lost copy would show
        if isinstance(module, nn.LayerNorm):
            nn.init.normal_(module.weight)
            nn.init.normal_(module.bias)
    images, tokens = torch.randn(2, 3, 32, 32), torch.randint(1, 1000, (2, 16))
    with torch.no_grad():
        before = model(images, tokens)[:2]

    class Fused(nn.LayerNorm):
        pass

    expected = sum(1 for m in model.modules() if isinstance(m, nn.LayerNorm))
    model.ln_final.requires_grad_(False)  # as in a locked text tower
    assert kernels.replace_layer_norms(model, kernels._apex_copy(Fused)) == expected > 0
    assert not any(type(m) is nn.LayerNorm for m in model.modules())
    assert isinstance(model.ln_final, Fused) and not any(p.requires_grad for p in model.ln_final.parameters())
    assert all(p.requires_grad for p in model.visual.ln_post.parameters())
    with torch.no_grad():
        after = model(images, tokens)[:2]
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b)


def test_cpu_kernels_report_sdpa_and_fallbacks():
    model = create_model(ModelConfig(name="test-eva02-xs")).model
    report = kernels.configure_kernels(model, torch.device("cpu"))
    assert report.attention == "sdpa" and report.layer_norm == "torch"
    assert "attention=sdpa" in report.summary()


def test_trainer_runs_the_final_steps_unmasked(tmp_path):
    cfg = toy_config(
        tmp_path,
        "model.name=test-eva02-xs",
        "model.patch_dropout=0.5",
        "model.unmasked_final_steps=2",
        "train.batch_size=8",
        "train.steps=6",
    )
    trainer = toy_trainer(cfg, loader=StandInBatches(4, 8, dataset_size=8, indices="arange"))
    (dropout,) = patch_dropout_modules(trainer.engine.module)
    seen = []
    step = trainer.train_step
    trainer.train_step = lambda *batch: (seen.append(dropout.prob), step(*batch))[1]
    trainer.train()
    assert seen == [0.5, 0.5, 0.5, 0.5, 0.0, 0.0]
