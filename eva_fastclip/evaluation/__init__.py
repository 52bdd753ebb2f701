"""Zero-shot classification and image-text retrieval evaluation (single process, unwrapped model)."""

from .metrics import retrieval_recall, topk_accuracy
from .zeroshot import build_zeroshot_classifier, evaluate_classification, evaluate_retrieval

__all__ = [
    "build_zeroshot_classifier",
    "evaluate_classification",
    "evaluate_retrieval",
    "retrieval_recall",
    "topk_accuracy",
]
