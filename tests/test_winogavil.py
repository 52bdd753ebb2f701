"""WinoGAViL as DataComp evaluates it: read from a Hugging Face cache in the layout DataComp's download
leaves (the prepared Arrow file; the CSV with the unpacked images; a cache moved since), and scored against
DataComp's scoring loop written out here, on 1 rank and on 3."""

import shutil

import crosscheck_winogavil_numpy123 as crosscheck
import numpy as np
import pytest
from eval_sets import CAPTIONS, FakeModel, fake_tokenize, vector_preprocess
from hf_cache_sets import CUES, make_instances, write_winogavil_cache
from thread_ranks import on_ranks

from eva_fastclip.evaluation.winogavil import (
    cue_prompt,
    evaluate_winogavil,
    find_winogavil,
    jaccard_of_choice,
    read_winogavil,
    winogavil_metrics,
)


def datacomp_loop(similarities: list[np.ndarray], truths: list[np.ndarray]) -> tuple[list[float], dict]:
    """DataComp's loop written out (crosscheck_winogavil_numpy123.datacomp_loop). Its ``np.argsort`` is
    numpy 1.23's (pinned), which sorts these few elements by insertion, stably: ``kind="stable"`` here, as
    numpy 2's default vectorised sort is not stable (that script checks the loop under numpy 1.23.5)."""
    return crosscheck.datacomp_loop(similarities, truths, argsort_kind="stable")


def similarities_and_truths(instances: list[dict]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each instance's cue-image similarities in float64 (normalised features) and its true candidates."""
    similarities, truths = [], []
    for instance in instances:
        images = np.asarray(instance["vectors"], dtype=np.float64)
        text = np.asarray(CAPTIONS[cue_prompt(instance["cue"])], dtype=np.float64)
        images /= np.linalg.norm(images, axis=1, keepdims=True)
        similarities.append(images @ (text / np.linalg.norm(text)))
        truths.append(np.isin(instance["candidates"], instance["associations"]))
    return similarities, truths


@pytest.fixture()
def cache(tmp_path):
    CAPTIONS.clear()
    instances = make_instances()
    return write_winogavil_cache(tmp_path / "hf_cache", instances), instances


def test_scores_equal_datacomps_scoring_on_one_rank_and_on_three(cache):

    hf_cache, instances = cache
    read = read_winogavil(hf_cache)
    assert [i.cue for i in read] == CUES and [len(i.candidates) for i in read][:5] == [5, 6, 10, 12, 7]
    similarities, truths = similarities_and_truths(instances)
    scores, expected = datacomp_loop(similarities, truths)
    ours = evaluate_winogavil(FakeModel(), fake_tokenize, read, preprocess=vector_preprocess, device="cpu")
    assert ours == {**expected, "num_samples": len(CUES)}
    # the ties decide some instances: taking the first of equal candidates would score otherwise
    first_wins = [jaccard_of_choice(s - np.arange(len(s)) * 1e-9, t) for s, t in zip(similarities, truths)]
    assert first_wins != scores

    def work(collectives):
        return evaluate_winogavil(
            FakeModel(), fake_tokenize, read, preprocess=vector_preprocess, device="cpu", workers=1,
            collectives=collectives,
        )  # fmt: skip

    assert on_ranks(3, work) == [ours] * 3


def test_the_scoring_equals_datacomps_loop_on_tied_fp16_similarities():
    """Similarities as DataComp's fp16 autocast gives them (few levels: many ties), with instances of no
    true association among them: the scores and metrics equal DataComp's loop on the same numbers."""
    rng = np.random.default_rng(2)
    sizes = rng.choice([5, 6, 10, 12, 7], 600)
    similarities = [(rng.integers(0, 6, n) / 8).astype(np.float16) for n in sizes]
    truths = []
    for i, n in enumerate(sizes):
        truth = np.zeros(n, dtype=bool)
        truth[rng.choice(n, int(rng.integers(1, n)) if i % 50 else 0, replace=False)] = True
        truths.append(truth)
    theirs_scores, theirs = datacomp_loop(similarities, truths)
    ours_scores = [jaccard_of_choice(s, t) for s, t in zip(similarities, truths)]
    assert ours_scores == theirs_scores
    assert winogavil_metrics(ours_scores, sizes) == {**theirs, "num_samples": len(sizes)}


def test_a_tie_goes_to_the_later_candidate_and_no_association_chooses_all():
    # numpy 1.23's argsort keeps equal scores in order; [-k:] takes the last of them
    assert jaccard_of_choice(np.array([0.5, 0.5, 0.1]), np.array([True, False, False])) == 0.0
    assert jaccard_of_choice(np.array([0.5, 0.5, 0.1]), np.array([False, True, False])) == 1.0
    assert jaccard_of_choice(np.array([0.9, 0.5, 0.1, 0.7]), np.array([True, False, False, True])) == 1.0
    assert jaccard_of_choice(np.array([0.1, 0.5, 0.9]), np.array([True, True, False])) == 1 / 3
    # k = 0: DataComp's [-0:] takes every candidate, and sklearn's Jaccard of nothing true is 0
    assert jaccard_of_choice(np.array([0.1, 0.5]), np.array([False, False])) == 0.0


def test_the_prompt_is_datacomps():
    assert [cue_prompt(c) for c in ("Moon", "apple", "Owl", "echo", "unicorn")] == [
        "A moon", "An apple", "An owl", "An echo", "An unicorn",
    ]  # fmt: skip


def test_a_moved_cache_and_the_csv_give_the_same_instances(tmp_path):
    CAPTIONS.clear()
    instances = make_instances(1)
    # the first place's own path holds a "downloads" too: the cache's part is found all the same
    first = write_winogavil_cache(tmp_path / "downloads" / "first" / "hf_cache", instances)
    moved = tmp_path / "moved" / "hf_cache"
    moved.parent.mkdir()
    shutil.move(first, moved)  # the Arrow file's image paths name the first place, gone now
    prepared = next(moved.glob("nlphuji___winogavil/*/*/*"))
    unfinished = prepared.with_name("0" * 64 + ".incomplete")  # a preparation killed half-way
    unfinished.mkdir()
    (unfinished / "winogavil-test.arrow").write_bytes(b"half an Arrow stream")
    (unfinished / "dataset_info.json").write_text("{}")  # written before the rename that did not come
    from_arrow = read_winogavil(moved)
    assert all(str(path).startswith(str(moved)) for i in from_arrow for path in i.images)
    assert find_winogavil(moved).name == "winogavil-test.arrow"

    csv_only = write_winogavil_cache(tmp_path / "csv" / "hf_cache", instances, prepared=False)
    from_csv = read_winogavil(csv_only)
    assert find_winogavil(csv_only).suffix == ""  # the download's own name: the URL's hash
    for a, b in zip(from_arrow, from_csv, strict=True):
        assert (a.cue, a.candidates, a.truth) == (b.cue, b.candidates, b.truth)
        assert [p.read_bytes() for p in a.images] == [p.read_bytes() for p in b.images]
    assert sum(sum(i.truth) for i in from_arrow) == sum(len(i["associations"]) for i in instances)


def test_a_missing_cache_or_image_is_named(tmp_path):
    assert find_winogavil(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="nlphuji/winogavil"):
        read_winogavil(tmp_path)
    CAPTIONS.clear()
    hf_cache = write_winogavil_cache(tmp_path / "hf_cache", make_instances())
    lost = next((hf_cache / "downloads" / "extracted").rglob("moon_3.jpg"))
    lost.unlink()
    with pytest.raises(FileNotFoundError, match="moon_3.jpg"):
        read_winogavil(hf_cache)
