"""`python -m benchmarks.data_loader` on tiny shards: the photo shards it writes, its CPU accounting
against the kernel's own after-exit count, OpenCLIP's loader as patched, and one short run of both loaders
(the report's structure, equal samples and shapes; no timing is asserted)."""

import contextlib
import hashlib
import io
import json
import resource
import subprocess
import sys
import tarfile
from pathlib import Path

import open_clip
import pytest
from PIL import Image

from benchmarks import data_contestants, data_floor, data_loader, data_remote, data_shards
from benchmarks.data_loader import main
from eva_fastclip.data import throughput


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return data_shards.bench_shards(tmp_path_factory.mktemp("bench") / "shards", shards=2, per_shard=24)


def test_shards_are_distinct_photos_in_img2dataset_layout(shards):
    digests = set()
    for kind, urls in shards.items():
        assert [Path(url).name for url in urls] == ["00000.tar", "00001.tar"]
        for shard, url in enumerate(urls):
            stats = json.loads(Path(url).with_name(f"{shard:05d}_stats.json").read_text())
            with tarfile.open(url) as tar:
                members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
            keys = sorted({name.split(".")[0] for name in members})
            assert stats["successes"] == len(keys) == 24
            for row, key in enumerate(keys):
                assert key == f"{shard:05d}{row:04d}"
                assert json.loads(members[f"{key}.json"])["key"] == key
                assert members[f"{key}.txt"].decode().strip()
                image = Image.open(io.BytesIO(members[f"{key}.jpg"]))
                assert image.format == "JPEG" and image.mode == "RGB"
                if kind == "256px":
                    assert min(image.size) == 256
                else:
                    assert 640 <= max(image.size) <= 1024
                digests.add(hashlib.sha256(image.tobytes()).hexdigest())
    assert len(digests) == 2 * 2 * 24  # every crop differs, and so do its two sizes


def test_shards_are_reused_when_the_settings_match(shards):
    root = Path(shards["256px"][0]).parent.parent
    before = {url: Path(url).stat().st_mtime_ns for urls in shards.values() for url in urls}
    assert data_shards.bench_shards(root, shards=2, per_shard=24) == shards
    assert {url: Path(url).stat().st_mtime_ns for url in before} == before


def lasting() -> set[int]:
    """Descendants that stay for the session, whatever ran before: our loaders' fork server,
    multiprocessing's resource tracker, the rank pool's server (tests/rank_pool.py)."""
    marks = (b"forkserver import main", b"resource_tracker", b"rank_pool.py")
    found = set()
    for pid in throughput.descendants():
        with contextlib.suppress(OSError):
            if any(mark in Path(f"/proc/{pid}/cmdline").read_bytes() for mark in marks):
                found.add(pid)
    return found


def test_worker_cpu_time_read_alive_matches_the_kernels_count_after_exit():
    burn = "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    burn += "print('done', flush=True)\nsys.stdin.read()\n"
    throughput.wait_for_workers_to_exit(others=lasting())  # no other child may be reaped in between
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert child.stdout.readline().strip() == b"done"
    assert child.pid in throughput.descendants()
    alive = throughput.cpu_seconds(child.pid)
    rss, private = throughput.memory_mib(child.pid)
    child.communicate(b"")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    exited = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    assert alive >= 0.25
    assert abs(alive - exited) < 0.05  # the clock-tick rounding and the last read
    assert rss > 0 and 0 < private <= rss
    assert throughput.cpu_seconds(child.pid) == 0.0  # gone


def test_openclip_loader_runs_patched_and_restored(shards):
    _, preprocess, _ = open_clip.create_model_and_transforms("ViT-B-16")
    tokenizer = open_clip.get_tokenizer("ViT-B-16")
    openclip_data = data_contestants.openclip_data()
    original = openclip_data.group_by_keys_nothrow
    unpatched, _ = data_contestants.openclip_batches(shards["256px"], preprocess, tokenizer, 8, 0, 0)
    with pytest.raises(KeyError, match="fname"):  # why the patch: webdataset 1.0's end-of-shard marker
        list(unpatched)
    with data_contestants.openclip_patched():
        loader, num_batches = data_contestants.openclip_batches(
            shards["256px"], preprocess, tokenizer, 8, 0, 0
        )
        batches = list(loader)
    assert openclip_data.group_by_keys_nothrow is original
    assert num_batches == len(batches) == 6  # 48 samples, batches of 8: every sample once
    assert all(images.shape == (8, 3, 224, 224) and texts.shape == (8, 77) for images, texts in batches)


def short_run(shards, output, **options):
    """One run of each loader over the fixture's 256-px shards, batches of 8, one worker."""
    root = Path(shards["256px"][0]).parent.parent
    sizes = dict(shards=2, per_shard=24, batch_size=8, workers=[1], repeats=1, warmup=1, kinds=["256px"])
    return data_loader.run_data_benchmark(root, output, floor_samples=8, **sizes, **options)


def test_one_short_run_of_both_loaders(shards, tmp_path):
    """Both loaders on the local files, and (--remote) ours from a loopback S3 server and OpenCLIP's
    through pipe:curl from an HTTP server, each server a process of its own."""
    before = set(throughput.descendants())
    results = short_run(shards, tmp_path / "out", batches=3, remote=True)
    written = json.loads((tmp_path / "out" / "data_loader.json").read_text())
    assert written["summary"] == results["summary"]
    markdown = (tmp_path / "out" / "data_loader.md").read_text()
    assert "| 256px | 1 |" in markdown and "Decode-only floor" in markdown
    assert "From the loopback servers" in markdown
    runs = {run["loader"]: run for run in results["runs"]}
    assert set(runs) == {"ours", "openclip", data_remote.OURS_S3, data_remote.OPENCLIP_PIPE}
    for run in runs.values():
        assert run["samples"] == 3 * 8 and run["workers"] == 1
        assert run["image_shape"] == [8, 3, 224, 224] and run["token_shape"] == [8, 77]
        assert run["cpu_s"] > 0 and run["wall_s"] > 0 and run["worker_peak_rss_mib"] > 0
        assert run["batch_bytes"] > 0
    (row,) = results["summary"]
    assert row["ratio_samples_per_cpu_s"] == pytest.approx(
        runs["ours"]["samples_per_cpu_s"] / runs["openclip"]["samples_per_cpu_s"]
    )
    floor = results["floor"]["256px"]
    assert floor["pil_samples_per_cpu_s"] > 0 and floor["torchvision_samples_per_cpu_s"] > 0
    assert set(floor["stages_ms"]) == {key for key, _ in data_floor.STAGES}
    assert all(ms > 0 for ms in floor["stages_ms"].values())
    assert "Per-sample CPU time by stage" in markdown and "| **ours, all stages** |" in markdown
    # every worker stopped; what stays is our workers' fork server and multiprocessing's resource tracker
    left = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in set(throughput.descendants()) - before]
    assert all(b"forkserver import main" in cmd or b"resource_tracker" in cmd for cmd in left), left


def test_bad_worker_counts_are_refused_before_any_work(tmp_path, capsys):
    argv = ["--data", str(tmp_path / "d"), "--shards", "3", "--workers", "2"]
    assert main(argv) == 2
    assert "--workers [2] must each be >= 1 and divide --shards 3" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
    argv = [
        "--data",
        str(tmp_path / "d"),
        "--shards",
        "2",
        "--per-shard",
        "64",
        "--batches",
        "9",
    ]
    assert main(argv) == 2  # 2 x 64 samples hold 2 batches of 64
    assert "--warmup 5 and --batches 9 must be >= 1 and fit in the 2 full batches" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_device_path_times_the_trainers_input_and_the_device_decode(shards, tmp_path):
    """--device cpu runs what a GPU run times: every batch made into the model's input there, and ours
    with the workers handing over JPEG bytes for the device to decode."""
    results = short_run(shards, tmp_path / "out", batches=2, device="cpu")
    runs = {run["loader"]: run for run in results["runs"]}
    assert set(runs) == {"ours", "openclip", data_loader.DEVICE_DECODE}
    device_decode = runs[data_loader.DEVICE_DECODE]
    assert device_decode["image_dtype"] == "JPEG bytes" and device_decode["image_shape"] == [8]
    # the bytes of 8 JPEGs of the 256-px shards, not 8 decoded 224-px crops
    assert 8 * 1000 < device_decode["batch_bytes"] - 8 * 77 * 8 < 8 * 3 * 224 * 224
    (row,) = results["summary"]
    assert row["device_decode_ratio_samples_per_cpu_s"] == pytest.approx(
        device_decode["samples_per_cpu_s"] / runs["openclip"]["samples_per_cpu_s"]
    )
    markdown = (tmp_path / "out" / "data_loader.md").read_text()
    assert "model input on cpu" in markdown and "Ours with the JPEGs decoded on cpu" in markdown


def test_a_device_this_machine_lacks_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(data_loader.torch.cuda, "is_available", lambda: False)
    assert main(["--data", str(tmp_path / "d"), "--device", "cuda"]) == 2
    assert "--device cuda: torch sees no CUDA GPU here" in capsys.readouterr().err
    assert main(["--data", str(tmp_path / "d"), "--device", "mps"]) == 2
    assert "--device mps: cuda or cpu" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
