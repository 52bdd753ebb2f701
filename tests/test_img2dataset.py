"""Shards as img2dataset writes them train as written: string keys with gaps, sizes from its records.

``write_img2dataset`` writes what ``img2dataset --output_format webdataset --caption_col caption`` writes
(rom1504/img2dataset: downloader.py, writer.py, logger.py): per shard ``{shard:05d}.tar`` with the rows that
downloaded, ``{shard:05d}.parquet`` with every input row, failures included, and ``{shard:05d}_stats.json``.
"""

import collections
import hashlib
import io
import json
import math
import tarfile
import time
from pathlib import Path

import open_clip
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import webdataset as wds
from PIL import Image
from stand_ins import toy_config, toy_trainer
from torchvision import transforms

from eva_fastclip.data import DataSizes, TrainLoader, resolve_sizes

PREPROCESS = transforms.Compose([transforms.Resize((8, 8)), transforms.ToTensor()])

# img2dataset's parquet schema for a parquet/csv input with url and caption columns: the input columns
# (caption before url), then what the downloader adds, exif and sha256 being on by default.
SCHEMA = pa.schema(
    [
        ("caption", pa.string()),
        ("url", pa.string()),
        ("key", pa.string()),
        ("status", pa.string()),
        ("error_message", pa.string()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("original_width", pa.int32()),
        ("original_height", pa.int32()),
        ("exif", pa.string()),
        ("sha256", pa.string()),
    ]
)


def caption_of(row: int) -> str:
    return f"a photo number {row}"


def write_img2dataset(out, num_rows, *, number_sample_per_shard, failed=(), oom_shard_count=5):
    """img2dataset's output for ``num_rows`` input rows (row i: ``caption_of(i)``); rows in ``failed`` fail
    to download. Returns {int(key): caption} of the samples in the tars."""
    out.mkdir(parents=True, exist_ok=True)
    oom_sample_per_shard = math.ceil(math.log10(number_sample_per_shard))
    written = {}
    for shard_id in range(math.ceil(num_rows / number_sample_per_shard)):
        name = f"{shard_id:0{oom_shard_count}d}"
        first = shard_id * number_sample_per_shard
        rows = range(first, min(num_rows, first + number_sample_per_shard))
        start, metas, status_dict = time.time(), [], {}
        with wds.TarWriter(str(out / f"{name}.tar")) as tar:
            for row_in_shard, row in enumerate(rows):
                true_key = 10**oom_sample_per_shard * shard_id + row_in_shard
                key = f"{true_key:0{oom_sample_per_shard + oom_shard_count}d}"
                meta = {
                    "caption": caption_of(row),
                    "url": f"https://example.com/{row}.jpg",
                    "key": key,
                    "status": None,
                    "error_message": None,
                    "width": None,
                    "height": None,
                    "original_width": None,
                    "original_height": None,
                    "exif": None,
                    "sha256": None,
                }
                if row in failed:
                    meta["status"] = "failed_to_download"
                    meta["error_message"] = "HTTP Error 404: Not Found"
                else:
                    original = io.BytesIO()
                    Image.new("RGB", (24, 20), (row % 256, 90, 160)).save(original, format="JPEG")
                    resized = io.BytesIO()
                    Image.new("RGB", (16, 16), (row % 256, 90, 160)).save(resized, format="JPEG")
                    meta.update(
                        status="success",
                        width=16,
                        height=16,
                        original_width=24,
                        original_height=20,
                        exif="{}",
                        sha256=hashlib.sha256(original.getvalue()).hexdigest(),
                    )
                    sample = {"__key__": key, "jpg": resized.getvalue(), "txt": meta["caption"]}
                    tar.write({**sample, "json": json.dumps(meta, indent=4)})
                    written[true_key] = meta["caption"]
                status_dict[meta["error_message"] or "success"] = (
                    status_dict.get(meta["error_message"] or "success", 0) + 1
                )
                metas.append(meta)
        pq.write_table(pa.Table.from_pylist(metas, schema=SCHEMA), out / f"{name}.parquet")
        stats = {
            "count": len(rows),
            "successes": sum(meta["status"] == "success" for meta in metas),
            "failed_to_download": sum(meta["status"] == "failed_to_download" for meta in metas),
            "failed_to_resize": 0,
            "duration": time.time() - start,
            "start_time": start,
            "end_time": time.time(),
            "status_dict": status_dict,
        }
        (out / f"{name}_stats.json").write_text(json.dumps(stats, indent=4))
    return written


# 49 input rows, 20 a shard: keys are shard * 100 + row (20 rows need 2 digits), 7 digits long. Nine rows
# fail, among them the very last, so 40 samples (5 batches of 8) and a table of 2 * 100 + 9 = 209 rows.
ROWS, PER_SHARD = 49, 20
FAILED = {3, 7, 15, 20, 39, 41, 44, 47, 48}
INDEX_SIZE = 2 * 100 + (ROWS - 2 * PER_SHARD)


@pytest.fixture(scope="module")
def tokenize():
    return open_clip.get_tokenizer("ViT-B-32")


@pytest.fixture(scope="module")
def downloaded(tmp_path_factory):
    out = tmp_path_factory.mktemp("img2dataset") / "cc_tiny"
    written = write_img2dataset(out, ROWS, number_sample_per_shard=PER_SHARD, failed=FAILED)
    return out, written


def test_the_written_layout_is_img2datasets(downloaded):
    out, written = downloaded
    assert sorted(p.name for p in out.iterdir()) == [
        f"0000{s}{suffix}" for s in range(3) for suffix in (".parquet", ".tar", "_stats.json")
    ]
    # shard 1's keys are 100..119 (a gap after shard 0's 0..19); rows 3 and 20 (key 100) failed
    assert sorted(written)[:5] == [0, 1, 2, 4, 5] and sorted(written)[17:19] == [101, 102]
    with tarfile.open(out / "00001.tar") as tar:
        members = {member.name: tar.extractfile(member).read() for member in tar.getmembers()}
    assert len(members) == 18 * 3  # rows 20 and 39 failed
    meta = json.loads(members["0000101.json"])  # shard 1, row 1: input row 21
    assert (meta["key"], meta["status"], meta["caption"]) == ("0000101", "success", caption_of(21))
    assert members["0000101.txt"].decode() == caption_of(21)
    table = pq.read_table(out / "00002.parquet")
    assert table.num_rows == 9 and table.column("key").to_pylist()[-1] == "0000208"
    assert table.column("status").to_pylist()[-1] == "failed_to_download"
    assert json.loads((out / "00002_stats.json").read_text())["successes"] == 5


def test_sizes_come_from_stats_and_parquet(downloaded):
    out, written = downloaded
    urls = [str(out / f"0000{s}.tar") for s in range(3)]
    sizes = resolve_sizes(urls)
    assert sizes == DataSizes(40, "img2dataset *_stats.json", INDEX_SIZE, "img2dataset *.parquet")
    assert len(written) == 40 and max(written) < INDEX_SIZE
    # a subset counts its own shards; the bound covers the failed rows of its parquets too
    assert resolve_sizes(urls[:2]) == DataSizes(35, "img2dataset *_stats.json", 120, "img2dataset *.parquet")
    # numbers in the config win, and nothing is read for them
    given = resolve_sizes(urls, num_samples=16, index_size=5000)
    assert given == DataSizes(16, "data.num_samples", 5000, "data.index_size")
    assert resolve_sizes(urls, needs_index=False).index_size is None


def test_loader_yields_every_downloaded_sample_by_its_key(downloaded, tokenize):
    out, written = downloaded
    loader = TrainLoader(
        [str(out / "{00000..00002}.tar")],
        preprocess=PREPROCESS,
        tokenize=tokenize,
        batch_size=8,
        shuffle_buffer=10,
        workers=0,
    )
    assert (loader.num_samples, loader.dataset_size, loader.num_batches) == (40, INDEX_SIZE, 5)
    seen = []
    for images, tokens, indices, _ in loader:
        assert images.shape == (8, 3, 8, 8)
        for row_tokens, index in zip(tokens, indices.tolist()):
            assert torch.equal(row_tokens, tokenize([written[index]])[0])
        seen += indices.tolist()
    assert sorted(seen) == sorted(written) and loader.skipped == 0


def test_a_fastclip_v3_run_trains_on_img2dataset_shards(downloaded, tmp_path):
    out, written = downloaded
    trainer = make_trainer(out, "fastclip_v3", tmp_path, "train.log_every_steps=1")
    assert trainer.loader.sizes == DataSizes(
        40, "img2dataset *_stats.json", INDEX_SIZE, "img2dataset *.parquet"
    )
    assert trainer.total_steps == 5
    table = trainer.loss.state
    assert table.size == INDEX_SIZE and table.values.shape[0] == INDEX_SIZE
    trainer.train()
    assert trainer.step == 5 and trainer.loader.skipped == 0
    # one epoch touched exactly the rows of the downloaded samples, addressed by int(key)
    log_u1 = table.values[:, table.column("log_u1")]
    touched = set(torch.isfinite(log_u1).nonzero().flatten().tolist())
    assert touched == set(written)


def test_a_run_reads_each_record_once(downloaded, tmp_path, monkeypatch):
    """The run's set-up reads each _stats.json and each parquet once (rank 0 reads, every rank's loader is
    handed the sizes), where it read each _stats.json twice on every rank, and the loader knows each shard's
    count, as the records say."""
    from eva_fastclip.data import sizes as sizes_module

    out, _ = downloaded
    opened = collections.Counter()
    parse_json, parquet_bound = sizes_module._parse_json, sizes_module._parquet_bound

    def counted_json(text, where):
        opened[Path(where).name] += 1
        return parse_json(text, where)

    def counted_bound(source, path, column):
        opened[Path(path).name] += 1
        return parquet_bound(source, path, column)

    monkeypatch.setattr(sizes_module, "_parse_json", counted_json)
    monkeypatch.setattr(sizes_module, "_parquet_bound", counted_bound)
    trainer = make_trainer(out, "fastclip_v3", tmp_path)
    assert opened == {
        f"0000{shard}{record}": 1 for shard in range(3) for record in ("_stats.json", ".parquet")
    }
    stats = [json.loads((out / f"0000{shard}_stats.json").read_text())["successes"] for shard in range(3)]
    assert trainer.loader.sizes.shard_counts == tuple(stats)


def make_trainer(shards, loss, output_dir, *overrides):
    cfg = toy_config(
        output_dir,
        f"loss.name={loss}",
        f'data.train_shards=["{shards}"]',
        "data.workers=0",
        "data.shuffle_buffer=16",
        "train.batch_size=8",
        "train.epochs=1",
        "optim.warmup_steps=1",
        *overrides,
    )
    return toy_trainer(cfg)


def test_openclip_trains_on_samples_without_a_usable_index(tmp_path):
    """Keys far above the sample count, missing or not numbers: the OpenCLIP loss needs none of them."""
    shards = tmp_path / "shards"
    shards.mkdir()
    with wds.TarWriter(str(shards / "00000.tar")) as tar:
        for i in range(16):
            meta = {"caption": caption_of(i), "key": f"{10**6 + i:09d}" if i % 4 else "n/a"}
            if i % 4 == 1:
                del meta["key"]
            jpg = io.BytesIO()
            Image.new("RGB", (16, 16), (i * 16, 90, 160)).save(jpg, format="JPEG")
            sample = {"__key__": f"{i:09d}", "jpg": jpg.getvalue(), "txt": caption_of(i)}
            tar.write({**sample, "json": json.dumps(meta)})
    (shards / "sizes.json").write_text(json.dumps({"00000.tar": 16}))

    trainer = make_trainer(shards, "openclip", tmp_path / "run")
    assert trainer.loader.sizes == DataSizes(16, "sizes.json", None, None)
    trainer.train()
    assert trainer.step == 2 and trainer.loader.skipped == 0
    # a loss with per-sample state cannot address these samples: it asks for the table's size
    with pytest.raises(
        ValueError, match=r"no record bounds the indices of .*00000\.tar.*set data\.index_size"
    ):
        make_trainer(shards, "fastclip_v3", tmp_path / "run_v3")


def test_sizes_handed_to_a_loader_must_be_of_its_shards(downloaded, tokenize):
    out, _ = downloaded
    urls = [str(out / f"0000{shard}.tar") for shard in range(3)]
    sizes = resolve_sizes(urls[:2])
    with pytest.raises(ValueError, match="count 2 shards, the sources .* hold 3"):
        TrainLoader(urls, preprocess=PREPROCESS, tokenize=tokenize, batch_size=8, workers=0, sizes=sizes)
    loader = TrainLoader(
        urls[:2], preprocess=PREPROCESS, tokenize=tokenize, batch_size=8, workers=0, sizes=sizes
    )
    assert loader.sizes is sizes and loader.num_batches == sizes.num_samples // 8
