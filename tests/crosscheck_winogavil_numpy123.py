"""WinoGAViL's choice under DataComp's own pins, checked by hand (not collected by pytest: it needs a
second interpreter). DataComp scores an instance with ``np.argsort(similarities)[-k:]`` under numpy
1.23.5 and scikit-learn 1.1.3 (its requirements.txt); numpy 2's default argsort is not stable, so
eva_fastclip sorts with ``kind="stable"``, which is what numpy 1.23 does for these few elements. This
runs DataComp's loop (eval_utils/wino_eval.py at 4a8df19, written out in ``datacomp_loop``, here with
numpy's *default* sort) in an interpreter with those pins, on tie-heavy fp16 similarities, and compares every
score and metric with ``eva_fastclip.evaluation.winogavil``'s::

    python3 -m venv /tmp/np123 && /tmp/np123/bin/pip install numpy==1.23.5 scikit-learn==1.1.3
    .venv/bin/python tests/crosscheck_winogavil_numpy123.py --pinned-python /tmp/np123/bin/python

Run on 2026-11-27: 4,000 instances (sizes 5, 6, 7, 10, 12; 1 in 50 without a true association), every
score and metric equal (docs/evaluation.md).
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def datacomp_loop(similarities, truths, argsort_kind: str | None = None) -> tuple[list[float], dict]:
    """DataComp's ``evaluate_winogavil_dataset`` loop (mlfoundations/datacomp eval_utils/wino_eval.py at
    4a8df19) written out, from each instance's similarities on: ``np.argsort`` of ``argsort_kind`` (None:
    numpy's default, as DataComp calls it), sklearn's Jaccard (0 where both sets are empty, as its default
    "warn" gives), the group means. numpy and sklearn only: the pinned interpreter runs it too."""
    import numpy as np
    from sklearn.metrics import jaccard_score

    all_groups, all_scores = [], []
    for image_logits, y_true in zip(similarities, truths):
        n_images, n_assoc = len(image_logits), y_true.sum()
        topk_indices = np.argsort(image_logits, kind=argsort_kind)[-n_assoc:]
        y_pred = np.isin(np.arange(n_images), topk_indices)
        all_scores.append(jaccard_score(y_true, y_pred, zero_division=0.0))
        all_groups.append(n_images)
    all_groups, all_scores = np.array(all_groups), np.array(all_scores)
    return all_scores.tolist(), {
        "avg_jaccard_score": all_scores.mean(),
        "jaccard_score_5": all_scores[all_groups == 5].mean(),
        "jaccard_score_6": all_scores[all_groups == 6].mean(),
        "jaccard_score_10": all_scores[all_groups == 10].mean(),
        "jaccard_score_12": all_scores[all_groups == 12].mean(),
        "jaccard_score_5-6": all_scores[all_groups <= 6].mean(),
        "jaccard_score_10-12": all_scores[all_groups >= 10].mean(),
    }


def pinned_side(instances_file: str, out_file: str) -> None:
    """DataComp's loop, run by the pinned interpreter with numpy's default argsort."""
    import numpy as np

    instances = json.loads(Path(instances_file).read_text())
    similarities = [np.array(instance["similarities"], dtype=np.float16) for instance in instances]
    truths = [np.array(instance["truth"], dtype=bool) for instance in instances]
    scores, metrics = datacomp_loop(similarities, truths)
    out = {"numpy": np.__version__, "scores": scores, "metrics": metrics}
    Path(out_file).write_text(json.dumps(out))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--pinned-python", required=True, help="an interpreter with numpy 1.23.5, sklearn 1.1.3"
    )
    parser.add_argument("--instances", type=int, default=4000)
    args = parser.parse_args()

    import numpy as np

    from eva_fastclip.evaluation.winogavil import jaccard_of_choice, winogavil_metrics

    rng = np.random.default_rng(1)
    instances = []
    for i in range(args.instances):
        n = int(rng.choice([5, 6, 10, 12, 7]))
        similarities = (rng.integers(0, 6, n) / 8).astype(np.float16)  # few levels: many ties
        truth = np.zeros(n, dtype=bool)
        truth[rng.choice(n, int(rng.integers(1, n)) if i % 50 else 0, replace=False)] = True
        instances.append({"similarities": similarities.astype(float).tolist(), "truth": truth.tolist()})
    with tempfile.TemporaryDirectory() as tmp:
        given, theirs_file = Path(tmp) / "instances.json", Path(tmp) / "theirs.json"
        given.write_text(json.dumps(instances))
        code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        code += (
            f"import crosscheck_winogavil_numpy123 as c; c.pinned_side({str(given)!r}, {str(theirs_file)!r})"
        )
        subprocess.run([args.pinned_python, "-W", "ignore", "-c", code], check=True)
        theirs = json.loads(theirs_file.read_text())
    ours = [
        jaccard_of_choice(np.array(x["similarities"], dtype=np.float16), np.array(x["truth"]))
        for x in instances
    ]
    metrics = winogavil_metrics(ours, [len(x["truth"]) for x in instances])
    same_scores = ours == theirs["scores"]
    same_metrics = all(metrics[name] == value for name, value in theirs["metrics"].items())
    print(f"numpy {theirs['numpy']} (DataComp's loop) against ours, {len(instances)} instances:")
    print(f"  every score equal: {same_scores}; every metric equal: {same_metrics}")
    return 0 if same_scores and same_metrics else 1


if __name__ == "__main__":
    sys.exit(main())
