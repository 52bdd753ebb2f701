"""DataComp's suite on a datasets root of tiny clip_benchmark folders (both folder namings, classification,
retrieval with several captions, WILDS and fairness metadata): each task's main metric against a float64
reference written out here, the three averages FastCLIP reports, and ``eva-fastclip eval --suite``."""

import json
import math

import numpy as np
import pytest
import torch
from eval_sets import (
    CAPTIONS,
    DIM,
    FakeModel,
    fake_tokenize,
    vector_preprocess,
    write_classification_folder,
    write_retrieval_folder,
)
from thread_ranks import on_ranks

from eva_fastclip.cli import main
from eva_fastclip.config import load_config
from eva_fastclip.evaluation import TASKS, evaluate_datacomp
from eva_fastclip.evaluation.datacomp import AVERAGES, find_task_folders
from eva_fastclip.models import create_model

NUM_CLASSES = 6
CLASSNAMES = [f"class{c}" for c in range(NUM_CLASSES)]


def test_the_task_table_is_datacomps():
    assert len(TASKS) == 38 and len({task.name for task in TASKS}) == 38
    for members in AVERAGES.values():
        assert set(members) <= {task.name for task in TASKS}
    assert AVERAGES["imagenet_and_variants_average"] == (
        "ImageNet 1k", "ImageNet v2", "ImageNet Sketch", "ImageNet-A", "ImageNet-O", "ImageNet-R",
        "ObjectNet",
    )  # fmt: skip
    main_metrics = {task.key: task.main_metric for task in TASKS}
    assert main_metrics["vtab/caltech101"] == "mean_per_class_recall"
    assert main_metrics["wilds/fmow"] == "acc_worst_region"
    assert main_metrics["fairness/dollar_street"] == "acc_top5_wg"
    assert sum(metric == "acc1" for metric in main_metrics.values()) == 27


def classification_task(rng, n):
    """Rows whose first 6 components are distinct (no tie between classes), labels often right."""
    values = np.arange(-3, 3) * 0.5 + 0.25
    vectors = np.zeros((n, DIM))
    for row in vectors:
        row[:NUM_CLASSES] = rng.permutation(values)
    labels = np.where(
        rng.random(n) < 0.5, vectors[:, :NUM_CLASSES].argmax(1), rng.integers(0, NUM_CLASSES, n)
    )
    return vectors, labels


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("datasets")
    sets = {}
    for folder, n in (("wds_cifar10_test", 13), ("wds_vtab-caltech101", 11), ("wds_imagenet1k_test", 9)):
        sets[folder] = classification_task(rng, n)
        write_classification_folder(root / folder, *sets[folder], CLASSNAMES, per_shard=4)
    for folder, n in (("wds_wilds-fmow_test", 14), ("wds_dollar_street_test", 12)):
        vectors, labels = classification_task(rng, n)
        metadata = np.stack([rng.choice([0, 1, 3], n), rng.integers(0, 9, n)], axis=1)  # group 2: none
        sets[folder] = vectors, labels, metadata
        write_classification_folder(
            root / folder, vectors, labels, CLASSNAMES, metadata=metadata, per_shard=5
        )
    images = np.clip(np.round(rng.normal(size=(7, DIM)) * 20) / 20, -3, 3)  # within the pixels' range
    CAPTIONS.clear()
    captions = []
    for i in range(7):
        captions.append([f"image {i} caption {j}" for j in range(1 + i % 3)])
        for caption in captions[-1]:
            CAPTIONS[caption] = (
                images[rng.integers(0, 7) if rng.random() < 0.3 else i] + rng.normal(size=DIM)
            ).tolist()
    write_retrieval_folder(root / "wds_flickr30k", images, captions, per_shard=3)
    sets["wds_flickr30k"] = images, captions
    (root / "wds_unrelated").mkdir()
    return root, sets


def reference_classification(vectors, labels):
    """Per sample, in float64: is the label the top class, in the top 5, and the top class itself."""
    scores = vectors[:, :NUM_CLASSES]  # the fake classifier is the one-hot class directions
    top = scores.argmax(1)
    rank = np.array([(scores[i] >= scores[i, labels[i]]).sum() - 1 for i in range(len(labels))])
    return rank < 1, rank < 5, top


def balanced_accuracy(labels, top):
    return np.mean([np.mean(top[labels == c] == c) for c in np.unique(labels)])


def worst(hits, groups):
    """DataComp's worst group: per group a float32 sum of hits over a float32 count (its
    ``_avg_over_groups``), the lowest of them."""
    return float(
        min(np.float32(hits[groups == g].sum()) / np.float32((groups == g).sum()) for g in np.unique(groups))
    )


def float32_mean(hits) -> float:
    """clip_benchmark's recall: the hits' float32 mean."""
    return float(np.float32(np.sum(hits)) / np.float32(len(hits)))


def recall_at_1(images, captions):
    texts = [CAPTIONS[c] for per in captions for c in per]
    owner = [i for i, per in enumerate(captions) for _ in per]
    unit = lambda m: np.asarray(m) / np.linalg.norm(m, axis=1, keepdims=True)  # noqa: E731
    sim = unit(images) @ unit(texts).T
    image_hits = []
    for i in range(len(images)):
        own = [sim[i, j] for j in range(len(texts)) if owner[j] == i]
        others = [sim[i, j] for j in range(len(texts)) if owner[j] != i]
        image_hits.append(max(own) > max(others))
    text_hits = [sim[owner[j], j] > np.delete(sim[:, j], owner[j]).max() for j in range(len(texts))]
    return float32_mean(text_hits), float32_mean(image_hits)  # image retrieval (text->image), text retrieval


def test_every_found_task_scores_its_main_metric_as_datacomp_defines_it(root):
    root, sets = root
    found, missing = find_task_folders(root)
    assert {task.key: folder.name for task, folder in found.items()} == {
        "cifar10": "wds_cifar10_test",  # DataComp's download_evalsets.py naming
        "vtab/caltech101": "wds_vtab-caltech101",  # clip_benchmark's hub naming
        "imagenet1k": "wds_imagenet1k_test",
        "wilds/fmow": "wds_wilds-fmow_test",
        "fairness/dollar_street": "wds_dollar_street_test",
        "retrieval/flickr_1k_test_image_text_retrieval": "wds_flickr30k",
    }
    assert len(missing) == 32
    results = evaluate_datacomp(
        FakeModel(), tokenize=fake_tokenize, preprocess=vector_preprocess, datasets_root=root, batch_size=4,
        device="cpu",
    )  # fmt: skip
    rows = {row["key"]: row for row in results["tasks"]}

    top1, top5, top = reference_classification(*sets["wds_cifar10_test"])
    assert rows["cifar10"]["main_metric"] == pytest.approx(top1.mean(), abs=1e-12)
    assert rows["cifar10"]["metrics"]["acc5"] == pytest.approx(top5.mean(), abs=1e-12)
    vectors, labels = sets["wds_vtab-caltech101"]
    _, _, top = reference_classification(vectors, labels)
    assert rows["vtab/caltech101"]["main_metric"] == pytest.approx(balanced_accuracy(labels, top), abs=1e-12)
    vectors, labels, metadata = sets["wds_wilds-fmow_test"]
    top1, _, _ = reference_classification(vectors, labels)
    assert rows["wilds/fmow"]["main_metric"] == worst(top1, metadata[:, 0])
    vectors, labels, metadata = sets["wds_dollar_street_test"]
    _, top5, _ = reference_classification(vectors, labels)
    assert rows["fairness/dollar_street"]["main_metric"] == worst(top5, metadata[:, 0])
    image_recall, text_recall = recall_at_1(*sets["wds_flickr30k"])
    flickr = rows["retrieval/flickr_1k_test_image_text_retrieval"]
    assert flickr["metrics"]["image_retrieval_recall@1"] == image_recall
    assert flickr["metrics"]["text_retrieval_recall@1"] == text_recall
    assert flickr["main_metric"] == 0.5 * (image_recall + text_recall)

    scores = [row["main_metric"] for row in results["tasks"]]
    averages = results["averages"]
    # a mean over fewer tasks is no DataComp figure: no value, the mean of the evaluated ones beside it
    assert averages["datacomp_average"] == {
        "value": None,
        "mean_of_evaluated": pytest.approx(math.fsum(scores) / 6),
        "tasks": 6,
        "of": 38,
    }
    retrieval = {"value": None, "mean_of_evaluated": flickr["main_metric"], "tasks": 1, "of": 3}
    assert averages["retrieval_average"] == retrieval
    imagenet = rows["imagenet1k"]["main_metric"]
    assert averages["imagenet_and_variants_average"]["mean_of_evaluated"] == imagenet
    assert "misc/winogavil" in results["missing"]


def retrieval_task(rng, name: str, n: int = 5):
    """Images and their captions (one or two each), the captions' text vectors registered near their
    image's."""
    images = np.clip(np.round(rng.normal(size=(n, DIM)) * 20) / 20, -3, 3)
    captions = [[f"{name} {i} {j}" for j in range(1 + i % 2)] for i in range(n)]
    for i, lines in enumerate(captions):
        for caption in lines:
            CAPTIONS[caption] = (images[i] + rng.normal(size=DIM)).tolist()
    return images, captions


def test_flickr_from_the_hf_cache_equals_its_webdataset_folder(tmp_path):
    """The same images and captions read from a moved Hugging Face cache (DataComp's source) and from a
    clip_benchmark folder score the same recalls."""
    from hf_cache_sets import write_retrieval_cache

    CAPTIONS.clear()
    images, captions = retrieval_task(np.random.default_rng(3), "Flickr", n=9)
    flickr = TASKS[[task.name for task in TASKS].index("Flickr")]
    name = flickr.hf_repo.split("/")[1]
    write_retrieval_cache(tmp_path / "hf" / "hf_cache", name, images, captions, written_at=tmp_path / "gone")
    write_retrieval_folder(tmp_path / "wds" / "wds_flickr30k", images, captions, per_shard=4)
    common = dict(tokenize=fake_tokenize, preprocess=vector_preprocess, batch_size=4, device="cpu")
    from_cache = evaluate_datacomp(FakeModel(), datasets_root=tmp_path / "hf", **common)
    from_folder = evaluate_datacomp(FakeModel(), datasets_root=tmp_path / "wds", **common)
    (cache_row,), (folder_row,) = from_cache["tasks"], from_folder["tasks"]
    assert cache_row["folder"].endswith(f"{name}-test.arrow") and folder_row["folder"].endswith(
        "wds_flickr30k"
    )
    assert cache_row["metrics"] == folder_row["metrics"] and cache_row["metrics"]["num_samples"] == 9


@pytest.fixture(scope="module")
def full_root(tmp_path_factory):
    """All 38 tasks as DataComp's download leaves them: a wds_*_test folder for each of the 35 webdataset
    tasks (WILDS and fairness with their metadata), Flickr and WinoGAViL in hf_cache; MSCOCO as
    clip_benchmark's retrieval folder, the other source read."""
    from hf_cache_sets import make_instances, write_retrieval_cache, write_winogavil_cache

    rng = np.random.default_rng(1)
    root = tmp_path_factory.mktemp("datacomp_root")
    CAPTIONS.clear()
    for task in TASKS:
        if task.folders is None:
            write_winogavil_cache(root / "hf_cache", make_instances(2))
        elif task.main_metric == "mean_recall@1":  # Flickr in hf_cache as DataComp's; MSCOCO as a folder
            images, captions = retrieval_task(rng, task.name)
            if task.name == "Flickr":
                write_retrieval_cache(root / "hf_cache", task.hf_repo.split("/")[1], images, captions)
            else:
                write_retrieval_folder(root / task.folders[0], images, captions, per_shard=2)
        else:
            vectors, labels = classification_task(rng, 8)
            metadata = np.stack([rng.integers(0, 3, 8), rng.integers(0, 9, 8)], axis=1)
            write_classification_folder(
                root / task.folder_names()[0], vectors, labels, CLASSNAMES, per_shard=3, metadata=metadata
            )
    return root


def datacomp_aggregate(tasks: list[dict]) -> dict[str, float]:
    """DataComp's ``aggregate_scores.py`` (mlfoundations/datacomp at 4a8df19) on per-task results, written
    out: the rows without a main metric dropped, exactly 38 left, each group the mean of its members, the
    average the mean of all in the results' order. Plus FastCLIP's ImageNet-and-variants mean."""
    results = {row["name"]: row["main_metric"] for row in tasks if row["main_metric"] is not None}
    assert len(results) == 38, f"Results file has unexpected size, {len(results)}"
    shifts = ["ImageNet Sketch", "ImageNet v2", "ImageNet-A", "ImageNet-O", "ImageNet-R", "ObjectNet"]
    return {
        "Average": np.mean(list(results.values())),
        "Retrieval": np.mean([results[name] for name in ("Flickr", "MSCOCO", "WinoGAViL")]),
        "ImageNet and variants": np.mean([results["ImageNet 1k"]] + [results[name] for name in shifts]),
    }


def test_eval_suite_from_the_command_line_on_all_38_tasks(full_root, tmp_path, capsys):
    """Every average has a value, equal to DataComp's aggregate of the same per-task results."""
    cfg = load_config("configs/toy.json", ["model.name=test-vit-xs"])
    torch.manual_seed(0)
    checkpoint = tmp_path / "model.pt"
    torch.save(create_model(cfg.model).model.state_dict(), checkpoint)
    common = ["eval", "--config", "configs/toy.json", "--set", "model.name=test-vit-xs"]
    common += ["--set", "eval.workers=0", "--checkpoint", str(checkpoint)]
    assert main([*common, "--suite", "datacomp"]) == 2
    assert "--datasets-root" in capsys.readouterr().err
    assert main([*common, "--precision", "datacomp"]) == 2
    assert "--precision applies to --suite" in capsys.readouterr().err
    assert main([*common, "--suite", "datacomp", "--datasets-root", str(full_root)]) == 0
    printed = capsys.readouterr().out
    written = json.loads((tmp_path / "model.pt.datacomp.json").read_text())
    assert written["checkpoint"] == str(checkpoint) and written["missing"] == []
    assert [row["name"] for row in written["tasks"]] == [task.name for task in TASKS]
    rows = {row["name"]: row for row in written["tasks"]}
    assert rows["Flickr"]["folder"].endswith(".arrow") and rows["MSCOCO"]["folder"].endswith(
        "wds_mscoco_captions"
    )
    wino = rows["WinoGAViL"]
    assert wino["main_metric_name"] == "jaccard_score_10-12" and wino["metrics"]["num_samples"] == 12
    theirs = datacomp_aggregate(written["tasks"])
    averages = written["averages"]
    assert averages["datacomp_average"]["value"] == theirs["Average"]
    assert averages["retrieval_average"]["value"] == pytest.approx(theirs["Retrieval"], rel=1e-15)
    imagenet = averages["imagenet_and_variants_average"]["value"]
    assert imagenet == pytest.approx(theirs["ImageNet and variants"], rel=1e-15)
    for average in averages.values():
        assert average["tasks"] == average["of"] and f"{average['value']:.4f}" in printed
    assert "partial" not in printed and "missing" not in printed


def test_ranks_that_see_different_task_folders_all_stop(root, tmp_path):

    root, _ = root
    (tmp_path / "wds_cifar10_test").symlink_to(root / "wds_cifar10_test")

    def work(collectives):
        return evaluate_datacomp(
            FakeModel(), tokenize=fake_tokenize, preprocess=vector_preprocess, batch_size=4, device="cpu",
            datasets_root=root if collectives.rank == 0 else tmp_path, collectives=collectives,
        )  # fmt: skip

    for result in on_ranks(2, work):
        assert isinstance(result, ValueError) and "the ranks see different task folders" in str(result)

    # the same task from two sources: Flickr from hf_cache on rank 0, from its webdataset folder on rank 1
    from hf_cache_sets import write_retrieval_cache

    images, captions = retrieval_task(np.random.default_rng(5), "Flickr")
    roots = [tmp_path / "cache_root", tmp_path / "folder_root"]
    write_retrieval_cache(roots[0] / "hf_cache", "flickr_1k_test_image_text_retrieval", images, captions)
    write_retrieval_folder(roots[1] / "wds_flickr30k", images, captions)

    def mixed(collectives):
        return evaluate_datacomp(
            FakeModel(), tokenize=fake_tokenize, preprocess=vector_preprocess, batch_size=4, device="cpu",
            datasets_root=roots[collectives.rank], collectives=collectives,
        )  # fmt: skip

    for result in on_ranks(2, mixed):
        assert isinstance(result, ValueError) and "read a task from different sources" in str(result)


def test_blank_lines_are_no_class_and_no_prompt(tmp_path):
    """clip_benchmark 1.6 keeps blank lines of classnames.txt and the templates: trailing blank class lines
    and blank prompts are dropped, a blank class line before the last is refused (labels number the lines)."""
    from eva_fastclip.evaluation.sets import read_wds_folder

    names = ["cat", "dog", "bird", "", " "]
    folder = write_classification_folder(
        tmp_path / "wds_cars", np.eye(3, DIM), [0, 1, 2], names, templates=["a {c}.", "", "an {c}!"]
    )
    evalset = read_wds_folder(folder)
    assert evalset.classnames == ["cat", "dog", "bird"] and evalset.templates == ["a {c}.", "an {c}!"]
    labels = [evalset.target(sample.read(), sample)[0] for sample in evalset.samples]
    assert [evalset.classnames[label] for label in labels] == ["cat", "dog", "bird"]
    folder = write_classification_folder(
        tmp_path / "wds_pets", np.eye(3, DIM), [0, 1, 2], ["cat", "", "dog", "bird"]
    )
    with pytest.raises(ValueError, match="classnames.txt: line 2 is blank, before the last class"):
        read_wds_folder(folder)


def test_an_average_has_a_value_only_with_all_its_tasks():
    from eva_fastclip.evaluation.datacomp import averages

    members = AVERAGES["retrieval_average"]
    rows = [{"name": name, "main_metric": 0.25 * (i + 1)} for i, name in enumerate(members)]
    complete = averages(rows)["retrieval_average"]
    assert complete == {"value": 0.5, "mean_of_evaluated": 0.5, "tasks": 3, "of": 3}
    partial = averages(rows[:2])["retrieval_average"]
    assert partial == {"value": None, "mean_of_evaluated": 0.375, "tasks": 2, "of": 3}
    assert averages([])["retrieval_average"]["mean_of_evaluated"] is None


def test_a_folder_without_nshards_is_refused_before_any_task_runs(tmp_path):
    """clip_benchmark (so DataComp) reads a folder's shards from test/nshards.txt: without it the suite
    stops at once, naming the file, rather than after the tasks before it."""
    rng = np.random.default_rng(0)
    for folder in ("wds_cifar10_test", "wds_imagenet1k_test"):
        write_classification_folder(tmp_path / folder, *classification_task(rng, 4), CLASSNAMES)
    (tmp_path / "wds_imagenet1k_test" / "test" / "nshards.txt").unlink()
    model = FakeModel()
    with pytest.raises(FileNotFoundError, match=r"wds_imagenet1k_test/test/nshards.txt: missing"):
        evaluate_datacomp(
            model, tokenize=fake_tokenize, preprocess=vector_preprocess, datasets_root=tmp_path,
            batch_size=4, device="cpu",
        )  # fmt: skip
    assert model.seen_training == []  # nothing was encoded


class AutocastRecordingModel(FakeModel):
    """Records, per call, which tower ran and whether autocast was on."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, bool]] = []

    def encode_image(self, images):
        self.calls.append(("image", torch.is_autocast_enabled("cpu")))
        return super().encode_image(images)

    def encode_text(self, tokens):
        self.calls.append(("text", torch.is_autocast_enabled("cpu")))
        return super().encode_text(tokens)


def test_datacomp_precision_autocasts_the_stages_datacomp_autocasts(tmp_path, monkeypatch):
    """fp16 on a GPU only; where it applies: the classifier's prompts (not the images), both retrieval
    towers and both WinoGAViL towers. Checked on a CPU with bf16 standing for the GPU's fp16."""
    from hf_cache_sets import make_instances, write_winogavil_cache

    from eva_fastclip.evaluation import datacomp

    assert datacomp.datacomp_autocast("datacomp", "cuda") == torch.float16
    assert datacomp.datacomp_autocast("datacomp", "cpu") is None
    assert datacomp.datacomp_autocast("fp32", "cuda:1") is None
    with pytest.raises(ValueError, match="precision must be one of fp32, datacomp"):
        evaluate_datacomp(FakeModel(), tokenize=fake_tokenize, preprocess=vector_preprocess,
                          datasets_root=tmp_path, batch_size=4, device="cpu", precision="fp16")  # fmt: skip

    rng = np.random.default_rng(4)
    CAPTIONS.clear()
    write_classification_folder(tmp_path / "wds_cifar10_test", *classification_task(rng, 4), CLASSNAMES)
    write_retrieval_folder(tmp_path / "wds_flickr30k", *retrieval_task(rng, "Flickr", 3))
    write_winogavil_cache(tmp_path / "hf_cache", make_instances()[:2])
    monkeypatch.setattr(datacomp, "datacomp_autocast", lambda precision, device: torch.bfloat16)
    model = AutocastRecordingModel()
    results = evaluate_datacomp(
        model, tokenize=fake_tokenize, preprocess=vector_preprocess, datasets_root=tmp_path, batch_size=4,
        device="cpu", precision="datacomp",
    )  # fmt: skip
    assert [row["name"] for row in results["tasks"]] == ["CIFAR-10", "Flickr", "WinoGAViL"]
    assert results["precision"] == "datacomp"
    classifier_and_images = 6 + 1  # 6 classes' prompts, then one batch of 4 images
    flickr = 1 + 1  # one batch: its images, then its captions
    cifar, rest = model.calls[:classifier_and_images], model.calls[classifier_and_images:]
    assert cifar == [("text", True)] * 6 + [("image", False)]
    assert rest[:flickr] == [("image", True), ("text", True)]
    assert rest[flickr:] == [("image", True), ("text", True)] * 2  # WinoGAViL, per instance
