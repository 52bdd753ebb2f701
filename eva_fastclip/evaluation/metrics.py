"""Pure tensor metrics for zero-shot classification and image-text retrieval.

Ranks are pessimistic: a ground-truth item's rank is the number of *other* items scoring at least as
high as it, so ties never count in the model's favour (a constant-score model gets no free hits). Without
ties this is the top-k that clip_benchmark takes.

The classification metrics DataComp scores tasks by (``classification_metrics``, ``worst_group``) are
computed as DataComp's evaluation computes them: sklearn's balanced accuracy and macro F1 over the labels
present, WILDS' worst group (the lowest accuracy over the groups that have samples).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

_ROWS_PER_CHUNK = 1024  # retrieval ranks a chunk of queries at a time: [chunk, N] instead of [N, N]


def _pessimistic_rank(scores: Tensor, target_mask: Tensor) -> Tensor:
    """Per query row: number of non-target items scoring >= the best-scoring target.

    A query hits at k iff this rank is < k.
    """
    best_target = scores.masked_fill(~target_mask, float("-inf")).amax(dim=1, keepdim=True)
    return ((scores >= best_target) & ~target_mask).sum(dim=1)


def label_ranks(logits: Tensor, labels: Tensor) -> Tensor:
    """Rank of each row's label among the classes of ``logits`` [N, C] (0: the label scores highest)."""
    if logits.ndim != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(
            f"expected logits [N, C], labels [N]; got {list(logits.shape)}, {list(labels.shape)}"
        )
    target_mask = torch.zeros_like(logits, dtype=torch.bool)
    target_mask[torch.arange(len(labels), device=logits.device), labels.to(logits.device)] = True
    return _pessimistic_rank(logits, target_mask)


def topk_hits(logits: Tensor, labels: Tensor, ks: Sequence[int] = (1, 5)) -> dict[str, Tensor]:
    """Boolean hit vector per k (keys "top{k}"); k >= C is a hit for every sample, as top-C."""
    rank = label_ranks(logits, labels)
    return {f"top{k}": rank < k for k in ks}


def topk_accuracy(logits: Tensor, labels: Tensor, ks: Sequence[int] = (1, 5)) -> dict[str, float]:
    """Top-k accuracy of `logits` [N, C] against integer `labels` [N]; keys "top1", "top5", ..."""
    return {name: hits.float().mean().item() for name, hits in topk_hits(logits, labels, ks).items()}


def classification_metrics(
    labels: Tensor, ranks: Tensor, predicted: Tensor, num_classes: int
) -> dict[str, float]:
    """ "top1", "top5" (with 5 classes or more, as clip_benchmark), "mean_per_class_recall" (sklearn's
    balanced accuracy of the top-scoring class) and "num_samples", from per-sample label ranks."""
    from sklearn.metrics import balanced_accuracy_score

    n = len(labels)
    if n == 0:
        raise ValueError("no sample to score")
    metrics = {"top1": int((ranks < 1).sum()) / n}
    if num_classes >= 5:
        metrics["top5"] = int((ranks < 5).sum()) / n
    metrics["mean_per_class_recall"] = float(balanced_accuracy_score(labels.numpy(), predicted.numpy()))
    return {**metrics, "num_samples": n}


def macro_f1(labels: Tensor, predicted: Tensor) -> float:
    """F1 averaged over the classes present in ``labels`` (WILDS' F1-macro, iWildCam's main metric)."""
    from sklearn.metrics import f1_score

    present = torch.unique(labels).numpy()
    return float(f1_score(labels.numpy(), predicted.numpy(), average="macro", labels=present))


def worst_group(hits: Tensor, groups: Tensor) -> float:
    """The lowest mean of ``hits`` over the groups that have samples (WILDS' "worst-group" metric)."""
    hits, groups = hits.double(), groups.long()
    return min(float(hits[groups == g].mean()) for g in torch.unique(groups))


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
    images, texts = image_features.float(), text_features.float()
    num_images, num_texts = len(images), len(texts)
    text_to_image = text_to_image.to(images.device)
    if text_to_image.shape != (num_texts,):
        raise ValueError(f"text_to_image must have shape [{num_texts}], got {tuple(text_to_image.shape)}")
    if torch.bincount(text_to_image, minlength=num_images).min() == 0:
        raise ValueError("every image needs at least one caption for image->text recall to be defined")

    image_rank = _ranks_in_chunks(images, texts, lambda rows: text_to_image[None, :] == rows[:, None])
    text_rank = _ranks_in_chunks(
        texts, images, lambda rows: F.one_hot(text_to_image[rows], num_images).bool()
    )
    metrics = {f"image_to_text_R@{k}": int((image_rank < k).sum()) / num_images for k in ks}
    return metrics | {f"text_to_image_R@{k}": int((text_rank < k).sum()) / num_texts for k in ks}


def _ranks_in_chunks(queries: Tensor, items: Tensor, targets_of: Callable[[Tensor], Tensor]) -> Tensor:
    """Each query's pessimistic rank against ``items``; ``targets_of(rows)`` marks the matching items of
    those query rows."""
    ranks = []
    for start in range(0, len(queries), _ROWS_PER_CHUNK):
        rows = torch.arange(start, min(start + _ROWS_PER_CHUNK, len(queries)), device=queries.device)
        ranks.append(_pessimistic_rank(queries[rows] @ items.T, targets_of(rows)))
    return torch.cat(ranks) if ranks else torch.zeros(0, dtype=torch.int64)
