import math

import open_clip
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eva_fastclip.evaluation import (
    build_zeroshot_classifier,
    evaluate_classification,
    evaluate_retrieval,
    retrieval_recall,
    topk_accuracy,
)

# ---------------------------------------------------------------- metrics


def test_topk_accuracy_hand_computed():
    logits = torch.tensor(
        [
            [5.0, 1.0, 0.0, 0.0, 0.0, 0.0],  # label 0 is the max: top1 hit
            [1.0, 4.0, 3.0, 2.0, 0.0, -1.0],  # label 2 is second: top1 miss, top2/top5 hit
            [0.0, 1.0, 2.0, 3.0, 4.0, 5.0],  # label 0 is last of 6: top5 miss
            [2.0, 2.0, 0.0, 0.0, 0.0, 0.0],  # label 1 ties class 0: a tie is not a top1 hit
        ]
    )
    labels = torch.tensor([0, 2, 0, 1])
    assert topk_accuracy(logits, labels) == {"top1": 1 / 4, "top5": 3 / 4}
    assert topk_accuracy(logits, labels, ks=(1, 2)) == {"top1": 1 / 4, "top2": 3 / 4}


def test_topk_accuracy_fewer_classes_than_k():
    logits = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    labels = torch.tensor([0, 1])  # ranks 2 and 1
    # top5 is clamped to top3 = every sample.
    assert topk_accuracy(logits, labels, ks=(1, 2, 5)) == {"top1": 0.0, "top2": 0.5, "top5": 1.0}


# With identity image features the similarity matrix equals text_features.T, so it can be written out.
SIMILARITY = torch.tensor(
    [
        # t0   t1   t2   t3   t4
        [0.9, 0.2, 0.8, 0.1, 0.3],  # img0, captions t0, t1
        [0.5, 0.1, 0.7, 0.3, 0.7],  # img1, caption t2
        [0.1, 0.6, 0.3, 0.4, 0.2],  # img2, captions t3, t4
    ]
)
TEXT_TO_IMAGE = torch.tensor([0, 0, 1, 2, 2])


def test_retrieval_recall_hand_computed():
    metrics = retrieval_recall(torch.eye(3), SIMILARITY.T, TEXT_TO_IMAGE, ks=(1, 2, 3))
    # Image->text rank = number of wrong captions scoring >= the best right caption:
    #   img0: best right t0=0.9, wrong {t2 .8, t3 .1, t4 .3} -> rank 0
    #   img1: right t2=0.7, wrong t4=0.7 ties it           -> rank 1 (a tie is not a hit)
    #   img2: best right t3=0.4, wrong t1=0.6 beats it      -> rank 1
    assert metrics["image_to_text_R@1"] == pytest.approx(1 / 3)
    assert metrics["image_to_text_R@2"] == 1.0
    assert metrics["image_to_text_R@3"] == 1.0
    # Text->image, per column:
    #   t0 -> img0 .9, others {.5, .1}  -> rank 0
    #   t1 -> img0 .2, img2 .6 beats it -> rank 1
    #   t2 -> img1 .7, img0 .8 beats it -> rank 1
    #   t3 -> img2 .4, others {.1, .3}  -> rank 0
    #   t4 -> img2 .2, img0 .3, img1 .7 -> rank 2
    assert metrics["text_to_image_R@1"] == pytest.approx(2 / 5)
    assert metrics["text_to_image_R@2"] == pytest.approx(4 / 5)
    assert metrics["text_to_image_R@3"] == 1.0


def test_retrieval_recall_default_keys():
    metrics = retrieval_recall(torch.eye(3), SIMILARITY.T, TEXT_TO_IMAGE)
    assert list(metrics) == [f"{d}_R@{k}" for d in ("image_to_text", "text_to_image") for k in (1, 5, 10)]
    assert metrics["image_to_text_R@1"] == pytest.approx(1 / 3)
    assert metrics["text_to_image_R@1"] == pytest.approx(2 / 5)
    # Only 5 captions and 3 images, so everything is within the top 5 and top 10.
    assert all(metrics[f"{d}_R@{k}"] == 1.0 for d in ("image_to_text", "text_to_image") for k in (5, 10))


def test_retrieval_recall_constant_scores_get_no_free_hits():
    # All similarities equal: every wrong item ties the right one, so nothing is a hit before k = #wrong + 1.
    images = F.normalize(torch.ones(3, 4), dim=-1)
    texts = F.normalize(torch.ones(5, 4), dim=-1)
    metrics = retrieval_recall(images, texts, TEXT_TO_IMAGE, ks=(1, 2, 3, 4))
    # img0/img2 have 3 wrong captions, img1 has 4.
    assert [metrics[f"image_to_text_R@{k}"] for k in (1, 2, 3, 4)] == pytest.approx([0, 0, 0, 2 / 3])
    # Every caption has 2 wrong images.
    assert [metrics[f"text_to_image_R@{k}"] for k in (1, 2, 3)] == [0.0, 0.0, 1.0]


def test_retrieval_recall_rejects_image_without_caption():
    with pytest.raises(ValueError):
        retrieval_recall(torch.eye(3), torch.eye(3)[:2], torch.tensor([0, 1]))


# ---------------------------------------------------------------- fake models

NUM_CLASSES = 6
DIM = NUM_CLASSES + 1  # one extra direction for a template-dependent offset
TEMPLATES = ["a photo of a {}.", "a drawing of a {}."]
CLASSNAMES = [f"class{c}" for c in range(NUM_CLASSES)]


def fake_tokenize(texts: list[str]) -> Tensor:
    """Token ids [class index, template index], recovered from the text."""
    rows = []
    for text in texts:
        template = next(t for t, tpl in enumerate(TEMPLATES) if text.startswith(tpl.split("{}")[0]))
        rows.append([int(text.split("class")[1].rstrip(".")), template])
    return torch.tensor(rows)


class FakeModel(nn.Module):
    """Images are feature vectors already; text (c, t) encodes to e_c + (+1 | -1) * e_extra.

    Averaging the normalised text embeddings over the two templates cancels the extra direction, so the
    correct classifier is exactly the one-hot class directions. Records the training flag it ran under.
    """

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))  # gives the model a dtype; unused otherwise
        self.tower = nn.Linear(1, 1)  # a submodule whose training flag must be restored too
        self.seen_training: list[bool] = []

    def encode_image(self, images: Tensor, normalize: bool = False) -> Tensor:
        self.seen_training.append(self.training or self.tower.training)
        return F.normalize(images, dim=-1) if normalize else images

    def encode_text(self, tokens: Tensor, normalize: bool = False) -> Tensor:
        self.seen_training.append(self.training or self.tower.training)
        features = F.one_hot(tokens[:, 0], DIM).float()
        features[:, -1] = torch.where(tokens[:, 1] == 0, 1.0, -1.0)
        features = features * (1.0 + tokens[:, :1])  # class-dependent magnitude, removed by normalising
        return F.normalize(features, dim=-1) if normalize else features


def batches(*tensors: Tensor, size: int):
    return [tuple(t[i : i + size] for t in tensors) for i in range(0, len(tensors[0]), size)]


def test_build_zeroshot_classifier_averages_over_templates():
    model = FakeModel()
    classifier = build_zeroshot_classifier(
        model, fake_tokenize, CLASSNAMES, TEMPLATES, device="cpu", batch_size=5
    )
    assert classifier.shape == (DIM, NUM_CLASSES)
    assert classifier.dtype == torch.float32
    # Template offsets cancel: each column is the unit class direction.
    torch.testing.assert_close(classifier, torch.eye(DIM)[:, :NUM_CLASSES])
    # With one template the offset survives: column = (e_c + e_extra) / sqrt(2).
    single = build_zeroshot_classifier(model, fake_tokenize, CLASSNAMES, TEMPLATES[:1], device="cpu")
    torch.testing.assert_close(single[-1], torch.full((NUM_CLASSES,), 1 / math.sqrt(2)))


@pytest.mark.parametrize("initially_training", [True, False])
def test_evaluate_classification_known_accuracy(initially_training: bool):
    model = FakeModel().train(initially_training)
    classifier = torch.eye(DIM)[:, :NUM_CLASSES]
    # Sample i looks like class a = i % 6, a bit like b = a + 1, and unlike c = a + 2 (strictly lowest).
    true, near, far = ((torch.arange(8) + offset) % NUM_CLASSES for offset in (0, 1, 2))
    images = F.one_hot(true, DIM) + 0.5 * F.one_hot(near, DIM) - 0.5 * F.one_hot(far, DIM)
    labels = true.clone()
    labels[6] = near[6]  # mislabelled: top1 miss, still in top5
    labels[7] = far[7]  # mislabelled: ranked last of 6, so a top5 miss
    metrics = evaluate_classification(
        model, classifier, batches(images.float(), labels, size=3), device="cpu"
    )
    assert metrics == {"top1": 6 / 8, "top5": 7 / 8, "num_samples": 8}
    assert model.seen_training and not any(model.seen_training)
    assert model.training is initially_training and model.tower.training is initially_training


def test_evaluate_classification_restores_mode_on_error():
    model = FakeModel().train()
    with pytest.raises(ValueError):
        evaluate_classification(model, torch.eye(DIM), [(torch.ones(2, DIM), torch.zeros(3))], device="cpu")
    assert model.training and model.tower.training


class VectorTextModel(FakeModel):
    """Retrieval fake: both images and "tokens" are feature vectors."""

    def encode_text(self, tokens: Tensor, normalize: bool = False) -> Tensor:
        return self.encode_image(tokens, normalize)


def test_evaluate_retrieval_perfect():
    model = VectorTextModel().train()
    features = torch.eye(5)
    metrics = evaluate_retrieval(model, batches(features, features.clone(), size=2), device="cpu")
    assert metrics == {
        **{f"{d}_R@{k}": 1.0 for d in ("image_to_text", "text_to_image") for k in (1, 5, 10)},
        "num_samples": 5,
    }
    assert model.training and not any(model.seen_training)


def test_evaluate_retrieval_known_recall():
    images = torch.eye(4)
    texts = torch.eye(4)
    texts[3] = torch.tensor([2.0, 0.0, 0.0, 1.0])  # caption 3 looks more like image 0 than image 3
    # sim[:, 3] = [2, 0, 0, 1] / sqrt(5). Image 0 still prefers its own caption (1 > 0.89) and image 3 has
    # no better caption than its own, so image->text is perfect; caption 3 ranks image 3 second.
    metrics = evaluate_retrieval(VectorTextModel(), batches(images, texts, size=3), device="cpu")
    assert metrics["image_to_text_R@1"] == 1.0
    assert metrics["text_to_image_R@1"] == 3 / 4
    assert metrics["text_to_image_R@5"] == 1.0
    assert metrics["num_samples"] == 4


# ---------------------------------------------------------------- real open_clip smoke test


def test_open_clip_smoke():
    torch.manual_seed(0)
    model = open_clip.CLIP(
        embed_dim=32,
        vision_cfg=dict(image_size=32, layers=1, width=32, patch_size=8, head_width=16),  # 2 heads
        text_cfg=dict(context_length=16, vocab_size=49408, width=32, heads=2, layers=1),
    )
    tok = open_clip.get_tokenizer("ViT-B-32")

    def tokenize(texts):
        return tok(texts, context_length=16)

    classnames = ["cat", "dog", "car"]
    classifier = build_zeroshot_classifier(
        model, tokenize, classnames, ["a photo of a {}.", "a {}."], device="cpu"
    )
    assert classifier.shape == (32, 3)
    torch.testing.assert_close(classifier.norm(dim=0), torch.ones(3))

    images = torch.randn(6, 3, 32, 32)
    labels = torch.tensor([0, 1, 2, 0, 1, 2])
    for autocast_dtype in (None, torch.bfloat16):
        metrics = evaluate_classification(
            model, classifier, batches(images, labels, size=4), device="cpu", autocast_dtype=autocast_dtype
        )
        assert set(metrics) == {"top1", "top5", "num_samples"} and metrics["num_samples"] == 6
        assert 0.0 <= metrics["top1"] <= metrics["top5"] == 1.0  # 3 classes: top5 covers all

    captions = tokenize([f"a photo of a {c}" for c in ["cat", "dog", "car", "bird", "tree", "boat"]])
    metrics = evaluate_retrieval(
        model, batches(images, captions, size=4), device="cpu", autocast_dtype=torch.bfloat16
    )
    assert metrics.pop("num_samples") == 6
    assert len(metrics) == 6 and all(0.0 <= value <= 1.0 for value in metrics.values())
    assert model.training  # open_clip models start in training mode
