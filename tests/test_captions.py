"""Several captions a sample (data/captions.py): each sample's caption in each epoch is the same on 1 rank
and on 2 ranks x 2 loader workers; the weights hold over an epoch to within sampling error; without weights
the keys are a priority order; a sample with none of them is counted; evaluation reads the first key."""

import collections
import math

import open_clip
import pytest
from test_corrupt_data import PREPROCESS, index_from_image, index_png

from eva_fastclip.config import load_config
from eva_fastclip.config.sections import ConfigError
from eva_fastclip.data import TrainLoader, write_shard
from eva_fastclip.data.captions import Captions
from eva_fastclip.evaluation import read_pair_shards

N = 480  # samples 0..479, 4 shards of 120
KEYS = ("txt", "json:recaption")
WEIGHTS = (0.3, 0.7)


def sample(i: int) -> dict:
    """Sample i: alt-text "alt i" and a rewrite "re i"; every 10th has no rewrite, every 25th (from 1) no
    alt-text, and 7, 57, ... neither (no caption at all)."""
    meta = {"key": i}
    if i % 10:
        meta["recaption"] = f"re {i}"
    record = {"__key__": f"{i:04d}", "png": index_png(i), "json": meta}
    if i % 25 != 1:
        record["txt"] = f"alt {i}"
    if i % 50 == 7:
        record.pop("txt", None)
        meta.pop("recaption", None)
    return record


def has_both(i: int) -> bool:
    return i % 10 != 0 and i % 25 != 1 and i % 50 != 7


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("captions")
    for shard in range(4):
        write_shard(folder / f"{shard}.tar", [sample(i) for i in range(shard * 120, (shard + 1) * 120)])
    (folder / "sizes.json").write_text('{"0.tar": 120, "1.tar": 120, "2.tar": 120, "3.tar": 120}')
    return [str(folder / f"{shard}.tar") for shard in range(4)]


@pytest.fixture(scope="module")
def tokenize():
    return open_clip.get_tokenizer("ViT-B-32")


def captions_drawn(shards, tokenize, captions, *, ranks: int, workers: int, epoch: int):
    """{sample key: (index, "alt" or "re")} of the draws of an epoch over ``ranks`` x ``workers`` (a key
    names a sample's occurrence in the epoch: data/sample_keys.py), and the skips."""
    drawn, skips = {}, collections.Counter()
    for rank in range(ranks):
        loader = TrainLoader(
            shards, preprocess=PREPROCESS, tokenize=tokenize, batch_size=8, rank=rank, world_size=ranks,
            num_samples=N - 10, index_size=N, shuffle_buffer=20, workers=workers, captions=captions,
        )  # fmt: skip
        loader.set_epoch(epoch)
        for images, tokens, indices, keys in loader:
            for image, row, index, key in zip(images, tokens, indices.tolist(), keys.tolist()):
                assert index_from_image(image) == index
                kind = next(k for k in ("alt", "re") if row.equal(tokenize([f"{k} {index}"])[0]))
                drawn[key] = (index, kind)
        skips.update(loader.skipped_by_reason)
    return drawn, skips


def test_a_samples_caption_is_the_same_on_any_layout_and_the_weights_hold(shards, tokenize):
    captions = Captions(KEYS, WEIGHTS)
    by_epoch = []
    for epoch in (0, 1):
        one, skips = captions_drawn(shards, tokenize, captions, ranks=1, workers=0, epoch=epoch)
        four, _ = captions_drawn(shards, tokenize, captions, ranks=2, workers=2, epoch=epoch)
        common = one.keys() & four.keys()
        assert len(common) > 0.9 * len(one)
        assert {k: one[k] for k in common} == {k: four[k] for k in common}, epoch
        assert skips["incomplete"] == len([i for i in range(N) if i % 50 == 7]) == 10
        by_epoch.append({index: kind for index, kind in one.values()})
        both = [kind for index, kind in one.values() if has_both(index)]
        rewrites, expected = both.count("re"), len(both) * WEIGHTS[1]
        sigma = math.sqrt(len(both) * WEIGHTS[1] * WEIGHTS[0])
        print(f"epoch {epoch}: {rewrites} rewrites in {len(both)} draws ({expected:.0f} +- {sigma:.1f})")
        assert abs(rewrites - expected) < 4 * sigma
        assert all(kind == "alt" for index, kind in one.values() if index % 10 == 0)  # no rewrite
        assert all(kind == "re" for index, kind in one.values() if index % 25 == 1)  # no alt-text
    changed = [i for i in by_epoch[0].keys() & by_epoch[1].keys() if by_epoch[0][i] != by_epoch[1][i]]
    assert len(changed) > 0.2 * N  # the draw is the epoch's too


def test_without_weights_the_keys_are_a_priority_order(shards, tokenize):
    drawn, _ = captions_drawn(
        shards, tokenize, Captions(("json:recaption", "txt")), ranks=1, workers=0, epoch=0
    )
    assert drawn and all(kind == ("alt" if i % 10 == 0 else "re") for i, kind in drawn.values())


@pytest.mark.parametrize("key, caption", [("txt", "alt 2"), ("json:recaption", "re 2"), ("png", None)])
def test_evaluation_reads_the_first_key(shards, key, caption):
    """Retrieval on shards of the training layout: each image's caption under data.caption_keys' first."""
    evalset = read_pair_shards(shards[:1], caption_key=key)
    stored = evalset.samples[2]
    if caption is None:  # (not a caption: only to show the members read are the key's)
        assert set(stored.read()) == {"png"}
        return
    assert evalset.target(stored.read(), stored) == [caption]


@pytest.mark.parametrize(
    "sets, problem",
    [
        (["data.caption_keys=[]"], "at least one"),
        (['data.caption_keys=["txt", "txt"]'], "names a key twice"),
        (['data.caption_keys=["txt", "caption"]', "data.caption_weights=[1.0]"], "one positive weight"),
        (['data.caption_keys=["txt", "caption"]', "data.caption_weights=[1.0, 0.0]"], "one positive weight"),
    ],
)
def test_bad_caption_settings_are_named(sets, problem):
    with pytest.raises(ConfigError, match=problem):
        load_config("configs/toy.json", sets)
