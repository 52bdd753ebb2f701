"""Data layer: toy dataset, make-shards, and the webdataset loaders on real tar shards."""

import io
import json
import logging
import tarfile
from pathlib import Path

import numpy as np
import open_clip
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from torchvision import transforms

from eva_fastclip.cli import main
from eva_fastclip.config import ConfigError, load_config
from eva_fastclip.data import (
    TOY_CLASSNAMES,
    DataSizes,
    TrainLoader,
    expand_urls,
    read_manifest,
    resolve_sizes,
    write_manifest,
    write_shard,
    write_shards,
    write_toy_dataset,
)
from eva_fastclip.data import train_loader as train_loader_module
from eva_fastclip.data.toy import COLORS

PREPROCESS = transforms.Compose([transforms.Resize((8, 8)), transforms.ToTensor()])


@pytest.fixture(scope="module")
def tokenize():
    return open_clip.get_tokenizer("ViT-B-32")


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy")
    write_toy_dataset(
        out, num_train=40, num_val=12, num_zeroshot=40, image_size=32, samples_per_shard=16, seed=3
    )
    return out


def tar_members(path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {member.name: tar.extractfile(member).read() for member in tar.getmembers()}


# --- images whose pixels encode their index, so the loaders can be checked end to end -------------------


def index_png(index: int) -> bytes:
    image = Image.new("RGB", (16, 16), (index % 256, index // 256, 200))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def index_from_image(image: torch.Tensor) -> int:
    red, green = (round(float(channel.mean()) * 255) for channel in image[:2])
    return red + 256 * green


def make_indexed_shards(tmp_path: Path, count: int, per_shard: int, corrupt: tuple[int, ...] = ()) -> Path:
    """``count`` samples (captions "sample {i}") via write_shards; rows in ``corrupt`` get garbage PNGs."""
    images = tmp_path / "images"
    images.mkdir(parents=True)
    rows = ["image,caption"]
    for i in range(count):
        data = b"\x89PNG\r\n\x1a\n garbage" if i in corrupt else index_png(i)
        (images / f"{i}.png").write_bytes(data)
        rows.append(f"{i}.png,sample {i}")
    (tmp_path / "captions.csv").write_text("\n".join(rows) + "\n")
    out = tmp_path / "shards"
    write_shards(
        images, tmp_path / "captions.csv", out, samples_per_shard=per_shard, verify_images=not corrupt
    )
    return out


def check_batch(batch, tokenize, batch_size: int) -> list[int]:
    """Asserts shapes and that image, caption and index of every row belong together; returns indices."""
    images, tokens, indices, keys = batch
    assert images.shape == (batch_size, 3, 8, 8) and images.dtype == torch.float32
    assert tokens.shape == (batch_size, 77) and tokens.dtype == torch.long
    assert indices.shape == (batch_size,) and indices.dtype == torch.int64
    assert keys.shape == (batch_size,) and keys.dtype == torch.int64  # each sample's (data/sample_keys.py)
    for image, row_tokens, index in zip(images, tokens, indices.tolist()):
        assert index_from_image(image) == index
        assert torch.equal(row_tokens, tokenize([f"sample {index}"])[0])
    return indices.tolist()


# --- toy dataset ----------------------------------------------------------------------------------------


def test_toy_layout_and_manifests(toy_dir):
    train = read_manifest(toy_dir / "train")
    assert train["format"] == "eva_fastclip-shards" and train["version"] == 1
    assert train["shards"] == ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
    assert train["samples_per_shard"] == [16, 16, 8]
    assert (train["num_samples"], train["index_min"], train["index_max"], train["skipped"]) == (40, 0, 39, 0)
    val = read_manifest(toy_dir / "val" / "manifest.json")
    assert (val["num_samples"], val["index_min"], val["index_max"]) == (12, 40, 51)  # continues train's

    members = tar_members(toy_dir / "train" / "shard-000001.tar")
    assert len(members) == 16 * 3
    for name, data in members.items():
        if name.endswith(".json"):
            meta = json.loads(data)
            key = name.removesuffix(".json")
            assert meta["key"] == key and int(key) == meta["index"] and 16 <= meta["index"] < 32
            assert members[f"{key}.txt"].decode() == meta["caption"]
            assert meta["color"] in meta["caption"] and meta["shape"] in meta["caption"]
            assert TOY_CLASSNAMES[meta["label"]] == f"{meta['color']} {meta['shape']}"
            image = Image.open(io.BytesIO(members[f"{key}.png"]))
            assert image.size == (32, 32)

    zeroshot = tar_members(toy_dir / "zeroshot" / "test" / "0.tar")
    labels = sorted((name, int(data)) for name, data in zeroshot.items() if name.endswith(".cls"))
    assert len(labels) == 40 and [label for _, label in labels] == [i % 20 for i in range(40)]
    classnames = (toy_dir / "zeroshot" / "classnames.txt").read_text().splitlines()
    assert classnames == TOY_CLASSNAMES and len(set(classnames)) == 20
    templates = (toy_dir / "zeroshot" / "zeroshot_classification_templates.txt").read_text().splitlines()
    assert templates and all("{c}" in template for template in templates)


def test_toy_images_show_the_captioned_colour(toy_dir):
    members = tar_members(toy_dir / "train" / "shard-000000.tar")
    for name, data in members.items():
        if name.endswith(".json"):
            meta = json.loads(data)
            pixels = np.asarray(Image.open(io.BytesIO(members[name.replace(".json", ".png")])).convert("RGB"))
            distance = np.abs(pixels.astype(int) - np.array(COLORS[meta["color"]])).sum(axis=-1)
            assert (distance < 70).sum() >= 20, meta  # a clearly visible object of the named colour


def test_toy_is_deterministic(tmp_path):
    sizes = dict(num_train=8, num_val=4, num_zeroshot=20, image_size=16, samples_per_shard=4)
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        write_toy_dataset(tmp_path / name, seed=seed, **sizes)
    for relative in ("train/shard-000001.tar", "val/shard-000000.tar", "zeroshot/test/0.tar"):
        assert (tmp_path / "a" / relative).read_bytes() == (tmp_path / "b" / relative).read_bytes()
        assert (tmp_path / "a" / relative).read_bytes() != (tmp_path / "c" / relative).read_bytes()


# --- make-shards ----------------------------------------------------------------------------------------


def test_write_shards_csv_stable_indices_and_skips(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    for i in range(6):
        (images / f"{i}.png").write_bytes(index_png(i))
    jpeg = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(jpeg, format="JPEG")
    (images / "photo.jpeg").write_bytes(jpeg.getvalue())
    (images / "broken.png").write_bytes(b"not an image")
    rows = ["0.png", "1.png", "missing.png", "2.png", "broken.png", "photo.jpeg", "3.png"]
    lines = ["caption,image"] + [f'"caption, {n}",{name}' for n, name in enumerate(rows)]
    (tmp_path / "captions.csv").write_text("\n".join(lines) + "\n")

    manifest = write_shards(
        images, tmp_path / "captions.csv", tmp_path / "out", samples_per_shard=2, start_index=100
    )
    assert manifest == read_manifest(tmp_path / "out")
    assert manifest["skipped"] == 2 and manifest["num_samples"] == 5
    assert manifest["shards"] == ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
    assert manifest["samples_per_shard"] == [2, 2, 1]
    assert (manifest["index_min"], manifest["index_max"]) == (100, 106)

    members = {}
    for shard in manifest["shards"]:
        members.update(tar_members(tmp_path / "out" / shard))
    metas = [json.loads(data) for name, data in sorted(members.items()) if name.endswith(".json")]
    assert [meta["index"] for meta in metas] == [100, 101, 103, 105, 106]  # gaps where rows were skipped
    assert [meta["caption"] for meta in metas] == [f"caption, {n}" for n in (0, 1, 3, 5, 6)]
    assert members["000000105.jpg"] == jpeg.getvalue()  # stored as-is, .jpeg -> jpg
    assert members["000000103.png"] == index_png(2)
    assert not list((tmp_path / "out").glob("*.tmp"))

    # Re-running gives the same shards byte for byte.
    write_shards(images, tmp_path / "captions.csv", tmp_path / "again", samples_per_shard=2, start_index=100)
    assert tar_members(tmp_path / "again" / "shard-000001.tar") == tar_members(
        tmp_path / "out" / "shard-000001.tar"
    )


def test_write_shards_jsonl(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    for i in range(3):
        (images / f"{i}.png").write_bytes(index_png(i))
    lines = [json.dumps({"file": f"{i}.png", "text": f"sample {i}", "extra": i}) for i in range(3)]
    (tmp_path / "captions.jsonl").write_text(lines[0] + "\n\n" + "\n".join(lines[1:]) + "\n")
    manifest = write_shards(
        images, tmp_path / "captions.jsonl", tmp_path / "out", image_column="file", caption_column="text"
    )
    assert manifest["num_samples"] == 3 and manifest["skipped"] == 0 and manifest["index_max"] == 2
    members = tar_members(tmp_path / "out" / "shard-000000.tar")
    assert members["000000002.txt"] == b"sample 2"
    assert json.loads(members["000000001.json"])["index"] == 1


def test_write_shards_rejects_malformed_captions_before_writing(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.png").write_bytes(index_png(0))
    (tmp_path / "no_column.csv").write_text("image,text\na.png,hello\n")
    with pytest.raises(ValueError, match=r"no_column\.csv: no image/caption columns: .* has image, text;"):
        write_shards(tmp_path / "images", tmp_path / "no_column.csv", tmp_path / "out")
    (tmp_path / "short_row.csv").write_text("image,caption\na.png,hello\na.png\n")
    with pytest.raises(ValueError, match=r"short_row\.csv, line 3"):
        write_shards(tmp_path / "images", tmp_path / "short_row.csv", tmp_path / "out")
    good = json.dumps({"image": "a.png", "caption": "hello"})
    (tmp_path / "bad.jsonl").write_text(f"{good}\n{good}\n{{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 3: invalid JSON"):
        write_shards(tmp_path / "images", tmp_path / "bad.jsonl", tmp_path / "out")
    (tmp_path / "missing_key.jsonl").write_text(f'{good}\n{{"image": "a.png"}}\n')
    with pytest.raises(ValueError, match=r"missing_key\.jsonl, line 2: .*'caption'"):
        write_shards(tmp_path / "images", tmp_path / "missing_key.jsonl", tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --- make-shards: the captions file's conventions (OpenCLIP's filepath/title TSV, our image/caption CSV) ---

# Captions with the characters a separator could split at: each must come back whole.
CAPTIONS = ["a dog, running", "two cats; asleep", "plain", 'a "quoted" word, and more']


def write_index_pngs(folder: Path, count: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (folder / f"{i}.png").write_bytes(index_png(i))
    return folder


def read_back(out: Path) -> list[tuple[int, str, str, int]]:
    """(index, .txt caption, .json caption, index the pixels encode) of every sample the manifest lists."""
    samples = []
    for shard in read_manifest(out)["shards"]:
        members = tar_members(out / shard)
        for name in sorted(n for n in members if n.endswith(".json")):
            meta, key = json.loads(members[name]), name.removesuffix(".json")
            pixels = transforms.ToTensor()(Image.open(io.BytesIO(members[f"{key}.png"])).convert("RGB"))
            samples.append(
                (meta["index"], members[f"{key}.txt"].decode(), meta["caption"], index_from_image(pixels))
            )
    return samples


def make_shards(tmp_path: Path, captions: str, *flags: str) -> int:
    argv = ["make-shards", "--images", str(tmp_path / "images"), "--captions", str(tmp_path / captions)]
    return main([*argv, "--output", str(tmp_path / "out"), "--samples-per-shard", "3", *flags])


def quoted(text: str) -> str:
    return '"' + text.replace('"', '""') + '"'


def tsv_field(text: str) -> str:
    # as pandas' to_csv(sep="\t") writes it: quoted only for a quote or a tab, so commas and semicolons
    # stand bare and a reader splitting at them would cut the caption
    return quoted(text) if '"' in text or "\t" in text else text


OPENCLIP_TSV = "filepath\ttitle\n" + "".join(f"{i}.png\t{tsv_field(c)}\n" for i, c in enumerate(CAPTIONS))
# both conventions: image/caption is read (what make-shards read before); filepath/title are decoys
BOTH_TSV = "title\tfilepath\tcaption\timage\n" + "".join(
    f"decoy\tdecoy.png\t{tsv_field(c)}\t{i}.png\n" for i, c in enumerate(CAPTIONS)
)


def jsonl(image_key: str, caption_key: str) -> str:
    return "".join(json.dumps({image_key: f"{i}.png", caption_key: c}) + "\n" for i, c in enumerate(CAPTIONS))


@pytest.mark.parametrize(
    "name, text",
    [
        # OpenCLIP names its tab-separated files .csv too: the header decides
        pytest.param("train.csv", OPENCLIP_TSV, id="openclip-tsv-named-csv"),
        pytest.param("train.tsv", OPENCLIP_TSV, id="openclip-tsv"),
        pytest.param(
            "captions.csv",
            "caption,image\n" + "".join(f"{quoted(c)},{i}.png\n" for i, c in enumerate(CAPTIONS)),
            id="ours-csv",
        ),
        pytest.param("both.tsv", BOTH_TSV, id="both-conventions"),
        pytest.param("train.jsonl", jsonl("filepath", "title"), id="openclip-jsonl"),
        pytest.param("captions.jsonl", jsonl("image", "caption"), id="ours-jsonl"),
    ],
)
def test_make_shards_reads_either_convention_without_flags(tmp_path, capsys, name, text):
    write_index_pngs(tmp_path / "images", len(CAPTIONS))
    (tmp_path / name).write_text(text)
    assert make_shards(tmp_path, name) == 0
    assert json.loads(capsys.readouterr().out)["num_samples"] == len(CAPTIONS)
    assert read_back(tmp_path / "out") == [(i, c, c, i) for i, c in enumerate(CAPTIONS)]
    assert read_manifest(tmp_path / "out")["samples_per_shard"] == [3, 1]


NAMED = ["--csv-img-key", "path", "--csv-caption-key", "desc"]


@pytest.mark.parametrize(
    "separator, flags",
    [
        pytest.param(";", ["--csv-separator", ";", *NAMED], id="semicolon"),
        pytest.param("\t", ["--csv-separator", "\\t", *NAMED], id="backslash-t"),  # as a shell passes it
        pytest.param("\t", ["--csv-separator", "\t", *NAMED], id="real-tab"),
        pytest.param(
            "\t", ["--image-column", "path", "--caption-column", "desc"], id="older-names-tab-detected"
        ),
        pytest.param(",", NAMED, id="comma-detected"),
        pytest.param("|", ["--csv-separator", "|", "--csv-caption-key", "desc"], id="image-column-found"),
    ],
)
def test_make_shards_openclip_flags_name_separator_and_columns(tmp_path, capsys, separator, flags):
    write_index_pngs(tmp_path / "images", len(CAPTIONS))
    # decoys under both conventions' names: reading a column not meant gives missing images or wrong captions
    named = "path" in flags
    lines = [separator.join(["image" if named else "filepath", "caption", "title", "desc", "path"])]
    for i, caption in enumerate(CAPTIONS):
        real, decoy = f"{i}.png", "decoy.png"
        row = [decoy if named else real, "decoy", "decoy", quoted(caption), real if named else decoy]
        lines.append(separator.join(row))
    (tmp_path / "captions.csv").write_text("\n".join(lines) + "\n")
    assert make_shards(tmp_path, "captions.csv", *flags) == 0, capsys.readouterr().err
    assert read_back(tmp_path / "out") == [(i, c, c, i) for i, c in enumerate(CAPTIONS)]


@pytest.mark.parametrize(
    "name, text, flags, message",
    [
        pytest.param(
            "captions.csv",
            "url,text\nhttp://x/0.png,hello\n",
            [],
            "captions.csv: no image/caption columns: its header (comma-separated) has url, text; name them "
            "with --csv-img-key and --csv-caption-key (OpenCLIP's filepath/title and image/caption are found "
            "without flags)\n",
            id="other-columns",
        ),
        pytest.param(
            "mixed.tsv",
            "filepath\tcaption\n0.png\thello\n",
            [],
            "mixed.tsv: no image/caption columns: its header (tab-separated) has filepath, caption; name",
            id="one-of-each-convention-is-no-pair",
        ),
        pytest.param(
            "train.csv",
            "filepath\ttitle\n0.png\thello\n",
            ["--csv-separator", ","],
            r"train.csv: no image/caption columns: its header (comma-separated) has filepath\ttitle; name",
            id="wrong-separator-shows-the-tab",
        ),
        pytest.param(
            "train.tsv",
            "filepath\ttitle\n0.png\thello\n",
            ["--csv-img-key", "path"],
            "train.tsv: no column 'path' (named with --csv-img-key): its header (tab-separated) has "
            "filepath, title\n",
            id="named-image-column-missing",
        ),
        pytest.param(
            "train.tsv",
            "filepath\ttitle\n0.png\thello\n",
            ["--caption-column", "text"],
            "train.tsv: no column 'text' (named with --csv-caption-key): its header (tab-separated) has",
            id="named-caption-column-missing",
        ),
        pytest.param(  # a header of one column has no separator to see: the .tsv name says tab
            "urls.tsv",
            "url\nhttp://x/0.png\n",
            [],
            "urls.tsv: no image/caption columns: its header (tab-separated) has url; name them",
            id="tsv-name-hints-tab",
        ),
        pytest.param(
            "records.jsonl",
            '{"url": "0.png", "text": "hello"}\n',
            [],
            "records.jsonl, line 1: no image/caption columns: its first record has url, text; name them with "
            "--csv-img-key and --csv-caption-key",
            id="jsonl-other-keys",
        ),
        pytest.param(
            "train.tsv",
            "filepath\ttitle\n",
            ["--csv-separator", ";;"],
            "--csv-separator must be one character",
            id="separator-of-two-characters",
        ),
    ],
)
def test_make_shards_names_the_columns_and_flags_in_one_line(tmp_path, capsys, name, text, flags, message):
    write_index_pngs(tmp_path / "images", 1)
    (tmp_path / name).write_text(text)
    assert make_shards(tmp_path, name, *flags) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("eva-fastclip make-shards: error: ") and message in captured.err
    assert not (tmp_path / "out").exists()  # refused before any shard is written


# --- expand_urls ----------------------------------------------------------------------------------------


def test_expand_urls(tmp_path):
    shards = make_indexed_shards(tmp_path, count=12, per_shard=4)
    names = [str(shards / f"shard-00000{i}.tar") for i in range(3)]
    assert expand_urls(str(shards / "shard-{000000..000002}.tar")) == names
    assert expand_urls(f"{names[2]}::{shards}/shard-00000{{0,1}}.tar") == [names[2], names[0], names[1]]
    assert expand_urls([str(shards), names[0]]) == names + [names[0]]
    assert expand_urls("pipe:cat s-{0..2}.tar") == [f"pipe:cat s-{i}.tar" for i in range(3)]
    with pytest.raises(FileNotFoundError, match=r"1 of 4 shards do not exist"):
        expand_urls(str(shards / "shard-{000000..000003}.tar"))
    with pytest.raises(FileNotFoundError, match="no shards"):
        expand_urls(str(tmp_path / "images"))


# --- training loader ------------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_train_epoch_covers_every_index_once_across_ranks(tmp_path, tokenize, workers):
    shards = make_indexed_shards(tmp_path, count=64, per_shard=8)
    seen = []
    for rank in range(2):
        loader = TrainLoader(
            [str(shards)],
            preprocess=PREPROCESS,
            tokenize=tokenize,
            batch_size=4,
            rank=rank,
            world_size=2,
            seed=5,
            shuffle_buffer=16,
            workers=workers,
        )
        assert (loader.num_samples, loader.dataset_size, loader.num_batches) == (64, 64, 8)
        loader.set_epoch(1)
        batches = list(loader)
        assert len(batches) == loader.num_batches
        for batch in batches:
            seen += check_batch(batch, tokenize, 4)
    assert sorted(seen) == list(range(64))
    assert seen[:16] != sorted(seen[:16])  # shuffled


def test_train_ranks_never_run_dry(tmp_path, tokenize):
    # 3 shards for 2 ranks x 2 workers, and an epoch longer than the data: every rank still gets full batches.
    shards = make_indexed_shards(tmp_path, count=20, per_shard=8)
    for rank in range(2):
        with pytest.warns(UserWarning, match="the shards hold 20 samples, fewer than an epoch's 54"):
            loader = TrainLoader(
                [str(shards)],
                preprocess=PREPROCESS,
                tokenize=tokenize,
                batch_size=3,
                rank=rank,
                world_size=2,
                num_samples=54,
                shuffle_buffer=5,
                workers=2,
            )
        assert loader.num_batches == 9 and loader.dataset_size == 20  # not a multiple of the workers
        batches = list(loader)
        assert len(batches) == 9
        indices = [index for batch in batches for index in check_batch(batch, tokenize, 3)]
        assert set(indices) <= set(range(20))


def test_train_order_depends_on_seed_and_epoch_only(tmp_path, tokenize):
    shards = make_indexed_shards(tmp_path, count=32, per_shard=4)

    def epoch_indices(epoch, seed=0, rank=0, world_size=1):
        loader = TrainLoader(
            [str(shards)],
            preprocess=PREPROCESS,
            tokenize=tokenize,
            batch_size=4,
            seed=seed,
            rank=rank,
            world_size=world_size,
            workers=0,
        )
        loader.set_epoch(epoch)
        return [index for _, _, indices, _ in loader for index in indices.tolist()]

    first = epoch_indices(0)
    assert sorted(first) == list(range(32))
    assert epoch_indices(0) == first
    assert epoch_indices(1) != first and epoch_indices(0, seed=1) != first
    # Which shards a rank reads changes from epoch to epoch too, not just their order.
    assert set(epoch_indices(0, rank=0, world_size=2)) != set(epoch_indices(1, rank=0, world_size=2))


def test_an_epoch_is_whole_optimizer_steps(tmp_path, tokenize):
    """34 samples, micro-batches of 2 on 2 ranks, 3 a step: 8 micro-batches would fit each rank, but the
    epoch takes 2 whole steps (6 a rank, 24 samples): no step spans two epochs."""
    shards = make_indexed_shards(tmp_path, count=34, per_shard=17)
    loaders = [
        TrainLoader(
            [str(shards)],
            preprocess=PREPROCESS,
            tokenize=tokenize,
            batch_size=2,
            rank=r,
            world_size=2,
            workers=0,
            accumulation=3,
        )  # fmt: skip
        for r in (0, 1)
    ]
    assert [loader.num_batches for loader in loaders] == [6, 6]
    drawn = [index for loader in loaders for _, _, indices, _ in loader for index in indices.tolist()]
    assert len(drawn) == len(set(drawn)) == 24


def test_train_resampled_weights_mix_sources(tmp_path, tokenize):
    source_a = make_indexed_shards(tmp_path / "a", count=16, per_shard=4)
    source_b = tmp_path / "b"
    source_b.mkdir()
    samples_b = [  # a second caption line must be ignored: the loaders use the first line
        {"__key__": f"b{i}", "png": index_png(i), "txt": f"sample {i}\nanother caption", "json": {"key": i}}
        for i in range(16, 32)
    ]
    write_shard(source_b / "shard-000000.tar", samples_b)
    write_manifest(source_b, shards=["shard-000000.tar"], samples_per_shard=[16], index_min=16, index_max=31)

    def sample_indices(weights, epoch=0):
        loader = TrainLoader(
            [str(source_a), str(source_b)],
            preprocess=PREPROCESS,
            tokenize=tokenize,
            batch_size=8,
            resampled=True,
            weights=weights,
            shuffle_buffer=8,
            workers=0,
        )
        assert (loader.num_samples, loader.dataset_size, loader.num_batches) == (32, 32, 4)
        loader.set_epoch(epoch)
        return [index for batch in loader for index in check_batch(batch, tokenize, 8)]

    assert all(index >= 16 for index in sample_indices([0.0, 1.0]))
    assert all(index < 16 for index in sample_indices([1.0, 0.0]))
    mixed = sample_indices([1.0, 1.0])
    assert mixed == sample_indices([1.0, 1.0]) and mixed != sample_indices([1.0, 1.0], epoch=1)
    with pytest.raises(ValueError, match="resampled"):
        TrainLoader([str(source_a)], preprocess=PREPROCESS, tokenize=tokenize, batch_size=8, weights=[1.0])


def test_corrupt_image_is_skipped_and_counted(tmp_path, tokenize):
    shards = make_indexed_shards(tmp_path, count=9, per_shard=9, corrupt=(3,))
    loader = TrainLoader(
        [str(shards)], preprocess=PREPROCESS, tokenize=tokenize, batch_size=4, shuffle_buffer=0, workers=0
    )
    indices = [index for batch in loader for index in check_batch(batch, tokenize, 4)]
    assert sorted(indices) == [0, 1, 2, 4, 5, 6, 7, 8]
    assert loader.skipped == 1


def test_skips_are_summed_over_worker_processes(tmp_path, tokenize):
    # One corrupt sample in each of two shards; each worker reads one shard.
    shards = make_indexed_shards(tmp_path, count=10, per_shard=5, corrupt=(2, 7))
    loader = TrainLoader(
        [str(shards)], preprocess=PREPROCESS, tokenize=tokenize, batch_size=4, shuffle_buffer=0, workers=2
    )
    indices = [index for batch in loader for index in check_batch(batch, tokenize, 4)]
    assert sorted(indices) == [0, 1, 3, 4, 5, 6, 8, 9]
    assert loader.skipped == 2


def test_unreadable_shard_is_skipped(tmp_path, tokenize):
    shards = make_indexed_shards(tmp_path, count=8, per_shard=8)
    broken = tmp_path / "broken.tar"
    broken.write_bytes(b"\x00garbage" * 100)
    loader = TrainLoader(
        [str(shards), str(broken)],
        preprocess=PREPROCESS,
        tokenize=tokenize,
        batch_size=4,
        num_samples=16,
        index_size=8,
        shuffle_buffer=0,
        workers=0,
    )
    indices = [index for batch in loader for index in check_batch(batch, tokenize, 4)]
    assert len(indices) == 16 and set(indices) <= set(range(8))
    assert loader.skipped >= 1


def test_data_that_never_decodes_fails_loudly(tmp_path, tokenize, monkeypatch):
    monkeypatch.setattr(train_loader_module, "_MAX_FAILURES_IN_A_ROW", 20)
    shards = make_indexed_shards(tmp_path, count=4, per_shard=4, corrupt=(0, 1, 2, 3))
    loader = TrainLoader(
        [str(shards)], preprocess=PREPROCESS, tokenize=tokenize, batch_size=2, shuffle_buffer=0, workers=0
    )
    with pytest.raises(RuntimeError, match="in a row could not be read"):
        list(loader)
    # Many failures are fine as long as good samples keep coming between them.
    spread = make_indexed_shards(tmp_path / "spread", count=48, per_shard=48, corrupt=tuple(range(0, 48, 2)))
    loader = TrainLoader(
        [str(spread)], preprocess=PREPROCESS, tokenize=tokenize, batch_size=2, shuffle_buffer=0, workers=0
    )
    assert len(list(loader)) == 24 and loader.skipped >= 48  # two passes, plus read-ahead


def write_keyed_shard(folder: Path, metas: list) -> list[int]:
    """One shard of samples "sample {i}" with the given .json (None: no .json at all); returns the i."""
    folder.mkdir(parents=True, exist_ok=True)
    samples = []
    for i, meta in enumerate(metas):
        sample = {"__key__": f"s{i:03d}", "png": index_png(i), "txt": f"sample {i}"}
        samples.append(sample if meta is None else {**sample, "json": meta})
    write_shard(folder / "shard-000000.tar", samples)
    return list(range(len(metas)))


# .json fields of samples 0..7: four usable indices in [0, 10) (int or digits), four that are not
UNUSABLE = {1: {"id": 3}, 3: {"key": "12"}, 5: {"key": "n/a"}, 7: None}
KEYED = [UNUSABLE.get(i, {"key": [4, None, "0000009", None, 0, None, 7, None][i]}) for i in range(8)]


def test_unusable_index_is_skipped_and_counted_when_state_needs_it(tmp_path, tokenize):
    write_keyed_shard(tmp_path, KEYED)
    loader = TrainLoader(
        [str(tmp_path / "shard-000000.tar")],
        preprocess=PREPROCESS,
        tokenize=tokenize,
        batch_size=2,
        num_samples=4,
        index_size=10,
        shuffle_buffer=0,
        workers=0,
    )
    assert (loader.dataset_size, loader.sizes.index_size_from) == (10, "data.index_size")
    batches = list(loader)
    assert [batch[2].tolist() for batch in batches] == [[4, 9], [0, 7]]
    positions = [[index_from_image(image) for image in batch[0]] for batch in batches]
    assert positions == [[0, 2], [4, 6]]  # the samples with a usable index, with their own images
    for (_, tokens, _, _), rows in zip(batches, positions):
        assert torch.equal(tokens, tokenize([f"sample {row}" for row in rows]))
    # missing key, 12 >= index_size, "n/a"; s007 (no .json) lies past the epoch's last sample: not drawn
    assert loader.skipped_by_reason["no_usable_index"] == loader.skipped == 3


def test_unusable_index_never_matters_without_per_sample_state(tmp_path, tokenize):
    write_keyed_shard(tmp_path, KEYED)
    loader = TrainLoader(
        [str(tmp_path / "shard-000000.tar")],
        preprocess=PREPROCESS,
        tokenize=tokenize,
        batch_size=4,
        num_samples=8,
        needs_index=False,
        shuffle_buffer=0,
        workers=0,
    )
    assert loader.dataset_size is None and loader.sizes.index_size_from is None
    indices = torch.cat([batch[2] for batch in loader]).tolist()
    assert indices == [4, -1, 9, 12, 0, -1, 7, -1] and loader.skipped == 0


def test_integer_index_field_is_configurable(tmp_path, tokenize):
    write_keyed_shard(tmp_path, [{"id": 5 - i, "key": "x"} for i in range(4)])
    loader = TrainLoader(
        [str(tmp_path / "shard-000000.tar")],
        preprocess=PREPROCESS,
        tokenize=tokenize,
        batch_size=4,
        num_samples=4,
        index_size=6,
        index_key="id",
        shuffle_buffer=0,
        workers=0,
    )
    assert next(iter(loader))[2].tolist() == [5, 4, 3, 2] and loader.skipped == 0


def test_train_loader_needs_its_sizes(tmp_path, tokenize):
    shard = [str(tmp_path / "data.tar")]
    write_shard(shard[0], [{"__key__": "k", "png": index_png(0), "txt": "x", "json": {"key": 0}}])
    with pytest.raises(ValueError, match=r"no record counts the samples of .*data\.tar.*data\.num_samples"):
        TrainLoader(shard, preprocess=PREPROCESS, tokenize=tokenize, batch_size=1)
    with pytest.raises(ValueError, match=r"no record bounds the indices of .*set data\.index_size"):
        TrainLoader(shard, preprocess=PREPROCESS, tokenize=tokenize, batch_size=1, num_samples=1)
    # a loss without per-sample state needs no table, so nothing has to bound the indices
    loader = TrainLoader(
        shard,
        preprocess=PREPROCESS,
        tokenize=tokenize,
        batch_size=1,
        num_samples=1,
        needs_index=False,
        workers=0,
    )
    assert (loader.num_samples, loader.dataset_size) == (1, None)
    with pytest.raises(ValueError, match="do not fill one batch"):
        TrainLoader(
            shard, preprocess=PREPROCESS, tokenize=tokenize, batch_size=4, num_samples=3, index_size=1
        )


def test_train_loader_on_toy_data(toy_dir, tokenize):
    loader = TrainLoader(
        [str(toy_dir / "train")], preprocess=PREPROCESS, tokenize=tokenize, batch_size=8, workers=0
    )
    indices = torch.cat([batch[2] for batch in loader])
    assert loader.num_batches == 5 and sorted(indices.tolist()) == list(range(40))


# --- size records and other tools' files -----------------------------------------------------------------


def test_foreign_manifest_never_blocks(tmp_path, tokenize, caplog):
    shards = make_indexed_shards(tmp_path, count=8, per_shard=4)
    (shards / "manifest.json").write_text(json.dumps({"format": "some-other-tool", "files": ["x"]}))
    (shards / "sizes.json").write_text(json.dumps({"shard-000000.tar": 4, "shard-000001.tar": 4}))
    assert read_manifest(shards) is None
    pattern = str(shards / "shard-{000000..000001}.tar")
    loader = TrainLoader(
        [pattern], preprocess=PREPROCESS, tokenize=tokenize, batch_size=4, index_size=8, workers=0
    )
    assert loader.sizes == DataSizes(8, "sizes.json", 8, "data.index_size")
    assert sorted(index for batch in loader for index in check_batch(batch, tokenize, 4)) == list(range(8))
    # a folder source reads its *.tar files instead, and says so
    with caplog.at_level(logging.INFO, logger="eva_fastclip.data.urls"):
        assert expand_urls(str(shards)) == expand_urls(pattern)
    assert "another tool's" in caplog.text
    (shards / "manifest.json").write_text("format: not json at all\n")
    assert read_manifest(shards) is None and expand_urls(str(shards)) == expand_urls(pattern)
    # our own manifest, broken, is still an error
    (shards / "manifest.json").write_text(json.dumps({"format": "eva_fastclip-shards", "shards": []}))
    with pytest.raises(ValueError, match="manifest lacks"):
        read_manifest(shards)


def test_openclip_sizes_json_and_len(tmp_path):
    for name in ("a.tar", "b.tar"):
        write_shard(tmp_path / name, [{"__key__": "k", "png": index_png(0), "txt": "x"}])
    a, b = str(tmp_path / "a.tar"), str(tmp_path / "b.tar")
    (tmp_path / "__len__").write_text("1000\n")
    # __len__ counts the whole folder: it serves when every *.tar of it is used, and no subset
    assert resolve_sizes([a, b], needs_index=False) == DataSizes(1000, "__len__", None, None)
    with pytest.raises(ValueError, match=r"no record counts the samples of .*b\.tar"):
        resolve_sizes([b], needs_index=False)
    # sizes.json counts each shard by its name, and comes before __len__
    (tmp_path / "sizes.json").write_text(json.dumps({"a.tar": 300, "b.tar": "700"}))
    assert resolve_sizes([b, a, b], needs_index=False).num_samples == 700 + 300 + 700
    assert resolve_sizes([b], needs_index=False).num_samples_from == "sizes.json"
    # neither says anything of the indices
    with pytest.raises(ValueError, match="set data.index_size"):
        resolve_sizes([a, b])
    (tmp_path / "sizes.json").write_text(json.dumps({"a.tar": -3}))
    with pytest.raises(ValueError, match=r"sizes\.json, 'a\.tar': -3 is not a sample count"):
        resolve_sizes([a], needs_index=False)
    with pytest.raises(ValueError, match=r"pipe:cat a\.tar is a command's output.*set data\.num_samples"):
        resolve_sizes(["pipe:cat a.tar"], needs_index=False)  # (remote records: test_remote_data.py)


def test_sizes_of_mixed_sources_add_up(tmp_path):
    ours = make_indexed_shards(tmp_path / "ours", count=12, per_shard=8)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    write_shard(theirs / "00000.tar", [{"__key__": "0000500", "png": index_png(0), "txt": "x"}])
    (theirs / "00000_stats.json").write_text(json.dumps({"count": 1, "successes": 1}))
    pq.write_table(pa.table({"key": ["0000500", "0000517"]}), theirs / "00000.parquet")
    urls = expand_urls([str(ours), str(theirs / "00000.tar")])
    both = "img2dataset *_stats.json + manifest.json", "img2dataset *.parquet + manifest.json"
    assert resolve_sizes(urls) == DataSizes(13, both[0], 518, both[1])
    (theirs / "00000_stats.json").write_text(json.dumps({"count": 1}))
    with pytest.raises(ValueError, match=r"00000_stats\.json, 'successes': None is not a sample count"):
        resolve_sizes(urls)
    pq.write_table(pa.table({"key": ["0000500", "5x"]}), theirs / "00000.parquet")
    with pytest.raises(ValueError, match=r"00000\.parquet: column 'key' holds values that are not integers"):
        resolve_sizes(urls, num_samples=13)
    with pytest.raises(ValueError, match=r"00000\.parquet has no column 'index'.*set data\.index_size"):
        resolve_sizes(urls, num_samples=13, index_key="index")


def test_data_config_keys():
    data = load_config(None, []).data
    assert (data.index_key, data.index_size, data.num_samples) == ("key", None, None)
    with pytest.raises(ConfigError, match=r"data\.index_size must be > 0"):
        load_config(None, ["data.index_size=0"])
    with pytest.raises(ConfigError, match=r"data\.index_key is empty"):
        load_config(None, ["data.index_key="])


def test_dry_run_says_where_the_sizes_come_from(toy_dir, tmp_path, capsys):
    argv = ["train", "--config", "configs/toy.json", "--set", f'data.train_shards=["{toy_dir / "train"}"]']
    argv += ["--set", f"train.output_dir={tmp_path / 'run'}"]  # not the demo's folder, which may hold a run
    # the dry-run checks every path and that a batch fits an epoch: the toy config's eval data, batch 8
    argv += ["--set", f"eval.zeroshot_dir={toy_dir / 'zeroshot'}", "--set", "train.batch_size=8"]
    argv += ["--set", f'eval.retrieval_shards=["{toy_dir / "val"}"]']
    assert main(argv + ["--set", "loss.name=fastclip_v3", "--dry-run"]) == 0
    printed = json.loads(capsys.readouterr().out)["data"]
    assert printed == {
        "num_samples": 40,
        "num_samples_from": "manifest.json",
        "index_size": 40,
        "index_size_from": "manifest.json",
        "epoch_split": "samples",  # the manifest counts every shard
    }
    assert main(argv + ["--set", "data.num_samples=16", "--dry-run"]) == 0
    printed = json.loads(capsys.readouterr().out)["data"]
    assert printed == {
        "num_samples": 16,
        "num_samples_from": "data.num_samples",
        "index_size": None,  # the OpenCLIP loss keeps no per-sample table
        "index_size_from": None,
        "epoch_split": "samples",
    }
    missing = ["--set", f'data.train_shards=["{toy_dir / "nowhere"}"]', "--dry-run"]
    assert main([*argv, *missing]) == 2  # printed, and an error
    assert "shards do not exist" in json.loads(capsys.readouterr().out)["data"]["not_checked"]


def test_a_thread_started_with_thread_keeps_the_fork_server_from_being_forked():
    """fork_worker_server forks the rank only while no other thread runs Python (one could hold a lock the
    forked server needs): a thread of ``_thread`` (execnet's, in a pytest-xdist worker) counts, though
    ``threading.active_count()`` misses it. A worker forked from a server forked beside execnet's
    thread waited for its loader for good once."""
    import _thread
    import threading

    from eva_fastclip.data.workers import other_python_threads

    before, started, release = threading.active_count(), threading.Event(), threading.Event()

    def hold():
        started.set()
        release.wait(30)

    ident = _thread.start_new_thread(hold, ())
    started.wait(30)
    try:
        assert threading.active_count() == before
        assert f"thread {ident}" in other_python_threads()
    finally:
        release.set()
