"""EVA-CLIP parameter groups: every parameter's lr and weight decay written out from the formula."""

import json
import re
from pathlib import Path

import open_clip
import pytest
import torch
from torch import nn

from eva_fastclip.config import ModelConfig, OptimConfig, load_config
from eva_fastclip.models import create_model
from eva_fastclip.optim.optimizer import build_optimizer
from eva_fastclip.optim.param_groups import parameter_groups
from eva_fastclip.optim.schedule import build_scheduler
from eva_fastclip.plan.deepspeed_json import load_deepspeed_config

LAMB_JSON = Path(__file__).parents[1] / "ds_configs" / "zero1_bf16_lamb.json"
# EVA-CLIP B/16 values, with different decays per tower so a mix-up shows
OPTIM = OptimConfig(
    lr=1e-3,
    weight_decay=0.05,
    visual_lr=2e-4,
    text_lr=2e-5,
    visual_weight_decay=0.05,
    text_weight_decay=0.02,
    visual_layer_decay=0.75,
    text_layer_decay=0.5,
)

# Per architecture: (regex on the parameter name, tower, layer id) tried in order; "block" means block
# index + 1 and "head" means L + 1. Matrices that are embeddings (never decayed) are listed by name.
VIT_XS = {  # open_clip CLIP with the native ViT and the built-in text tower
    "rules": [
        (r"visual\.(conv1|class_embedding|positional_embedding|ln_pre)\b", "visual", 0),
        (r"visual\.transformer\.resblocks\.(\d+)\.", "visual", "block"),
        (r"visual\.(ln_post|proj)\b", "visual", "head"),
        (r"(token_embedding|positional_embedding)\b", "text", 0),
        (r"transformer\.resblocks\.(\d+)\.", "text", "block"),
        (r"(ln_final|text_projection)\b", "text", "head"),
        (r"logit_scale$", None, None),
    ],
    "blocks": {"visual": 2, "text": 2},
    "embedding_matrices": {"visual.positional_embedding", "token_embedding.weight", "positional_embedding"},
}
CUSTOM_TEXT = [  # the text tower of a CustomTextCLIP (open_clip TextTransformer under `text.`)
    (r"text\.(token_embedding|positional_embedding)\b", "text", 0),
    (r"text\.transformer\.resblocks\.(\d+)\.", "text", "block"),
    (r"text\.(ln_final|text_projection)\b", "text", "head"),
    (r"logit_scale$", None, None),
]
TIMM_TRUNK = [  # a timm ViT / Eva trunk in open_clip's TimmModel
    (r"visual\.trunk\.(cls_token|reg_token|pos_embed|patch_embed)\b", "visual", 0),
    (r"visual\.trunk\.blocks\.(\d+)\.", "visual", "block"),
    (r"visual\.trunk\.(norm|fc_norm|attn_pool|head)\b", "visual", "head"),
    (r"visual\.head\.proj\b", "visual", "head"),
]
EVA02_XS = {  # the shipped timm Eva trunk (projection in the trunk's head)
    "rules": TIMM_TRUNK + CUSTOM_TEXT,
    "blocks": {"visual": 2, "text": 2},
    "embedding_matrices": {
        "visual.trunk.cls_token",
        "visual.trunk.pos_embed",
        "text.token_embedding.weight",
        "text.positional_embedding",
    },
}
TIMM_VIT = {  # timm's test_vit3: 9 blocks, register token, attention-pool head, open_clip's linear proj
    "rules": TIMM_TRUNK + CUSTOM_TEXT,
    "blocks": {"visual": 9, "text": 2},
    # reg_token is 3-D and named like no embedding: decayed, as timm's and EVA-CLIP's no_weight_decay do
    "embedding_matrices": {
        "visual.trunk.pos_embed",
        "text.token_embedding.weight",
        "text.positional_embedding",
    },
}
HF_TEXT = {  # open_clip's ViT with a (tiny BERT) Hugging Face text tower
    "rules": VIT_XS["rules"][:3]
    + [
        (r"text\.transformer\.embeddings\.", "text", 0),
        (r"text\.transformer\.encoder\.layer\.(\d+)\.", "text", "block"),
        (r"text\.(transformer\.pooler|proj)\.", "text", "head"),
        (r"logit_scale$", None, None),
    ],
    "blocks": {"visual": 2, "text": 2},
    "embedding_matrices": {
        "visual.positional_embedding",
        "text.transformer.embeddings.word_embeddings.weight",
        "text.transformer.embeddings.position_embeddings.weight",
        "text.transformer.embeddings.token_type_embeddings.weight",
    },
}

TIMM_VIT_CONFIG = {
    "embed_dim": 32,
    "vision_cfg": {
        "image_size": 160,
        "timm_model_name": "test_vit3",
        "timm_model_pretrained": False,
        "timm_pool": "",  # keep the trunk's attention pool
        "timm_proj": "linear",
    },
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
    "custom_text": True,
}


def _hf_text_model() -> nn.Module:
    from open_clip.hf_model import HFTextEncoder
    from transformers import BertConfig

    bert = BertConfig(
        vocab_size=100,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    model = nn.Module()
    model.visual = open_clip.create_model("test-vit-xs").visual
    model.text = HFTextEncoder("bert", 32, config=bert, pooler_type="cls_pooler", proj_type="linear")
    model.logit_scale = nn.Parameter(torch.ones(1))
    return model


@pytest.fixture(scope="module")
def timm_vit_name(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("configs") / "pg-test-timm-vit3.json"
    path.write_text(json.dumps(TIMM_VIT_CONFIG))
    open_clip.add_model_config(path)
    return path.stem


def _build(arch: str, timm_vit_name: str) -> tuple[nn.Module, dict]:
    if arch == "hf-text":
        return _hf_text_model(), HF_TEXT
    name, spec = {
        "test-vit-xs": ("test-vit-xs", VIT_XS),
        "test-eva02-xs": ("test-eva02-xs", EVA02_XS),
        "timm-vit": (timm_vit_name, TIMM_VIT),
    }[arch]
    return create_model(ModelConfig(name=name)).model, spec


ARCHS = ["test-vit-xs", "test-eva02-xs", "timm-vit", "hf-text"]


def expected_layer(name: str, spec: dict) -> tuple[str | None, int | None]:
    for pattern, tower, layer in spec["rules"]:
        match = re.match(pattern, name)
        if match is None:
            continue
        if layer == "block":
            layer = int(match.group(1)) + 1
        elif layer == "head":
            layer = spec["blocks"][tower] + 1
        return tower, layer
    raise AssertionError(f"the test has no rule for {name}")


def expected_lr_wd(name: str, param: nn.Parameter, spec: dict, optim: OptimConfig) -> tuple[float, float]:
    tower, layer = expected_layer(name, spec)
    undecayed = param.ndim < 2 or name in spec["embedding_matrices"] or name == "logit_scale"
    if tower is None:  # the temperature without a group of its own
        return optim.lr, 0.0
    lr = {"visual": optim.visual_lr, "text": optim.text_lr}[tower] or optim.lr
    wd = {"visual": optim.visual_weight_decay, "text": optim.text_weight_decay}[tower]
    decay = {"visual": optim.visual_layer_decay, "text": optim.text_layer_decay}[tower]
    big_l = spec["blocks"][tower]
    return lr * decay ** (big_l + 1 - layer), 0.0 if undecayed else (optim.weight_decay if wd is None else wd)


def group_of(groups: list[dict]) -> dict[int, dict]:
    """parameter id -> its group, checking that no parameter is in two groups."""
    out: dict[int, dict] = {}
    for group in groups:
        for param in group["params"]:
            assert id(param) not in out, f"a parameter is in {out[id(param)]['name']} and {group['name']}"
            out[id(param)] = group
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_every_parameter_gets_its_eva_clip_lr_and_weight_decay(arch, timm_vit_name):
    model, spec = _build(arch, timm_vit_name)
    for name, module in [("visual", model.visual), ("text", getattr(model, "text", None))]:
        if name in spec["blocks"] and module is not None and hasattr(module, "trunk"):
            assert len(module.trunk.blocks) == spec["blocks"][name]  # the test's L is the real one
    frozen = [p for n, p in model.named_parameters() if re.search(r"(resblocks|blocks|layer)\.1\.", n)]
    frozen = frozen[: len(frozen) // 2]
    for param in frozen:
        param.requires_grad_(False)

    groups = parameter_groups(model, OPTIM)
    owner = group_of(groups)
    assert all(g["params"] for g in groups)
    names = [g["name"] for g in groups]
    assert len(names) == len(set(names))
    for name, param in model.named_parameters():
        if not param.requires_grad:
            assert id(param) not in owner, f"frozen {name} is in {owner[id(param)]['name']}"
            continue
        group = owner[id(param)]
        lr, wd = expected_lr_wd(name, param, spec, OPTIM)
        assert group["lr"] == pytest.approx(lr, rel=1e-12), name
        assert group["weight_decay"] == wd, name
        tower, layer = expected_layer(name, spec)
        kind = "decay" if wd > 0 else "no_decay"
        if name == "logit_scale":  # a learned temperature is alone in its group
            assert group["name"] == "other.temperature" and group["params"] == [param]
        else:
            assert group["name"] == (f"{tower}.layer_{layer:02d}.{kind}" if tower else f"other.{kind}"), name
    heads = [g for g in groups if g["name"].startswith("visual.layer") and g["lr"] == OPTIM.visual_lr]
    assert heads and all(g["layer_id"] == spec["blocks"]["visual"] + 1 for g in heads)


@pytest.mark.parametrize("arch", ARCHS)
def test_defaults_give_every_parameter_the_old_lr_and_weight_decay(arch, timm_vit_name):
    model, _ = _build(arch, timm_vit_name)
    optim = OptimConfig()
    owner = group_of(parameter_groups(model, optim))
    old_no_decay = ("logit_scale", "logit_bias", "embedding", "pos_embed", "cls_token", "class_embedding")
    for name, param in model.named_parameters():
        old_decay = param.ndim >= 2 and not any(part in name for part in old_no_decay)
        assert owner[id(param)]["lr"] == optim.lr, name
        assert owner[id(param)]["weight_decay"] == (optim.weight_decay if old_decay else 0.0), name


def test_biases_norms_embeddings_and_the_temperature_are_not_decayed():
    model = create_model(ModelConfig(name="test-eva02-xs")).model
    owner = group_of(parameter_groups(model, OPTIM))
    params = dict(model.named_parameters())
    for name in [
        "logit_scale",
        "visual.trunk.cls_token",
        "visual.trunk.pos_embed",
        "visual.trunk.patch_embed.proj.bias",
        "visual.trunk.blocks.0.norm1.weight",
        "visual.trunk.norm.weight",
        "text.token_embedding.weight",
        "text.positional_embedding",
        "text.ln_final.bias",
    ]:
        assert owner[id(params[name])]["weight_decay"] == 0.0, name
    decayed = ["visual.trunk.blocks.0.attn.q_proj.weight", "visual.trunk.head.weight", "text.text_projection"]
    for name in decayed:
        assert owner[id(params[name])]["weight_decay"] > 0, name


def test_temperature_gets_its_own_group_with_temperature_lr():
    model = create_model(ModelConfig(name="test-vit-xs")).model
    groups = parameter_groups(model, OPTIM, temperature_lr=2e-4)
    temperature = [g for g in groups if g["name"] == "temperature"]
    assert len(temperature) == 1
    assert temperature[0]["params"] == [model.logit_scale]
    assert (temperature[0]["lr"], temperature[0]["weight_decay"]) == (2e-4, 0.0)
    assert groups[-1] is temperature[0]
    # without temperature_lr: its own group at optim.lr, not the constant-lr "temperature" one
    owner = group_of(parameter_groups(model, OPTIM))
    group = owner[id(model.logit_scale)]
    assert (group["name"], group["lr"], group["weight_decay"]) == ("other.temperature", OPTIM.lr, 0.0)
    assert group["params"] == [model.logit_scale]


@pytest.mark.parametrize("temperature_lr", [None, 2e-4])
@pytest.mark.parametrize("trust_ratio", [False, True])
def test_only_the_temperature_group_carries_the_trust_ratio_switch(temperature_lr, trust_ratio):
    model = create_model(ModelConfig(name="test-vit-xs")).model
    optim = OptimConfig(temperature_trust_ratio=trust_ratio)
    owner = group_of(parameter_groups(model, optim, temperature_lr=temperature_lr))
    for name, param in model.named_parameters():
        group = owner[id(param)]
        assert group.get("trust_ratio", "absent") == (trust_ratio if name == "logit_scale" else "absent"), (
            name
        )
    assert OptimConfig().temperature_trust_ratio is False  # FastCLIP steps tau without a trust ratio


def test_a_tower_without_readable_layers_is_refused_under_layer_decay():
    model = nn.Module()
    model.visual = open_clip.model.ModifiedResNet(
        layers=(1, 1, 1, 1), output_dim=32, heads=2, image_size=64, width=8
    )
    model.logit_scale = nn.Parameter(torch.ones(1))
    with pytest.raises(ValueError, match=r"visual_layer_decay=0.75 .*ModifiedResNet.*no block list found"):
        parameter_groups(model, OPTIM)
    # with layer decay 1 the layers do not matter: one lr for the tower
    groups = parameter_groups(model, OptimConfig(visual_lr=3e-4))
    assert {g["name"] for g in groups} == {"visual.decay", "visual.no_decay", "other.temperature"}
    assert {g["lr"] for g in groups if g["name"].startswith("visual")} == {3e-4}


def test_unknown_parameters_before_the_blocks_are_refused():
    model = nn.Module()
    model.visual = nn.Module()
    model.visual.adapter = nn.Linear(2, 2)  # before the blocks, but no embedding we know
    model.visual.transformer = nn.Module()
    model.visual.transformer.resblocks = nn.ModuleList([nn.Linear(2, 2)])
    model.visual.proj = nn.Linear(2, 2)  # after the blocks: a head
    with pytest.raises(ValueError, match=r"visual.adapter.weight.*would be a guess"):
        parameter_groups(model, OPTIM)
    del model.visual.adapter
    groups = {g["name"]: g for g in parameter_groups(model, OPTIM)}
    assert groups["visual.layer_02.decay"]["params"] == [model.visual.proj.weight]
    assert groups["visual.layer_01.decay"]["params"] == [model.visual.transformer.resblocks[0].weight]


def test_schedule_keeps_the_lr_ratios_between_groups():
    cfg = load_config(None, ["optim.warmup_steps=2", "optim.min_lr_ratio=0.1"])  # only the schedule
    ds = load_deepspeed_config(LAMB_JSON)
    ds["optimizer"]["params"].update(lr=OPTIM.lr, weight_decay=OPTIM.weight_decay)  # as resolved
    model = create_model(ModelConfig(name="test-vit-xs")).model
    optimizer = build_optimizer(ds, model, OPTIM, cuda=False, temperature_lr=5e-4)
    peaks = {g["name"]: g["lr"] for g in optimizer.param_groups}
    assert len(peaks) > 10  # one group per layer
    assert optimizer.defaults["lr"] == OPTIM.lr  # the DeepSpeed JSON's lr stays the default
    scheduler = build_scheduler(optimizer, cfg, total_steps=8)
    for _ in range(5):
        optimizer.step()
        scheduler.step()
        lrs = {g["name"]: g["lr"] for g in optimizer.param_groups}
        assert lrs.pop("temperature") == 5e-4  # constant
        ratios = {name: lr / peaks[name] for name, lr in lrs.items()}
        assert max(ratios.values()) == pytest.approx(min(ratios.values()), rel=1e-12)
    assert ratios["visual.layer_03.decay"] < 1.0  # the schedule did move


def test_build_optimizer_refuses_an_unresolved_deepspeed_config():
    ds = load_deepspeed_config(LAMB_JSON)
    ds["optimizer"]["params"].update(lr=1e-4, weight_decay=0.1)
    with pytest.raises(ValueError, match="resolve_deepspeed_config"):
        build_optimizer(ds, nn.Linear(2, 2), OptimConfig(lr=1e-3), cuda=False)


# ---- optim.weight_decay_rule against the references' own rules, written out ------------------------


def fastclip_decays(name: str, param: nn.Parameter) -> bool:
    """FastCLIP's main.py (HEAD efd89d5, lines 316-318): `exclude` goes to the weight-decay-0 group, the
    temperature to its own group (also without weight decay), the rest is decayed."""
    exclude = (param.ndim < 2 and "logit_scale" not in name) or "bn" in name or "ln" in name or "bias" in name
    return not exclude and "logit_scale" not in name


#: EVA-CLIP's towers' no_weight_decay() sets with the tower prefix: EVA ViT {pos_embed, cls_token} (our
#: timm trunk holds them), open_clip-style ViT {positional_embedding, class_embedding}, text
#: {positional_embedding}; ModifiedResNet and Hugging Face towers have none.
EVA_CLIP_SKIP = {
    "test-vit-xs": {"visual.positional_embedding", "visual.class_embedding", "positional_embedding"},
    "test-eva02-xs": {"visual.trunk.pos_embed", "visual.trunk.cls_token", "text.positional_embedding"},
    "timm-vit": {"visual.trunk.pos_embed", "visual.trunk.cls_token", "text.positional_embedding"},
    "hf-text": {"visual.positional_embedding", "visual.class_embedding"},
    "test-rn-xs": {"positional_embedding"},
}


def eva_clip_decays(name: str, param: nn.Parameter, arch: str) -> bool:
    """EVA-CLIP's rei/training/optim.py:97 (HEAD 5623d08): no decay for ndim <= 1, *.bias and the skip set."""
    return not (param.ndim <= 1 or name.endswith(".bias") or name in EVA_CLIP_SKIP[arch])


@pytest.mark.parametrize("arch", [*ARCHS, "test-rn-xs"])
@pytest.mark.parametrize("rule", ["fastclip", "eva_clip"])
def test_weight_decay_rules_follow_the_references(arch, rule, timm_vit_name):
    if arch == "test-rn-xs":
        model = create_model(ModelConfig(name="test-rn-xs")).model
    else:
        model, _ = _build(arch, timm_vit_name)
    optim = OptimConfig(weight_decay=0.1, text_weight_decay=0.02, weight_decay_rule=rule)
    owner = group_of(parameter_groups(model, optim, temperature_lr=2e-4))
    reference = fastclip_decays if rule == "fastclip" else lambda n, p: eva_clip_decays(n, p, arch)
    decayed = set()
    for name, param in model.named_parameters():
        group = owner[id(param)]
        if reference(name, param):
            decayed.add(name)
            assert group["weight_decay"] == (0.02 if group["name"].startswith("text") else 0.1), name
            assert group["name"].endswith(".decay"), name
        else:
            assert group["weight_decay"] == 0.0, name
    # what sets the rules apart from ours ("no_embeddings"): both decay the token embedding, FastCLIP's
    # the position embeddings too
    custom_text = arch in ("test-eva02-xs", "timm-vit")
    token = "text.token_embedding.weight" if custom_text else "token_embedding.weight"
    if arch != "hf-text":
        assert token in decayed
    if rule == "fastclip" and arch in ("test-vit-xs", "test-eva02-xs"):
        assert {"visual.positional_embedding", "visual.trunk.pos_embed"} & decayed


def test_weight_decay_rule_is_validated():
    with pytest.raises(ValueError, match="optim.weight_decay_rule must be one of"):
        OptimConfig(weight_decay_rule="openclip")
    assert OptimConfig().weight_decay_rule == "no_embeddings"
