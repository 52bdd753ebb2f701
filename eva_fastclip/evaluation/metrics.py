"""Pure tensor metrics for zero-shot classification and image-text retrieval.

Ranks are pessimistic: a ground-truth item's rank is the number of *other* items scoring at least as
high as it, so ties never count in the model's favour (a constant-score model gets no free hits).
"""

from collections.abc import Sequence

import torch
from torch import Tensor


def _pessimistic_rank(scores: Tensor, target_mask: Tensor) -> Tensor:
    """Per query row: number of non-target items scoring >= the best-scoring target.

    A query hits at k iff this rank is < k.
    """
    best_target = scores.masked_fill(~target_mask, float("-inf")).amax(dim=1, keepdim=True)
    return ((scores >= best_target) & ~target_mask).sum(dim=1)


def topk_hits(logits: Tensor, labels: Tensor, ks: Sequence[int] = (1, 5)) -> dict[str, Tensor]:
    """Boolean hit vector per k (keys "top{k}"); shared by `topk_accuracy` and streaming evaluation."""
    if logits.ndim != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(
            f"expected logits [N, C], labels [N]; got {list(logits.shape)}, {list(labels.shape)}"
        )
    target_mask = torch.zeros_like(logits, dtype=torch.bool)
    target_mask[torch.arange(len(labels), device=logits.device), labels.to(logits.device)] = True
    rank = _pessimistic_rank(logits, target_mask)
    # rank <= C - 1, so any k >= C is clamped to "always a hit", as for top-C.
    return {f"top{k}": rank < k for k in ks}


def topk_accuracy(logits: Tensor, labels: Tensor, ks: Sequence[int] = (1, 5)) -> dict[str, float]:
    """Top-k accuracy of `logits` [N, C] against integer `labels` [N]; keys "top1", "top5", ..."""
    return {name: hits.float().mean().item() for name, hits in topk_hits(logits, labels, ks).items()}


def retrieval_recall(
    image_features: Tensor,
    text_features: Tensor,
    text_to_image: Tensor,
    ks: Sequence[int] = (1, 5, 10),
) -> dict[str, float]:
    """Image->text and text->image Recall@k.

    `image_features` [N_img, d] and `text_features` [N_txt, d] are expected L2-normalised;
    `text_to_image[j]` is the index of the image described by caption j. An image may have several
    captions (it hits if any of them is in its top k); every image must have at least one.
    """
    similarity = image_features.float() @ text_features.float().T  # [N_img, N_txt]
    num_images, num_texts = similarity.shape
    text_to_image = text_to_image.to(similarity.device)
    if text_to_image.shape != (num_texts,):
        raise ValueError(f"text_to_image must have shape [{num_texts}], got {tuple(text_to_image.shape)}")
    is_match = torch.zeros_like(similarity, dtype=torch.bool)
    is_match[text_to_image, torch.arange(num_texts, device=similarity.device)] = True
    if not is_match.any(dim=1).all():
        raise ValueError("every image needs at least one caption for image->text recall to be defined")

    image_rank = _pessimistic_rank(similarity, is_match)
    text_rank = _pessimistic_rank(similarity.T, is_match.T)
    metrics = {}
    for k in ks:
        metrics[f"image_to_text_R@{k}"] = (image_rank < k).float().mean().item()
    for k in ks:
        metrics[f"text_to_image_R@{k}"] = (text_rank < k).float().mean().item()
    return metrics
