"""Every sample once per epoch, for any number of shards, ranks and loader workers: the draws of a whole
epoch over every rank are counted, with no sample twice and fewer than one global batch left out (the
remainder). FastCLIP's u estimators assume one visit per sample per epoch; with whole shards per consumer
(rank x worker), 10 equal shards over 4 ranks drew 27 of 320 samples twice and 27 never."""

import collections
import io
import json
from pathlib import Path

import open_clip
import pytest
from PIL import Image
from torchvision import transforms

from eva_fastclip.data import TrainLoader, write_shard

PREPROCESS = transforms.Compose([transforms.Resize((4, 4)), transforms.ToTensor()])
PNG = io.BytesIO()
Image.new("RGB", (4, 4), (10, 20, 30)).save(PNG, format="PNG")


@pytest.fixture(scope="module")
def tokenize():
    return open_clip.get_tokenizer("ViT-B-32")


def write_source(folder: Path, sizes: list[int], first_index: int = 0) -> str:
    """Shards of the given sizes in ``folder``, OpenCLIP's sizes.json beside them; indices run on."""
    folder.mkdir(parents=True)
    index = first_index
    for number, size in enumerate(sizes):
        samples = []
        for _ in range(size):
            key = f"{index:09d}"
            meta = json.dumps({"key": key}).encode()
            samples.append({"__key__": key, "png": PNG.getvalue(), "txt": b"a drawing", "json": meta})
            index += 1
        write_shard(folder / f"{number:05d}.tar", samples)
    (folder / "sizes.json").write_text(json.dumps({f"{n:05d}.tar": size for n, size in enumerate(sizes)}))
    return str(folder)


def epoch_draws(sources, tokenize, *, ranks: int, workers: int, batch: int, epoch: int = 1) -> list[int]:
    drawn = []
    for rank in range(ranks):
        loader = TrainLoader(
            sources,
            preprocess=PREPROCESS,
            tokenize=tokenize,
            batch_size=batch,
            rank=rank,
            world_size=ranks,
            seed=11,
            shuffle_buffer=6,
            workers=workers,
            needs_index=False,  # indices are read all the same; no per-sample table to bound them
        )
        loader.set_epoch(epoch)
        batches = list(loader)
        assert len(batches) == loader.num_batches
        drawn += [index for _, _, indices in batches for index in indices.tolist()]
    return drawn


def assert_once(drawn: list[int], total: int, global_batch: int) -> None:
    repeated = {index: n for index, n in collections.Counter(drawn).items() if n > 1}
    assert not repeated, f"{len(repeated)} samples drawn more than once"
    assert set(drawn) <= set(range(total))
    assert total - len(drawn) < global_batch  # only the remainder is left for another epoch


@pytest.mark.parametrize(
    "sizes, ranks, workers, batch",
    [
        ([32] * 10, 4, 0, 8),  # 10 shards / 4 consumers: the measured case
        ([12] * 7, 6, 0, 2),  # 7 shards / 6 consumers
        ([5, 11, 20], 2, 0, 4),  # 3 uneven shards / 2 consumers
        ([9, 9], 3, 0, 2),  # more consumers than shards
        ([32] * 10, 2, 2, 8),  # 10 shards / 4 consumers as 2 ranks x 2 worker processes
        ([13, 6, 30, 7, 21], 2, 1, 3),  # uneven shards, a remainder, a worker process per rank
    ],
)
def test_an_epoch_draws_every_sample_once(tmp_path, tokenize, sizes, ranks, workers, batch):
    source = write_source(tmp_path / "shards", sizes)
    drawn = epoch_draws([source], tokenize, ranks=ranks, workers=workers, batch=batch)
    assert_once(drawn, sum(sizes), batch * ranks)
    # another epoch: another order, the same guarantee
    other = epoch_draws([source], tokenize, ranks=ranks, workers=workers, batch=batch, epoch=2)
    assert_once(other, sum(sizes), batch * ranks)
    assert other != drawn


def test_sources_of_several_folders_tile_too(tmp_path, tokenize):
    sources = [write_source(tmp_path / "a", [10, 3]), write_source(tmp_path / "b", [17], first_index=13)]
    assert_once(epoch_draws(sources, tokenize, ranks=3, workers=0, batch=2), 30, 6)


def test_unknown_counts_say_how_uneven_the_epoch_may_be(tmp_path, tokenize):
    source = write_source(tmp_path / "shards", [32] * 10)
    (tmp_path / "shards" / "sizes.json").unlink()
    with pytest.warns(UserWarning, match="up to about 64 samples an epoch repeat") as warned:
        TrainLoader(
            [source], preprocess=PREPROCESS, tokenize=tokenize, batch_size=8, world_size=4, workers=0,
            num_samples=320, needs_index=False,
        )  # fmt: skip
    assert "no record (manifest.json, sizes.json, *_stats.json) counts" in str(warned[0].message)


def test_a_resumed_epoch_draws_what_the_uninterrupted_one_would(tmp_path, tokenize):
    """Exact mid-epoch resume with shards split between consumers: the streams are rebuilt where they
    stood (state_dict / resume), and the draws of both halves are those of the uninterrupted epoch."""
    source = write_source(tmp_path / "shards", [13, 6, 30, 7, 21])

    def loader(rank):
        return TrainLoader(
            [source], preprocess=PREPROCESS, tokenize=tokenize, batch_size=3, rank=rank, world_size=2,
            seed=11, shuffle_buffer=6, workers=1, needs_index=False,
        )  # fmt: skip

    for rank in range(2):
        whole = loader(rank)
        whole.set_epoch(1)
        uninterrupted = [indices.tolist() for _, _, indices in whole]
        first = loader(rank)
        first.set_epoch(1)
        head = []
        for _, _, indices in first:
            head.append(indices.tolist())
            if len(head) == 5:
                break
        state = first.state_dict()
        second = loader(rank)
        assert second.resume(1, 5, state)  # exactly
        tail = [indices.tolist() for _, _, indices in second]
        assert head + tail == uninterrupted
