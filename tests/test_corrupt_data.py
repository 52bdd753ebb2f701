"""A corpus with every kind of bad sample: one epoch delivers every good sample once and counts every bad
one under its reason; a training run over it finishes with the counts in its log and in TensorBoard; a
stream that only fails stops with an error that names its shards."""

import io
import logging
import tarfile
from pathlib import Path

import open_clip
import pytest
import torch
from PIL import Image
from stand_ins import toy_config, toy_trainer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torchvision import transforms

from eva_fastclip.data import TrainLoader, write_shard
from eva_fastclip.data.tar_reader import SKIP_REASONS

PREPROCESS = transforms.Compose([transforms.Resize((8, 8)), transforms.ToTensor()])
INDEX_SIZE = 24

# The samples 0..23 that can train. 2, 4, 8, 17, 20 and 23 are bad, and so are two more samples written under
# the keys of 9 and 3; 6 and 14 have no .json, so only a loss without per-sample state can train on them.
GOOD = {0, 1, 3, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15, 16, 18, 19, 21, 22}
NO_JSON = {6, 14}
BAD = {"undecodable_image": 2, "empty_caption": 2, "non_utf8_caption": 1, "duplicate_key": 2, "incomplete": 1}


def expected_skips(needs_index: bool) -> dict[str, int]:
    counts = {**BAD, "no_usable_index": len(NO_JSON)} if needs_index else BAD
    return {reason: counts.get(reason, 0) for reason in SKIP_REASONS}


def index_png(index: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (index % 256, index // 256, 200)).save(buffer, format="PNG")
    return buffer.getvalue()


def index_from_image(image: torch.Tensor) -> int:
    red, green = (round(float(channel.mean()) * 255) for channel in image[:2])
    return red + 256 * green


def good(i: int, **members) -> dict:
    """Sample i: its index drawn into the image, captioned "sample {i}", under key and index i."""
    sample = {"__key__": f"{i:03d}", "png": index_png(i), "txt": f"sample {i}", "json": {"key": i}}
    return {**sample, **members}


def without_json(sample: dict) -> dict:
    return {name: value for name, value in sample.items() if name != "json"}


def cut_member(shard: Path, name: str) -> None:
    """Truncate the shard in the middle of the data of its member ``name``, as an interrupted copy does."""
    with tarfile.open(shard) as tar:
        member = tar.getmember(name)
    with shard.open("r+b") as stream:
        stream.truncate(member.offset_data + member.size // 2)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("corrupt")
    write_shard(
        folder / "a.tar",
        [
            good(0),
            good(1),
            good(2, png=b"\x89PNG\r\n\x1a\n not an image"),
            good(3),
            good(4, txt=""),
            good(5),
            without_json(good(6)),
            good(7),
            good(8, txt="café sample 8".encode("latin-1")),
            good(9),
            good(9, png=index_png(30), txt="sample 30"),  # another sample under 9's key, right after it
            good(3, png=index_png(31), txt="sample 31"),  # and one under 3's key, further on
            good(10),
            good(11),
        ],
    )
    write_shard(
        folder / "b.tar",
        [
            good(12),
            good(13),
            without_json(good(14)),
            good(15),
            good(16),
            good(17, png=index_png(17)[:60]),  # a PNG cut short
            good(18),
            good(19),
            good(20, txt="  \n "),
            good(21),
            good(22),
            good(23),
        ],
    )
    cut_member(folder / "b.tar", "023.json")  # the shard ends inside the last sample's first member
    return [str(folder / "a.tar"), str(folder / "b.tar")]


@pytest.fixture(scope="module")
def tokenize():
    return open_clip.get_tokenizer("ViT-B-32")


def test_the_corpus_is_what_it_claims(corpus):
    with tarfile.open(corpus[0]) as tar:
        names = [member.name for member in tar.getmembers()]
    assert names.count("009.png") == 2 and names.count("003.txt") == 2 and "006.json" not in names
    with pytest.raises(tarfile.ReadError, match="unexpected end of data"), tarfile.open(corpus[1]) as tar:
        for member in tar:
            tar.extractfile(member).read()


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("needs_index", [False, True], ids=["openclip", "compositional"])
def test_an_epoch_delivers_every_good_sample_and_counts_every_bad_one(corpus, tokenize, needs_index, workers):
    good_samples = GOOD - NO_JSON if needs_index else GOOD
    loader = TrainLoader(
        corpus,
        preprocess=PREPROCESS,
        tokenize=tokenize,
        batch_size=4 if needs_index else 3,  # 16 or 18 good samples: 8 or 9 per shard, so per worker
        num_samples=len(good_samples),
        index_size=INDEX_SIZE if needs_index else None,
        needs_index=needs_index,
        shuffle_buffer=0,  # samples in shard order: the epoch ends only after the last bad sample was read
        workers=workers,
    )
    delivered = []
    for images, tokens, indices, _ in loader:
        for image, row_tokens, index in zip(images, tokens, indices.tolist()):
            sample = index_from_image(image)
            assert torch.equal(row_tokens, tokenize([f"sample {sample}"])[0])  # its own caption
            assert index == (-1 if sample in NO_JSON else sample)  # and its own index
            delivered.append(sample)
    assert sorted(delivered) == sorted(good_samples)  # each good sample once, no bad one, no duplicate
    assert loader.skipped_by_reason == expected_skips(needs_index)
    assert loader.skipped == sum(expected_skips(needs_index).values())


@pytest.mark.parametrize("workers", [0, 2])
def test_skip_counts_go_on_after_a_resume(corpus, tokenize, workers):
    """A resumed loader's counts go on from its checkpoint's (they started at 0 again, and the workers'
    read-ahead made them depend on timing): after every batch, and after the epoch, it reports what the
    uninterrupted loader reports at that batch."""

    def loader():
        return TrainLoader(
            corpus, preprocess=PREPROCESS, tokenize=tokenize, batch_size=2, num_samples=16,
            index_size=INDEX_SIZE, shuffle_buffer=4, workers=workers,
        )  # fmt: skip

    whole = loader()
    uninterrupted = [whole.skipped_by_reason for _ in whole]
    assert uninterrupted[-1] == expected_skips(needs_index=True)  # the epoch passes over every bad sample
    for stop in range(1, len(uninterrupted)):
        first = loader()
        for taken, _ in enumerate(first, start=1):
            if taken == stop:
                break
        state = first.state_dict()
        assert state["skipped"] == uninterrupted[stop - 1]
        second = loader()
        second.load_skipped(state["skipped"])
        assert second.resume(0, stop, state)  # exactly: the same streams read again
        assert [second.skipped_by_reason for _ in second] == uninterrupted[stop:], stop


def corrupt_run_config(corpus: list[str], output_dir: Path, *overrides: str):
    return toy_config(
        output_dir,
        "loss.name=fastclip_v3",
        f'data.train_shards=["{corpus[0]}", "{corpus[1]}"]',
        "data.workers=2",  # one shard each: the counts of both worker processes add up
        "data.shuffle_buffer=0",
        f"data.num_samples={len(GOOD - NO_JSON)}",
        f"data.index_size={INDEX_SIZE}",
        "train.batch_size=4",
        "train.epochs=1",
        "train.log_every_steps=2",
        "optim.warmup_steps=1",
        *overrides,
    )


def last_skip_counts(output_dir: Path) -> tuple[int, dict[str, float]]:
    """The step and the counts by reason of the last train/data/skipped* in TensorBoard."""
    events = EventAccumulator(str(output_dir / "tensorboard"))
    events.Reload()
    step = events.Scalars("train/data/skipped")[-1].step
    return step, {reason: events.Scalars(f"train/data/skipped/{reason}")[-1].value for reason in SKIP_REASONS}


def test_a_run_over_corrupt_shards_finishes_and_logs_every_skip(corpus, tmp_path, caplog):
    output_dir = tmp_path / "run"
    cfg = corrupt_run_config(corpus, output_dir)
    trainer = toy_trainer(cfg)
    with caplog.at_level(logging.WARNING, logger="eva_fastclip"):
        trainer.train()
    assert trainer.step == 4
    # one epoch moved the per-sample state of exactly the good samples
    table = trainer.loss.state
    touched = torch.isfinite(table.values[:, table.column("log_u1")]).nonzero().flatten().tolist()
    assert set(touched) == GOOD - NO_JSON

    expected = expected_skips(needs_index=True)
    total = sum(expected.values())
    assert last_skip_counts(output_dir) == (4, expected)

    lines = [record.getMessage() for record in caplog.records]
    lines = [line for line in lines if "samples skipped so far" in line]
    assert lines, "no console line counts the skipped samples"
    assert f"{total} samples skipped so far on 1 rank(s)" in lines[-1]
    for reason, count in expected.items():
        assert (f"{reason} {count}" in lines[-1]) == (count > 0), lines[-1]


def test_a_resumed_run_logs_the_skips_of_the_whole_run(corpus, tmp_path):
    """Two steps, a save, and a resumed run to the epoch's end: TensorBoard's last counts are the whole
    epoch's, as in the run without a stop (they restarted at 0 with the resumed run)."""
    output_dir = tmp_path / "run"
    for steps, resume in ((2, None), (4, "latest")):
        cfg = corrupt_run_config(corpus, output_dir, f"train.steps={steps}", "train.save_every_steps=2")
        trainer = toy_trainer(cfg, resume=resume)
        trainer.train()
        assert trainer.step == steps
    assert last_skip_counts(output_dir) == (4, expected_skips(needs_index=True))


@pytest.mark.parametrize("workers", [0, 1])
def test_a_stream_that_only_fails_stops_naming_its_shards(tmp_path, tokenize, workers):
    write_shard(
        tmp_path / "all-bad.tar",
        [
            good(0, png=b"not an image"),
            good(1, txt=""),
            good(2, txt=b"\xff\xfe"),
            good(2, png=index_png(2)),  # its key again
            {"__key__": "003", "txt": "sample 3", "json": {"key": 3}},  # no image
        ],
    )
    (tmp_path / "not-a-tar.tar").write_bytes(b"\x00garbage" * 100)
    loader = TrainLoader(
        [str(tmp_path / "all-bad.tar"), str(tmp_path / "not-a-tar.tar")],
        preprocess=PREPROCESS,
        tokenize=tokenize,
        batch_size=2,
        num_samples=4,
        needs_index=False,
        shuffle_buffer=0,
        workers=workers,
    )
    with pytest.raises(RuntimeError) as raised:
        list(loader)
    message = str(raised.value)
    assert "1000 samples in a row could not be read or used" in message
    assert "from 2 shard(s)" in message and "all-bad.tar" in message and "not-a-tar.tar" in message
