"""Evaluation: the metrics worked out by hand, the sets as clip_benchmark lays them out (and ImageNet's
validation folder), and the sharing between ranks: K ranks (threads with a fake collective here; a real
launch in launched/test_end_to_end.py) give exactly one rank's result, an empty share takes part, and an
error on one rank stops every rank instead of leaving the others waiting."""

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from eval_sets import (
    DIM,
    TEMPLATES,
    FakeModel,
    fake_tokenize,
    vector_png,
    vector_preprocess,
    write_classification_folder,
)
from PIL import Image
from thread_ranks import on_ranks

from eva_fastclip.data import write_toy_dataset
from eva_fastclip.evaluation import (
    EvaluationFailed,
    build_zeroshot_classifier,
    classify,
    fill_template,
    read_imagenet_folder,
    read_wds_folder,
    retrieval_recall,
    retrieve,
    topk_accuracy,
)
from eva_fastclip.evaluation.metrics import classification_metrics, macro_f1, worst_group
from eva_fastclip.evaluation.samples import own_batches
from eva_fastclip.evaluation.sets import RetrievalSet, read_pair_shards

# ---------------------------------------------------------------- metrics


def test_topk_accuracy_hand_computed():
    logits = torch.tensor(
        [
            [5.0, 1.0, 0.0, 0.0, 0.0, 0.0],  # label 0 is the max: top1 hit
            [1.0, 4.0, 3.0, 2.0, 0.0, -1.0],  # label 2 is second: top1 miss, top2/top5 hit
            [0.0, 1.0, 2.0, 3.0, 4.0, 5.0],  # label 0 is last of 6: top5 miss
            [3.0, 2.0, 0.0, 0.5, 0.25, 0.1],  # label 1 is second
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
        [0.5, 0.1, 0.7, 0.3, 0.75],  # img1, caption t2
        [0.1, 0.6, 0.3, 0.4, 0.2],  # img2, captions t3, t4
    ]
)
TEXT_TO_IMAGE = torch.tensor([0, 0, 1, 2, 2])


def test_retrieval_recall_hand_computed():
    metrics = retrieval_recall(torch.eye(3), SIMILARITY.T, TEXT_TO_IMAGE, ks=(1, 2, 3))
    # Image->text: the position of the best right caption in the row, best first:
    #   img0: best right t0=0.9, first                  -> hit at 1
    #   img1: right t2=0.7, wrong t4=0.75 before it     -> hit at 2
    #   img2: best right t3=0.4, wrong t1=0.6 before it -> hit at 2
    assert metrics["image_to_text_R@1"] == pytest.approx(1 / 3)
    assert metrics["image_to_text_R@2"] == 1.0
    assert metrics["image_to_text_R@3"] == 1.0
    # Text->image, per column:
    #   t0 -> img0 .9, others {.5, .1}   -> 1st
    #   t1 -> img0 .2, img2 .6 before it -> 2nd
    #   t2 -> img1 .7, img0 .8 before it -> 2nd
    #   t3 -> img2 .4, others {.1, .3}   -> 1st
    #   t4 -> img2 .2, img0 .3, img1 .75 -> 3rd
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


def test_retrieval_recall_rejects_image_without_caption():
    with pytest.raises(ValueError):
        retrieval_recall(torch.eye(3), torch.eye(3)[:2], torch.tensor([0, 1]))


def test_retrieval_recall_in_batches_equals_whole():
    torch.manual_seed(0)
    images, texts = F.normalize(torch.randn(7, 5), dim=-1), F.normalize(torch.randn(12, 5), dim=-1)
    owners = torch.tensor([0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 2, 6])
    whole = retrieval_recall(images, texts, owners, ks=(1, 2, 3))
    assert retrieval_recall(images, texts, owners, ks=(1, 2, 3), batch_size=2) == whole


def test_classification_metrics_hand_computed():
    labels = torch.tensor([0, 0, 0, 1, 2, 2])
    top = torch.tensor(
        [
            [0, 1, 2, 3, 4],  # top-1 hit
            [1, 0, 2, 3, 4],  # top-5 hit
            [1, 2, 3, 4, 5],  # top-5 miss
            [1, 0, 2, 3, 4],  # top-1 hit
            [2, 0, 1, 3, 4],  # top-1 hit
            [0, 1, 3, 4, 2],  # top-5 hit
        ]
    )
    predicted = torch.tensor([0, 1, 2, 1, 2, 0])
    # per-class recall of the arg-max class: class 0 1/3, class 1 1/1, class 2 1/2 -> mean 11/18
    assert classification_metrics(labels, top, predicted, num_classes=7) == pytest.approx(
        {"top1": 3 / 6, "top5": 5 / 6, "mean_per_class_recall": 11 / 18, "num_samples": 6}
    )
    # clip_benchmark reports no top-5 under 5 classes (and takes topk(1))
    assert "top5" not in classification_metrics(labels, top[:, :1], predicted, num_classes=3)


def test_macro_f1_and_worst_group_hand_computed():
    labels = torch.tensor([0, 0, 1, 1, 2])
    predicted = torch.tensor([0, 1, 1, 1, 3])  # class 3 is predicted but absent: not averaged over
    # F1: class 0: p 1, r 1/2 -> 2/3; class 1: p 2/3, r 1 -> 4/5; class 2: p 0 (never predicted) -> 0
    assert macro_f1(labels, predicted) == pytest.approx((2 / 3 + 4 / 5 + 0) / 3)
    hits = torch.tensor([1, 0, 1, 1, 0, 1])
    groups = torch.tensor([0, 0, 2, 2, 5, 5])  # groups 1, 3 and 4 have no sample and do not count
    assert worst_group(hits, groups) == 0.5


# ---------------------------------------------------------------- sets on disk


def test_toy_zeroshot_folder_is_clip_benchmarks_full_layout(tmp_path):
    """clip_benchmark's builder reads test/nshards.txt and refuses the folder without it."""
    from clip_benchmark.datasets.builder import build_wds_dataset

    write_toy_dataset(tmp_path, num_train=4, num_val=4, num_zeroshot=30, image_size=16, samples_per_shard=4)
    folder = tmp_path / "zeroshot"
    dataset = build_wds_dataset("toy", transform=None, split="test", data_dir=str(folder))
    assert len(dataset.classes) == 20 and dataset.templates[0] == "a photo of a {c}."
    labels = [label for _, label in dataset]
    assert labels == [i % 20 for i in range(30)]
    ours = read_wds_folder(folder)
    assert [ours.target(sample.read(), sample)[0] for sample in ours.samples] == labels


def test_own_batches_tile_the_set():
    for n, batch, world in [(0, 4, 2), (3, 4, 2), (10, 3, 1), (10, 3, 2), (10, 3, 5), (11, 2, 3)]:
        shares = [own_batches(n, batch, rank, world) for rank in range(world)]
        batches = sorted(b for share in shares for b in share)
        assert batches == [list(range(s, min(s + batch, n))) for s in range(0, n, batch)]


def wnid(i: int) -> str:
    from timm.data import ImageNetInfo

    return ImageNetInfo("imagenet-1k").label_names()[i]


def test_imagenet_folder_uses_open_clips_names_and_openais_prompts(tmp_path):
    from open_clip.zero_shot_metadata import OPENAI_IMAGENET_TEMPLATES

    for folder, count in (("n15075141", 1), ("n01443537", 3), ("n01440764", 2)):
        (tmp_path / folder).mkdir()
        for i in range(count):
            Image.new("RGB", (4, 4), (i, 0, 0)).save(tmp_path / folder / f"ILSVRC2012_val_{i}.JPEG")
    evalset = read_imagenet_folder(tmp_path)
    # the standard class order is the sorted wnids: tench (0), goldfish (1), toilet paper (999)
    assert (wnid(0), wnid(1), wnid(999)) == ("n01440764", "n01443537", "n15075141")
    assert evalset.classnames == ["tench", "goldfish", "toilet paper"]
    assert [sample.label for sample in evalset.samples] == [0, 0, 1, 1, 1, 2]
    assert len(evalset.templates) == 80 == len(OPENAI_IMAGENET_TEMPLATES)
    assert fill_template(evalset.templates[0], "tench") == OPENAI_IMAGENET_TEMPLATES[0]("tench")
    assert "3 of the 1000 ImageNet classes" in evalset.note


def test_imagenet_folder_refuses_what_is_no_wnid_folder(tmp_path):
    (tmp_path / "cats").mkdir()
    with pytest.raises(ValueError, match="no ImageNet-1k wnid, e.g. 'cats'"):
        read_imagenet_folder(tmp_path / "")
    Image.new("RGB", (4, 4)).save(tmp_path / "flat.JPEG")
    (tmp_path / "cats").rmdir()
    with pytest.raises(ValueError, match="no class folder"):
        read_imagenet_folder(tmp_path)


# ---------------------------------------------------------------- zero-shot on a fake model

NUM_CLASSES = 6
CLASSNAMES = [f"class{c}" for c in range(NUM_CLASSES)]


def known_set(tmp_path, labels=None):
    """Sample i looks like class a = i % 6, a bit like a + 1 and unlike a + 2 (strictly lowest).
    Samples 6 and 7 are mislabelled: 6 as its second class (top-1 miss, top-5 hit), 7 as its last."""
    true, near, far = ((torch.arange(8) + offset) % NUM_CLASSES for offset in (0, 1, 2))
    vectors = F.one_hot(true, DIM) + 0.5 * F.one_hot(near, DIM) - 0.5 * F.one_hot(far, DIM)
    if labels is None:
        labels = true.clone()
        labels[6], labels[7] = near[6], far[7]
    return write_classification_folder(
        tmp_path / "set", vectors.tolist(), labels.tolist(), CLASSNAMES, per_shard=3
    )


def test_classifier_averages_over_templates():
    model = FakeModel()
    classifier = build_zeroshot_classifier(model, fake_tokenize, CLASSNAMES, TEMPLATES, device="cpu")
    assert classifier.shape == (DIM, NUM_CLASSES) and classifier.dtype == torch.float32
    torch.testing.assert_close(classifier, torch.eye(DIM)[:, :NUM_CLASSES])  # the offsets cancel
    single = build_zeroshot_classifier(model, fake_tokenize, CLASSNAMES, TEMPLATES[:1], device="cpu")
    torch.testing.assert_close(single[-1], torch.full((NUM_CLASSES,), 2**-0.5))


@pytest.mark.parametrize("initially_training", [True, False])
def test_classify_known_set(tmp_path, initially_training):
    model = FakeModel().train(initially_training)
    evalset = read_wds_folder(known_set(tmp_path))
    classifier = torch.eye(DIM)[:, :NUM_CLASSES]
    predictions = classify(
        model, classifier, evalset, preprocess=vector_preprocess, batch_size=3, device="cpu"
    )
    metrics = classification_metrics(
        predictions.labels, predictions.top_classes, predictions.predicted, predictions.num_classes
    )
    assert metrics["top1"] == 6 / 8 and metrics["top5"] == 7 / 8 and metrics["num_samples"] == 8
    assert predictions.ordinals.tolist() == list(range(8)) and predictions.num_skipped == 0
    assert model.seen_training and not any(model.seen_training)
    assert model.training is initially_training and model.tower.training is initially_training


def test_a_sample_that_does_not_decode_is_skipped_and_counted(tmp_path):
    from eva_fastclip.data import write_shard

    folder = known_set(tmp_path)
    write_shard(folder / "test" / "1.tar", [{"__key__": "bad", "png": b"\x89PNG garbage", "cls": "0"}])
    predictions = classify(
        FakeModel(), torch.eye(DIM)[:, :NUM_CLASSES], read_wds_folder(folder),
        preprocess=vector_preprocess, batch_size=3, device="cpu",
    )  # fmt: skip
    # shard 1 (samples 3-5) now holds the bad sample alone: samples 6 and 7 became 4 and 5
    assert predictions.num_skipped == 1 and predictions.ordinals.tolist() == [0, 1, 2, 4, 5]


def test_retrieval_with_several_captions_per_image(tmp_path):
    from eval_sets import CAPTIONS, write_retrieval_folder

    # image i is e_i; each caption is registered with its text vector
    CAPTIONS.clear()
    CAPTIONS.update({"0-a": [1, 0, 0, 0], "1-a": [0, 1, 0, 0], "2-a": [0, 0, 1, 0], "2-b": [0, 0.5, 1, 0]})
    CAPTIONS.update({"3-a": [0.5, 0, 0, 0.4], "3-b": [2, 0, 0, 1]})
    captions = [["0-a"], ["1-a"], ["2-a", "2-b"], ["3-a", "3-b"]]
    folder = write_retrieval_folder(tmp_path / "ret", torch.eye(4, DIM).tolist(), captions, per_shard=3)
    evalset = read_wds_folder(folder)
    assert isinstance(evalset, RetrievalSet)
    got = retrieve(
        FakeModel(),
        fake_tokenize,
        evalset,
        preprocess=vector_preprocess,
        batch_size=3,
        device="cpu",
        ks=(1, 2),
    )
    # cosines: "2-b" image 2 .894, image 1 .447; "3-a" image 0 .781, image 3 .625; "3-b" image 0 .894,
    # image 3 .447. Text->image: "3-a" and "3-b" find image 0 first, image 3 second. Image->text: every
    # image's best caption is its own (image 3: "3-a" .625 against 0 for every other caption).
    assert got == {
        "image_to_text_R@1": 1.0,
        "image_to_text_R@2": 1.0,
        "text_to_image_R@1": float(np.float32(4) / np.float32(6)),  # clip_benchmark's float32 mean
        "text_to_image_R@2": 1.0,
        "num_samples": 4,
        "num_texts": 6,
        "num_skipped": 0,
    }


def test_pair_shards_take_the_first_caption_line(tmp_path):
    from eva_fastclip.data import write_shard

    write_shard(tmp_path / "shard-000000.tar", [{"__key__": "a", "png": vector_png([1]), "txt": "one\ntwo"}])
    evalset = read_pair_shards([str(tmp_path / "shard-000000.tar")])
    assert evalset.target(evalset.samples[0].read(), evalset.samples[0]) == ["one"]


# ---------------------------------------------------------------- ties, as clip_benchmark breaks them


def _clip_benchmark_accuracy(output, target, topk=(1,)):
    """clip_benchmark's top-k accuracy with its float() of a 1-element array (an error under numpy 2)
    taken on the sum itself: patched in at call time."""
    pred = output.topk(max(topk), 1, True, True)[1].t()
    correct = pred.eq(target.view(1, -1).expand_as(pred))
    return [float(correct[:k].reshape(-1).float().sum()) / len(target) for k in topk]


def test_zero_shot_ties_are_broken_as_clip_benchmarks_evaluator_breaks_them(tmp_path, monkeypatch):
    """Duplicated images whose classes tie exactly (two, three or all six classes level): top-1, top-5
    and mean per-class recall equal clip_benchmark's own evaluator's, run on the same folder."""
    from clip_benchmark.datasets.builder import build_dataset
    from clip_benchmark.metrics import zeroshot_classification as zsc

    level = [[1, 1, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0, 1], [1, 1, 1, 1, 1, 1, 0]]
    vectors = [level[i % 4] for i in range(24)]  # every vector six times
    labels = [i % NUM_CLASSES for i in range(24)]
    folder = write_classification_folder(tmp_path / "ties", vectors, labels, CLASSNAMES, per_shard=7)

    dataset = build_dataset("wds/ties", root=str(folder), transform=vector_preprocess, download=False)
    loader = torch.utils.data.DataLoader(dataset.batched(5), batch_size=None)
    monkeypatch.setattr(zsc, "accuracy", _clip_benchmark_accuracy)
    theirs = zsc.evaluate(
        FakeModel(), loader, fake_tokenize, dataset.classes, dataset.templates, "cpu", amp=False
    )

    evalset = read_wds_folder(folder)
    classifier = build_zeroshot_classifier(FakeModel(), fake_tokenize, CLASSNAMES, TEMPLATES, device="cpu")
    predictions = classify(
        FakeModel(), classifier, evalset, preprocess=vector_preprocess, batch_size=3, device="cpu"
    )
    ours = classification_metrics(
        predictions.labels, predictions.top_classes, predictions.predicted, predictions.num_classes
    )
    assert (ours["top1"], ours["top5"], ours["mean_per_class_recall"]) == (
        theirs["acc1"], theirs["acc5"], theirs["mean_per_class_recall"],
    )  # fmt: skip
    # the ties decide: no label scores above every other class (counting ties ahead: 0), yet topk hits some
    assert theirs["acc1"] > 0


def test_retrieval_ties_are_broken_as_clip_benchmarks_evaluator_breaks_them(tmp_path):
    """Duplicated images and captions shared between images: every recall equals clip_benchmark's own
    retrieval evaluator's, run on the same images and captions in the same batches."""
    from clip_benchmark.datasets.builder import image_captions_collate_fn
    from clip_benchmark.metrics import zeroshot_retrieval as zsr
    from eval_sets import CAPTIONS, write_retrieval_folder

    CAPTIONS.clear()
    CAPTIONS.update({"red": [1, 0, 0], "green": [0, 1, 0], "blue": [0, 0, 1], "grey": [1, 1, 1]})
    vectors = [[1, 0, 0], [1, 0, 0], [0, 1, 0], [0, 1, 0], [0, 0, 1], [1, 1, 1], [1, 1, 1], [1, 0, 0]]
    captions = [["red"], ["red", "grey"], ["green"], ["green"], ["blue", "blue"], ["grey"], ["grey"], ["red"]]
    vectors = [v + [0] * (DIM - 3) for v in vectors]
    folder = write_retrieval_folder(tmp_path / "ret", vectors, captions, per_shard=3)

    pairs = [(vector_preprocess(_decoded(vector)), lines) for vector, lines in zip(vectors, captions)]
    loader = torch.utils.data.DataLoader(pairs, batch_size=4, collate_fn=image_captions_collate_fn)
    theirs = zsr.evaluate(FakeModel(), loader, fake_tokenize, "cpu", amp=False, recall_k_list=[1, 2, 5])

    ours = retrieve(
        FakeModel(), fake_tokenize, read_wds_folder(folder), preprocess=vector_preprocess, batch_size=4,
        device="cpu", ks=(1, 2, 5),
    )  # fmt: skip
    for k in (1, 2, 5):
        assert ours[f"text_to_image_R@{k}"] == theirs[f"image_retrieval_recall@{k}"], k
        assert ours[f"image_to_text_R@{k}"] == theirs[f"text_retrieval_recall@{k}"], k
    # the ties decide: counting every tied item ahead, only image 4 (blue) and its two captions would hit
    assert theirs["text_retrieval_recall@1"] > 1 / 8 and theirs["image_retrieval_recall@1"] > 2 / 10


def _decoded(vector) -> Image.Image:
    """The image of ``vector`` as clip_benchmark's loaders decode it (RGB)."""
    return Image.open(io.BytesIO(vector_png(vector))).convert("RGB")


# ---------------------------------------------------------------- ranks sharing the work


def test_k_ranks_give_one_ranks_predictions_exactly(tmp_path):
    torch.manual_seed(0)
    vectors = (torch.randint(-40, 41, (11, DIM)) / 20).tolist()  # exact in the pixels
    labels = torch.randint(0, NUM_CLASSES, (11,)).tolist()
    evalset = read_wds_folder(write_classification_folder(tmp_path / "set", vectors, labels, CLASSNAMES))
    model = FakeModel()

    def work(collectives):
        classifier = build_zeroshot_classifier(
            model, fake_tokenize, CLASSNAMES, TEMPLATES, device="cpu", collectives=collectives
        )
        return classifier, classify(
            model, classifier, evalset, preprocess=vector_preprocess, batch_size=2, device="cpu",
            collectives=collectives, workers=1,
        )  # fmt: skip

    (reference,) = on_ranks(1, work)
    for world in (2, 3, 7):  # 6 batches: with 7 ranks one rank has no share
        for classifier, predictions in on_ranks(world, work):
            assert torch.equal(classifier, reference[0])
            for field in ("ordinals", "labels", "top_classes", "predicted"):
                assert torch.equal(getattr(predictions, field), getattr(reference[1], field)), field


def test_an_error_on_one_rank_stops_every_rank(tmp_path):
    labels = torch.arange(8) % NUM_CLASSES
    labels[7] = 99  # in rank 1's second batch (batches of 2: rank 1 has samples 2, 3, 6, 7)
    evalset = read_wds_folder(known_set(tmp_path, labels=labels))

    def work(collectives):
        return classify(
            FakeModel(), torch.eye(DIM)[:, :NUM_CLASSES], evalset, preprocess=vector_preprocess,
            batch_size=2, device="cpu", collectives=collectives,
        )  # fmt: skip

    rank0, rank1 = on_ranks(2, work)
    assert isinstance(rank1, ValueError) and "class label 99 outside [0, 6)" in str(rank1)
    assert isinstance(rank0, EvaluationFailed) and "rank(s) [1]" in str(rank0)


def test_open_clip_model_in_bf16_autocast():
    """A real (tiny) open_clip model through the classifier and the autocast path."""
    import open_clip

    torch.manual_seed(0)
    model = open_clip.CLIP(
        embed_dim=32,
        vision_cfg=dict(image_size=32, layers=1, width=32, patch_size=8, head_width=16),
        text_cfg=dict(context_length=16, vocab_size=49408, width=32, heads=2, layers=1),
    )
    tok = open_clip.get_tokenizer("ViT-B-32")
    for dtype in (None, torch.bfloat16):
        classifier = build_zeroshot_classifier(
            model, lambda t: tok(t, context_length=16), ["cat", "dog", "car"], ["a photo of a {c}.", "a {}."],
            device="cpu", autocast_dtype=dtype,
        )  # fmt: skip
        assert classifier.shape == (32, 3)
        torch.testing.assert_close(classifier.norm(dim=0), torch.ones(3))
    assert model.training  # open_clip models start in training mode, and stay so


def test_k_ranks_give_one_ranks_retrieval_exactly(tmp_path):
    from eval_sets import CAPTIONS, write_retrieval_folder

    torch.manual_seed(1)
    vectors = (torch.randint(-40, 41, (9, DIM)) / 20).tolist()
    CAPTIONS.clear()
    captions = []
    for i in range(9):  # 1 to 3 captions per image, each a noisy copy of some image's vector
        captions.append([f"{i}-{j}" for j in range(1 + i % 3)])
        for name in captions[-1]:
            CAPTIONS[name] = (torch.tensor(vectors[(i + len(name)) % 9]) + torch.randn(DIM)).tolist()
    evalset = read_wds_folder(write_retrieval_folder(tmp_path / "ret", vectors, captions))

    def work(collectives):
        return retrieve(
            FakeModel(), fake_tokenize, evalset, preprocess=vector_preprocess, batch_size=2, device="cpu",
            collectives=collectives,
        )  # fmt: skip

    (reference,) = on_ranks(1, work)
    assert reference["num_samples"] == 9 and reference["num_texts"] == 18
    for world in (2, 3, 6):  # 5 batches: with 6 ranks one rank has no share
        assert on_ranks(world, work) == [reference] * world


def test_a_wrong_imagenet_folder_stops_the_run_before_step_1(tmp_path):
    from eva_fastclip.config import load_config
    from eva_fastclip.plan import preflight

    (tmp_path / "val" / "not_a_wnid").mkdir(parents=True)
    for folder in (tmp_path / "missing", tmp_path / "val"):
        cfg = load_config(None, [f"eval.imagenet_val={folder}"])
        (problem,) = preflight.check_eval(cfg)
        assert problem.key == "eval.imagenet_val" and problem.error
        assert "set eval.imagenet_val=null" in problem.message
