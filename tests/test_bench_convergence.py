"""The convergence benchmark on a small fake package folder made here: the openclipart converter, the
in-memory loader and its crop, resuming, the aggregate tables, and one tiny run from end to end."""

import dataclasses
import hashlib
import io
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from benchmarks import convergence
from benchmarks.convergence_grid import DEFAULT_MODEL, VARIANTS, RunSpec, plan_runs
from benchmarks.convergence_report import (
    _siglip_section,
    paired_differences,
    plot_curves,
    results_table,
    t_quantile,
    verdict,
)
from benchmarks.convergence_run import MemoryLoader, load_results, random_resized_crop, run_one, write_json
from eva_fastclip.data import read_manifest
from eva_fastclip.data.openclipart import clean_words, make_caption, render, write_openclipart_dataset
from eva_fastclip.evaluation.sets import read_pair_shards, read_wds_folder

# category -> drawings; "plants" is too small to be a class, "unsorted" never is one
FAKE = {
    "animals/birds": ["eagle_nicu_buculei_01", "eagle_nicu_buculei_02", "owl_architetto_franc_01"],
    "animals": ["2_dead_frogs_lumen_desig_01", "bat_orlando_karam_", "catWithHat"],
    "food/fruit": ["apple_bitten_dan_gerhard_01", "banana", "cherry_01r", "kiwi", "lemon", "lime"],
    "shapes/stars": [f"star_{n:02d}pt03step" for n in range(5, 12)],
    "plants": ["tree", "flower"],
    "unsorted": ["thing_one", "thing_two", "thing_three", "thing_four", "thing_five"],
}
MIN_CLASS, PER_CLASS, NUM_VAL = 4, 2, 5


def make_fake_package(root: Path) -> None:
    rng = np.random.default_rng(0)
    for folder, names in FAKE.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        for i, name in enumerate(names):
            # some wide, some tall, some transparent: the converter pads, composites on white, shrinks
            size = (40 + 10 * (i % 3), 30 + 15 * (i % 2))
            pixels = rng.integers(0, 255, (size[1], size[0], 4), dtype=np.uint8)
            pixels[..., 3] = 0 if i == 0 else 255
            Image.fromarray(pixels, "RGBA").save(root / folder / f"{name}.png")
    # Debian links a drawing filed twice to one file: counted once, and never a zero-shot example
    os.symlink("../food/fruit/kiwi.png", root / "animals" / "kiwi_bird.png")
    (root / "README").write_text("not a drawing")


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openclipart")
    make_fake_package(tmp / "png")
    kwargs = dict(
        root=tmp / "png",
        image_size=8,
        zeroshot_per_class=PER_CLASS,
        min_class_size=MIN_CLASS,
        num_retrieval=NUM_VAL,
        samples_per_shard=4,
        processes=1,
    )
    summary = write_openclipart_dataset(tmp / "out", **kwargs)
    again = write_openclipart_dataset(tmp / "again", **kwargs)
    return {"tmp": tmp, "out": tmp / "out", "summary": summary, "again": again, "kwargs": kwargs}


def shard_samples(folder: Path) -> list[dict]:
    import webdataset as wds

    samples = []
    for shard in sorted(folder.glob("*.tar")):
        for sample in wds.DataPipeline(wds.SimpleShardList([str(shard)]), wds.tarfile_to_samples()):
            samples.append(sample)
    return samples


def test_captions_are_the_file_names_cleaned_up():
    assert (
        make_caption("food/fruit/apple_bitten_dan_gerhard_01.png") == "apple bitten dan gerhard, food, fruit"
    )
    assert (
        make_caption("recreation/music/CD_Player/cd-player_02r.png")
        == "cd player, recreation, music, cd player"
    )
    assert clean_words("star_13pt05step") == "star 13pt05step"  # only a trailing version number goes
    assert clean_words("catWithHat") == "cat with hat"
    assert clean_words("signs_and_symbols") == "signs and symbols"


def test_split_sizes_classes_and_indices(fake):
    out, summary = fake["out"], fake["summary"]
    total = sum(len(names) for names in FAKE.values())
    assert summary["drawings"] == total  # the symlink and the README are not drawings
    # kiwi is linked from animals too, so it is no zero-shot example, but food keeps 5 other candidates
    assert summary["classnames"] == ["animals", "food", "shapes"]
    assert summary["num_zeroshot"] == 3 * PER_CLASS and summary["num_val"] == NUM_VAL
    assert summary["num_train"] == total - 3 * PER_CLASS - NUM_VAL
    train, val = read_manifest(out / "train"), read_manifest(out / "val")
    assert (train["index_min"], train["index_max"]) == (0, summary["num_train"] - 1)
    assert (val["index_min"], val["index_max"]) == (summary["num_train"], summary["num_train"] + NUM_VAL - 1)
    train_meta = [json.loads(s["json"]) for s in shard_samples(out / "train")]
    assert [m["index"] for m in sorted(train_meta, key=lambda m: m["index"])] == list(
        range(summary["num_train"])
    )
    assert (out / "zeroshot" / "zeroshot_classification_templates.txt").read_text() == "{c}\n"


def test_no_drawing_in_two_splits_and_held_out_captions_are_unique(fake):
    out = fake["out"]
    train = [json.loads(s["json"]) for s in shard_samples(out / "train")]
    val = [json.loads(s["json"]) for s in shard_samples(out / "val")]
    zeroshot = shard_samples(out / "zeroshot" / "test")
    zs_meta = [json.loads(s["json"]) for s in zeroshot]
    sources = [m["source"] for m in train + val + zs_meta]
    assert len(sources) == len(set(sources)) == fake["summary"]["drawings"]
    all_captions = [m["caption"] for m in train + val + zs_meta]
    for m in val:
        assert all_captions.count(m["caption"]) == 1
    classnames = fake["summary"]["classnames"]
    labels = [int(s["cls"]) for s in zeroshot]
    assert sorted(labels) == sorted(list(range(len(classnames))) * PER_CLASS)  # balanced
    for meta, label in zip(zs_meta, labels):
        assert meta["source"].split("/")[0] == classnames[label]
        assert meta["source"] != "food/fruit/kiwi.png"  # filed under two categories
    assert not any(m["source"].startswith("unsorted/") for m in zs_meta)


def test_images_are_small_squares_on_white(fake):
    for sample in shard_samples(fake["out"] / "train") + shard_samples(fake["out"] / "val"):
        image = Image.open(io.BytesIO(sample["png"]))
        assert image.size == (8, 8) and image.mode == "RGB"
    # the first drawing of each folder is fully transparent: white after conversion
    transparent = fake["tmp"] / "png" / "food" / "fruit" / "apple_bitten_dan_gerhard_01.png"
    assert (np.asarray(Image.open(io.BytesIO(render(transparent, 8)))) == 255).all()
    # a wide drawing is padded to a square, not stretched: white bands above and below
    wide = Image.new("RGBA", (40, 20), (0, 0, 0, 255))
    wide.save(fake["tmp"] / "wide.png")
    pixels = np.asarray(Image.open(io.BytesIO(render(fake["tmp"] / "wide.png", 8))))
    assert (pixels[0] == 255).all() and (pixels[-1] == 255).all() and (pixels[4] == 0).all()


def test_conversion_is_deterministic(fake):
    def digest(folder: Path) -> dict[str, str]:
        return {
            str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*"))
            if p.is_file()
        }

    assert digest(fake["out"]) == digest(fake["tmp"] / "again")


def test_missing_package_names_the_install_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install openclipart-png"):
        write_openclipart_dataset(tmp_path / "out", root=tmp_path / "nothing")


def test_evaluation_reads_the_converted_folders(fake):
    """The runs' evaluation (eval.zeroshot_dir, eval.retrieval_shards) reads every converted sample."""
    zeroshot = read_wds_folder(fake["out"] / "zeroshot")
    assert zeroshot.classnames == fake["summary"]["classnames"] and zeroshot.templates == ["{c}"]
    assert len(zeroshot.samples) == fake["summary"]["num_zeroshot"]
    labels = [zeroshot.target(sample.read(), sample)[0] for sample in zeroshot.samples]
    assert set(labels) <= set(range(len(zeroshot.classnames)))
    assert len(read_pair_shards([str(fake["out"] / "val")]).samples) == NUM_VAL


def test_memory_loader_gives_every_sample_once_per_epoch(fake):
    to_tensor = lambda image: torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1)  # noqa: E731
    tokenize = lambda texts: torch.tensor([[len(t)] for t in texts])  # noqa: E731
    loader = MemoryLoader(
        fake["out"] / "train", preprocess=to_tensor, tokenize=tokenize, batch_size=2, seed=3
    )
    n = fake["summary"]["num_train"]
    assert loader.dataset_size == n and loader.num_batches == n // 2

    def epoch(e):
        loader.set_epoch(e)
        return torch.cat([indices for _, _, indices in loader]).tolist()

    first = epoch(0)
    assert len(first) == 2 * (n // 2) and len(set(first)) == len(first)  # no repeats, last odd one dropped
    assert epoch(0) == first and epoch(1) != first
    images, tokens, indices = next(iter(loader))
    assert images.shape == (2, 3, 8, 8) and tokens.shape == (2, 1)
    captions = {
        json.loads(s["json"])["index"]: s["txt"].decode() for s in shard_samples(fake["out"] / "train")
    }
    assert tokens[:, 0].tolist() == [len(captions[int(i)]) for i in indices]  # tokens travel with their index


def test_memory_loader_reads_indices_as_training_does(fake):
    train = fake["out"] / "train"
    to_tensor = lambda image: torch.zeros(3, 8, 8)  # noqa: E731
    tokenize = lambda texts: torch.zeros(len(texts), 1)  # noqa: E731
    loader = MemoryLoader(train, preprocess=to_tensor, tokenize=tokenize, batch_size=2, seed=0)
    # the converter writes the index twice: as "index" and as img2dataset's zero-padded "key", read here
    metas = [json.loads(s["json"]) for s in shard_samples(train)]
    assert loader.indices.tolist() == [int(m["key"]) for m in metas] == [m["index"] for m in metas]
    assert loader.dataset_size == read_manifest(train)["index_max"] + 1
    with pytest.raises(ValueError, match=r"id=None, not an index in \[0, 15\)"):
        MemoryLoader(train, preprocess=to_tensor, tokenize=tokenize, batch_size=2, seed=0, index_key="id")


def test_random_resized_crop_geometry():
    images = torch.randn(3, 3, 8, 8)
    generator = torch.Generator().manual_seed(0)
    # the whole image at its own aspect: the identity
    same = random_resized_crop(images, generator, scale=(1.0, 1.0), ratio=(1.0, 1.0))
    torch.testing.assert_close(same, images, atol=1e-5, rtol=0)
    # the left half of a ramp, sampled back to full width, covers only the ramp's left half
    ramp = torch.linspace(0, 1, 16).expand(1, 3, 16, 16).contiguous()
    half = random_resized_crop(ramp, generator, scale=(0.5, 0.5), ratio=(0.5, 0.5))  # width 1/2, height 1
    assert half.min() >= 0 and half.max() <= 1
    assert half[0, 0, 0].max() - half[0, 0, 0].min() == pytest.approx(0.5, abs=1 / 15)


# ---- aggregation -----------------------------------------------------------------------------------------

FINAL_KEYS = ["zeroshot_top1", "retrieval_image_to_text_R@1", "retrieval_text_to_image_R@1"]


def fake_record(variant, batch, seed, values, tau=0.05):
    spec = RunSpec(variant, batch, seed, 30, "bench-vit-xs", 2, 1, 1000, 32)
    final = dict(zip(FINAL_KEYS, values))
    final |= {"zeroshot_top1_chance": 1 / 12, "retrieval_R@1_chance": 0.002}
    curves = {"epoch": [0, 2], **{k: [0.0, v] for k, v in zip(FINAL_KEYS, values)}}
    curves |= {"temperature_epoch": [1, 2], "temperature": [0.07, tau]}
    return {
        "spec": dataclasses.asdict(spec),
        "final": final,
        "curves": curves,
        "wall_s": 10.0,
        "cpu_s": 9.0,
        "threads": 1,
    }


def table_row(table: str, *cells: str) -> list[str]:
    for line in table.splitlines():
        parts = [p.strip() for p in line.strip("|").split("|")]
        if parts[: len(cells)] == list(cells):
            return parts
    raise AssertionError(f"no row {cells} in\n{table}")


def test_results_table_mean_and_sample_std_beside_chance():
    v3 = [0.30, 0.34, 0.29]
    records = [fake_record("fastclip_v3", 64, s, (v, v / 2, v / 3)) for s, v in enumerate(v3)]
    records += [fake_record("openclip", 64, 0, (0.2, 0.1, 0.1))]
    table = results_table(records)
    row = table_row(table, "64", "FastCLIP-v3")
    assert row[2] == "3"
    assert row[3] == f"{np.mean(v3):.3f} ± {np.std(v3, ddof=1):.3f}"
    assert row[4] == f"{np.mean(v3) / 2:.3f} ± {np.std(v3, ddof=1) / 2:.3f}"
    assert table_row(table, "64", "OpenCLIP")[3] == "0.200"  # one seed: no spread
    chance = table_row(table, "", "chance level")
    assert chance[3:6] == ["0.083", "0.002", "0.002"]


def test_paired_differences_and_verdicts():
    v3 = [0.30, 0.34, 0.29]
    ahead = [0.20, 0.25, 0.18]  # v3 higher by 0.10, 0.09, 0.11
    mixed = [0.35, 0.30, 0.29]  # -0.05, +0.04, 0.0
    records = [fake_record("fastclip_v3", 64, s, (v, v, v)) for s, v in enumerate(v3)]
    records += [fake_record("openclip", 64, s, (v, v, v)) for s, v in enumerate(ahead)]
    records += [fake_record("sogclr", 64, s, (v, v, v)) for s, v in enumerate(mixed)]
    table = paired_differences(records)
    diffs = np.subtract(v3, ahead)
    assert table_row(table, "64", "OpenCLIP")[3] == f"{diffs.mean():.3f} ± {diffs.std(ddof=1):.3f} (ahead)"
    assert table_row(table, "64", "SogCLR")[3].endswith("(level)")
    assert verdict([-0.1, -0.11, -0.09]) == "behind" and verdict([0.1]) == "one seed"
    # the report's SigLIP section (its small-batch claim): SigLIP minus each other loss, when it ran
    assert _siglip_section(records) == ""
    records += [fake_record("siglip", 64, s, (v, v, v)) for s, v in enumerate(ahead)]
    section = _siglip_section(records)
    assert (
        table_row(section, "64", "FastCLIP-v3")[3]
        == f"{-diffs.mean():.3f} ± {diffs.std(ddof=1):.3f} (behind)"
    )


def student_t_cdf(x: float, df: int) -> float:
    """P(T <= x), x >= 0, by the trapezoid rule on Student's t density (error far below 1e-9 here)."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    t = np.linspace(0.0, x, 200_001)
    density = np.exp(log_c - (df + 1) / 2 * np.log1p(t**2 / df))
    return 0.5 + float((density[1:] + density[:-1]).sum()) * (t[1] - t[0]) / 2


def test_t_quantiles():
    # closed forms: Cauchy for 1 degree of freedom, (2p - 1) / sqrt(2p(1 - p)) for 2
    assert t_quantile(1) == pytest.approx(math.tan(0.475 * math.pi), rel=1e-9)
    assert t_quantile(2) == pytest.approx(0.95 / math.sqrt(2 * 0.975 * 0.025), rel=1e-9)
    for df, table in ((4, 2.776), (10, 2.228), (30, 2.042)):  # the printed tables' values
        assert t_quantile(df) == pytest.approx(table, abs=5e-4)
        assert student_t_cdf(t_quantile(df), df) == pytest.approx(0.975, abs=1e-9)
    # the verdict's interval: mean ± t * s / sqrt(n); 0.1 ± 4.303 * 0.02 / sqrt(3) excludes 0, ± 0.1 not
    assert verdict([0.08, 0.1, 0.12]) == "ahead" and verdict([0.0, 0.1, 0.2]) == "level"


def test_resume_skips_finished_runs_and_refuses_other_settings(tmp_path):
    specs = plan_runs(
        ["openclip", "fastclip_v3"],
        [64],
        [0, 1],
        epochs=30,
        model="bench-vit-xs",
        eval_every_epochs=2,
        warmup_epochs=1,
        num_train=1000,
        image_size=32,
    )
    assert [s.name for s in specs] == [
        "openclip-b64-s0",
        "fastclip_v3-b64-s0",
        "openclip-b64-s1",
        "fastclip_v3-b64-s1",
    ]
    write_json(
        tmp_path / "results" / "fastclip_v3-b64-s0.json", fake_record("fastclip_v3", 64, 0, (0.3, 0.1, 0.1))
    )
    done, todo = load_results(tmp_path, specs)
    assert len(done) == 1 and [s.name for s in todo] == [
        "openclip-b64-s0",
        "openclip-b64-s1",
        "fastclip_v3-b64-s1",
    ]
    other = [dataclasses.replace(specs[1], epochs=40)]
    with pytest.raises(ValueError, match="other settings"):
        load_results(tmp_path, other)


def test_every_variant_is_a_valid_config(tmp_path):
    from eva_fastclip.config import load_config

    for variant in VARIANTS:
        spec = RunSpec(variant, 64, 0, 30, "bench-vit-xs", 2, 1, 1000, 32)
        cfg = load_config(None, spec.overrides(tmp_path, tmp_path / "run"))
        assert cfg.train.precision == "fp32" and cfg.train.epochs == 30
        assert cfg.eval.every_steps == 2 * (1000 // 64) and cfg.optim.warmup_steps == 1000 // 64


def test_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    records = [
        fake_record(v, b, s, (0.3, 0.1, 0.1))
        for v in ("openclip", "fastclip_v3")
        for b in (64, 256)
        for s in (0, 1)
    ]
    path = plot_curves(records, tmp_path / "curves.png", title="test")
    assert Image.open(path).format == "PNG"


def test_one_tiny_run_end_to_end(fake, tmp_path):
    """MemoryLoader -> Trainer -> TensorBoard read-back -> result JSON -> the resume check and the table."""
    num_train = fake["summary"]["num_train"]
    # fastclip_v3 keeps per-sample state: the loader's indices and table size reach the loss
    spec = RunSpec("fastclip_v3", 4, 0, 1, DEFAULT_MODEL, 1, 0, num_train, 8)
    record = run_one(spec, fake["out"], tmp_path, threads=torch.get_num_threads())
    saved = json.loads((tmp_path / "results" / f"{spec.name}.json").read_text())
    assert saved == record
    assert record["steps_per_epoch"] == record["total_steps"] == num_train // 4
    curves = record["curves"]
    assert curves["epoch"] == [0.0, 1.0]  # the untrained model, then the end of the epoch
    assert curves["temperature_epoch"] == [1.0] and curves["temperature"][0] > 0
    for key in FINAL_KEYS:
        assert len(curves[key]) == 2 and 0 <= record["final"][key] <= 1
        assert curves[key][-1] == pytest.approx(record["final"][key])  # the last evaluation is the final one
    assert not (tmp_path / "runs" / spec.name / "checkpoints").exists()
    done, todo = load_results(tmp_path, [spec])  # a restarted benchmark skips it
    assert done == [record] and todo == []
    assert table_row(results_table(done), "4", "FastCLIP-v3")[2] == "1"


def test_cli_defaults_are_the_full_benchmark():
    args = convergence.build_parser().parse_args([])
    assert (args.epochs, args.seeds, args.batches, args.variants) == (30, [0, 1, 2], [64, 256], None)
