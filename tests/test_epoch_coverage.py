"""Every sample once per epoch, for any number of shards, ranks and loader workers: the draws of a whole
epoch over every rank are counted, with no sample twice and fewer than one global batch left out (the
remainder). FastCLIP's u estimators assume one visit per sample per epoch; with whole shards per consumer
(rank x worker), 10 equal shards over 4 ranks drew 27 of 320 samples twice and 27 never."""

import collections
import io
import json
import logging
import random
from pathlib import Path

import open_clip
import pytest
from PIL import Image
from torchvision import transforms

from eva_fastclip.data import TrainLoader, write_shard
from eva_fastclip.data.epoch_plan import EpochPlan, EpochRest, Tiling

PREPROCESS = transforms.Compose([transforms.Resize((4, 4)), transforms.ToTensor()])
PNG = io.BytesIO()
Image.new("RGB", (4, 4), (10, 20, 30)).save(PNG, format="PNG")


@pytest.fixture(scope="module")
def tokenize():
    return open_clip.get_tokenizer("ViT-B-32")


def write_source(folder: Path, sizes: list[int], first_index: int = 0, corrupt: tuple[int, ...] = ()) -> str:
    """Shards of the given sizes in ``folder``, OpenCLIP's sizes.json beside them; indices run on, and the
    images of those in ``corrupt`` do not decode."""
    folder.mkdir(parents=True)
    index = first_index
    for number, size in enumerate(sizes):
        samples = []
        for _ in range(size):
            key = f"{index:09d}"
            meta = json.dumps({"key": key}).encode()
            png = b"not a png" if index in corrupt else PNG.getvalue()
            samples.append({"__key__": key, "png": png, "txt": b"a drawing", "json": meta})
            index += 1
        write_shard(folder / f"{number:05d}.tar", samples)
    (folder / "sizes.json").write_text(json.dumps({f"{n:05d}.tar": size for n, size in enumerate(sizes)}))
    return str(folder)


def make_loader(sources, tokenize, *, rank: int, ranks: int, workers: int, batch: int, buffer: int = 6):
    return TrainLoader(
        sources,
        preprocess=PREPROCESS,
        tokenize=tokenize,
        batch_size=batch,
        rank=rank,
        world_size=ranks,
        seed=11,
        shuffle_buffer=buffer,
        workers=workers,
        needs_index=False,  # indices are read all the same; no per-sample table to bound them
    )


def epoch_draws(sources, tokenize, *, ranks: int, workers: int, batch: int, epoch: int = 1) -> list[int]:
    drawn = []
    for rank in range(ranks):
        loader = make_loader(sources, tokenize, rank=rank, ranks=ranks, workers=workers, batch=batch)
        loader.set_epoch(epoch)
        batches = list(loader)
        assert len(batches) == loader.num_batches
        drawn += [index for _, _, indices, _ in batches for index in indices.tolist()]
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
        uninterrupted = [indices.tolist() for _, _, indices, _ in whole]
        first = loader(rank)
        first.set_epoch(1)
        head = []
        for _, _, indices, _ in first:
            head.append(indices.tolist())
            if len(head) == 5:
                break
        state = first.state_dict()
        second = loader(rank)
        assert second.resume(1, 5, state)  # exactly
        tail = [indices.tolist() for _, _, indices, _ in second]
        assert head + tail == uninterrupted


@pytest.mark.parametrize(
    "before, after, stop, buffer",
    [
        ((2, 1, 4), (4, 0, 2), 32, 0),  # (ranks, workers, batch): more ranks, the same global batch
        ((3, 2, 2), (2, 1, 3), 30, 0),  # fewer ranks and workers
        ((1, 0, 5), (3, 2, 2), 30, 0),  # another global batch
        ((2, 2, 3), (3, 1, 2), 30, 4),  # with a shuffle buffer: off by at most a buffer per saved consumer
    ],
)
def test_an_epoch_resumed_on_another_layout_draws_the_rest_once(
    tmp_path, tokenize, before, after, stop, buffer
):
    """A run of layout ``before`` stops after ``stop`` samples; the run that resumes on layout ``after``
    re-tiles what is left: the draws of both cover the epoch once (each new consumer skipping its own share
    of the batches done drew some samples twice and missed as many)."""
    sizes = [13, 6, 30, 7, 21]
    source = write_source(tmp_path / "shards", sizes)
    (ranks, workers, batch), (new_ranks, new_workers, new_batch) = before, after
    done = stop // (ranks * batch)  # batches per rank of the stopped run
    drawn, position = [], None
    for rank in range(ranks):
        loader = make_loader(
            [source], tokenize, rank=rank, ranks=ranks, workers=workers, batch=batch, buffer=buffer
        )
        loader.set_epoch(1)
        for taken, (_, _, indices, _) in enumerate(loader, start=1):
            drawn += indices.tolist()
            if taken == done:
                break
        position = position or loader.state_dict()  # rank 0's, given to every rank (as the trainer does)
    assert len(drawn) == stop
    resume_at = stop // (new_ranks * new_batch)  # the trainer's conversion: the samples done, in new batches
    for rank in range(new_ranks):
        loader = make_loader(
            [source],
            tokenize,
            rank=rank,
            ranks=new_ranks,
            workers=new_workers,
            batch=new_batch,
            buffer=buffer,
        )
        assert not loader.resume(1, resume_at, position)  # approximately: another layout
        rest = [indices.tolist() for _, _, indices, _ in loader]
        drawn += [index for indices in rest for index in indices]
        # a re-tiled epoch saved and resumed on its own layout goes on exactly
        again = make_loader(
            [source],
            tokenize,
            rank=rank,
            ranks=new_ranks,
            workers=new_workers,
            batch=new_batch,
            buffer=buffer,
        )
        again.resume(1, resume_at, position)
        head = [indices.tolist() for _, (_, _, indices, _) in zip(range(2), again)]
        last = make_loader(
            [source],
            tokenize,
            rank=rank,
            ranks=new_ranks,
            workers=new_workers,
            batch=new_batch,
            buffer=buffer,
        )
        assert last.resume(1, resume_at + 2, again.state_dict())
        assert head + [indices.tolist() for _, _, indices, _ in last] == rest
    global_batch = max(ranks * batch, new_ranks * new_batch)
    if buffer == 0:
        assert_once(drawn, sum(sizes), global_batch)
    else:  # a saved consumer's buffer held up to `buffer` samples it had read and not drawn
        repeated = sum(n - 1 for n in collections.Counter(drawn).values())
        assert repeated <= ranks * max(workers, 1) * buffer
        assert sum(sizes) - len(set(drawn)) < global_batch + repeated


def test_a_consumer_that_runs_short_tops_up_and_says_so(tmp_path, tokenize, caplog):
    """Two samples do not decode: the consumers whose ranges hold them draw two others from the top-up
    pass, so every rank still yields its batches, no sample is drawn twice, and the log says why."""
    sizes = [10, 10, 10]
    source = write_source(tmp_path / "shards", sizes, corrupt=(3, 24))
    drawn = []
    with caplog.at_level(logging.WARNING, logger="eva_fastclip.data.train_loader"):
        for rank in range(2):
            loader = make_loader([source], tokenize, rank=rank, ranks=2, workers=1, batch=4)
            loader.set_epoch(1)
            batches = [indices.tolist() for _, _, indices, _ in loader]
            assert len(batches) == loader.num_batches == 3
            drawn += [index for indices in batches for index in indices]
    assert (
        len(drawn) == 24 and len(set(drawn)) == 24 and not {3, 24} & set(drawn)
    )  # the top-up: the remainder
    lines = [
        record.getMessage()
        for record in caplog.records
        if "outside their worker's share" in record.getMessage()
    ]
    assert lines and all("skipped this epoch (undecodable_image 1)" in line for line in lines)


def consumer_draws(plan: EpochPlan, rest: EpochRest, epoch: int = 3) -> list[list[tuple[str, int]]]:
    """Every consumer's pass-0 samples (shard, number) in reading order, by rank then worker."""
    counts = dict(zip(plan.urls, plan.counts))
    draws = []
    for rank in range(plan.tiling.world_size):
        for worker in range(max(plan.tiling.workers, 1)):
            samples = []
            for url, first, stop in plan.reads(epoch, 0, rank, worker, rest):
                samples += [(url, j) for j in range(first, counts[url] if stop is None else stop)]
            draws.append(samples)
    return draws


def test_re_tiled_plans_cover_the_epoch_once_whatever_the_layouts():
    """Plans alone (no reading), for layouts drawn at random: a run stops after some batches, the next one
    re-tiles the rest on another layout and stops too, and a third draws the rest of the epoch. What the
    runs drew (each consumer the start of its range, no shuffle buffer) never overlaps, and leaves out less
    than the last layout's global batch. The runs stop where the samples done fill whole global batches of
    the next layout, as at a step boundary when the trainer keeps the global batch."""
    rng = random.Random(5)
    resumes = 0
    for _ in range(300):
        counts = [rng.randint(0, 40) for _ in range(rng.randint(1, 9))]
        urls = [f"shard-{i}.tar" for i in range(len(counts))]

        def any_tiling(total: int) -> Tiling:
            ranks, workers, batch = rng.randint(1, 4), rng.randint(0, 3), rng.randint(1, 5)
            return Tiling(ranks, workers, batch, total // (ranks * batch))

        tiling = any_tiling(sum(counts))
        if tiling.num_batches < 1:
            continue
        plan, rest, drawn = EpochPlan(urls, counts, seed=1, tiling=tiling), EpochRest(), []
        for _ in range(2):
            new = any_tiling(sum(counts))
            global_batch, new_global = tiling.batch_size * tiling.world_size, new.batch_size * new.world_size
            stops = [
                batches
                for batches in range(rest.first_batch, tiling.num_batches)
                if batches * global_batch % new_global == 0
                and batches * global_batch // new_global < new.num_batches
            ]
            if not stops:
                break
            batches = rng.choice(stops)
            workers = max(tiling.workers, 1)
            for number, draws in enumerate(consumer_draws(plan, rest)):
                worker = number % workers
                mine = len(range(worker, batches, workers)) - len(range(worker, rest.first_batch, workers))
                drawn += draws[: mine * tiling.batch_size]
            new_plan = EpochPlan(urls, counts, seed=1, tiling=new)
            rest = new_plan.rest_after(tiling, rest, batches, batches * global_batch // new_global)
            plan, tiling = new_plan, new
            resumes += 1
        drawn += [sample for draws in consumer_draws(plan, rest) for sample in draws]
        assert len(set(drawn)) == len(drawn)
        assert sum(counts) - len(drawn) < tiling.batch_size * tiling.world_size
    assert resumes > 100
