"""Shards read where the data lives (data/remote.py), from servers this test starts on the loopback: moto's
S3 server, spoken to over HTTP by s3fs, and a plain HTTP server. Sources expand and their records are read
from the remote as from a folder; an epoch read from there is the local epoch, batch for batch, even when the
server cuts every shard's first transfer, answers 500 or stalls; a shard that stays unreachable stops the
read naming the shard and the byte; a missing shard is found before any read."""

import logging
import shutil
import time

import pytest
import torch
from test_data import PREPROCESS, check_batch, make_indexed_shards

from benchmarks.object_store import BUCKET, start_http, start_s3
from eva_fastclip.data import TrainLoader, expand_urls, resolve_sizes
from eva_fastclip.data.remote import RemoteShard, Retries, ShardUnreachable

FAST = Retries(tries=3, wait_s=0.05)


@pytest.fixture(scope="module")
def s3():
    server = start_s3()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """12 samples in 3 shards of 4, with our manifest.json."""
    return make_indexed_shards(tmp_path_factory.mktemp("local"), count=12, per_shard=4)


@pytest.fixture(scope="module")
def remote(s3, local):
    return s3.upload(local, "toy")


@pytest.fixture(autouse=True)
def no_faults(s3):
    s3.faults.clear()
    s3.faults.served.clear()


@pytest.fixture(scope="module")
def tokenize():
    import open_clip

    return open_clip.get_tokenizer("ViT-B-32")


def test_sources_expand_and_count_as_local_ones(remote, local, tmp_path, s3):
    names = [f"{remote}/shard-00000{i}.tar" for i in range(3)]
    assert expand_urls(remote) == names  # a folder: the shards its manifest lists
    assert expand_urls(f"{remote}/shard-{{000000..000002}}.tar") == names
    assert expand_urls(f"{names[2]}::{remote}/shard-00000{{0,1}}.tar") == [names[2], *names[:2]]
    assert resolve_sizes(names) == resolve_sizes([str(local / f"shard-00000{i}.tar") for i in range(3)])
    assert resolve_sizes(names).shard_counts == (4, 4, 4)
    with pytest.raises(FileNotFoundError, match=r"1 of 4 shards do not exist \(first: s3://.*003.tar\)"):
        expand_urls(f"{remote}/shard-{{000000..000003}}.tar")

    # OpenCLIP's sizes.json and a folder of *.tar without our manifest
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in names:
        shutil.copy(local / name.rsplit("/", 1)[1], plain)
    (plain / "sizes.json").write_text('{"shard-000000.tar": 4, "shard-000001.tar": 4, "shard-000002.tar": 4}')
    url = s3.upload(plain, "plain")
    assert expand_urls(url) == [n.replace("/toy/", "/plain/") for n in names]
    sizes = resolve_sizes(expand_urls(url), needs_index=False)
    assert (sizes.num_samples, sizes.num_samples_from, sizes.shard_counts) == (12, "sizes.json", (4, 4, 4))


def epoch(sources, tokenize, workers: int) -> list[tuple[list[int], torch.Tensor]]:
    loader = TrainLoader(
        sources, preprocess=PREPROCESS, tokenize=tokenize, batch_size=4, shuffle_buffer=3, workers=workers,
        retries=FAST,
    )  # fmt: skip
    return [(check_batch(batch, tokenize, 4), batch[0]) for batch in loader]


@pytest.fixture(scope="module")
def local_epoch(local, tokenize):
    return epoch([str(local)], tokenize, workers=2)


@pytest.mark.parametrize("fault", ["none", "cut", "error", "stall"])
def test_an_epoch_from_s3_is_the_local_epoch(remote, local_epoch, tokenize, s3, fault):
    """The same batches, images bit for bit, with 2 loader workers; with the server cutting each shard's
    first transfer halfway, or answering it with a 500, or stalling it 1 s (a hiccup, under the read
    timeout), nothing is lost or repeated."""
    expected = local_epoch
    if fault == "cut":
        s3.faults.cut = 0.5
    elif fault == "error":
        s3.faults.error = True
    elif fault == "stall":
        s3.faults.stall_s = 1.0
    got = epoch([remote], tokenize, workers=2)
    assert [indices for indices, _ in got] == [indices for indices, _ in expected]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, expected))
    if fault != "none":
        assert s3.faults.served[fault] == 3  # each shard's first GET


def test_every_range_request_cut_once_still_gives_the_shard(remote, s3, local, caplog):
    """Chunks of 1 KiB (range requests), each range's first transfer cut at 30%: the shard's bytes come
    whole, each retry logged with the shard and the byte it starts from."""
    s3.faults.cut = 0.3
    url = f"{remote}/shard-000001.tar"
    shard = RemoteShard(url, Retries(tries=2, wait_s=0.0), chunk_bytes=1024)
    with caplog.at_level(logging.WARNING, logger="eva_fastclip.data.remote"):
        data = b""
        while chunk := shard.read(4096):
            data += chunk
    whole = (local / "shard-000001.tar").read_bytes()
    assert data == whole and shard.size == len(whole)
    chunks = -(-len(whole) // 1024)
    assert s3.faults.served["cut"] == chunks  # every chunk cut once, and read again from its first byte
    for start in range(0, len(whole), 1024):
        assert f"{url} at byte {start}: " in caplog.text
    assert "retry 1 of 2" in caplog.text


def test_a_shard_that_stays_unreachable_is_named_with_its_byte(remote, s3, tokenize):
    """Every GET of one shard answered 500: once the retries are spent the epoch stops with the shard, the
    byte and the error, through a loader worker (the exception crosses the process boundary whole)."""
    s3.faults.unreachable = {"shard-000002.tar"}
    started = time.monotonic()
    with pytest.raises(ShardUnreachable, match=r"shard-000002.tar at byte 0: .*after 3 retries"):
        epoch([remote], tokenize, workers=2)
    print(f"the unreachable shard stopped the epoch {time.monotonic() - started:.1f} s after it began")


def test_http_shards_read_by_range(local, tokenize, tmp_path):
    """A plain HTTP server (ranges answered, as object stores answer them), its first HEAD and first GET
    of each shard a 500 (fsspec reports a size request's failure as FileNotFoundError: retried, not taken
    for a missing shard): the shards are found and the epoch is the local one."""
    server, faults = start_http(local)
    try:
        faults.error = True
        address = f"http://127.0.0.1:{server.server_address[1]}"
        urls = f"{address}/shard-{{000000..000002}}.tar"
        assert resolve_sizes(expand_urls(urls)).shard_counts == (4, 4, 4)
        got = epoch([urls], tokenize, workers=0)
        assert [i for i, _ in got] == [i for i, _ in epoch([str(local)], tokenize, workers=0)]
        assert faults.served["error"] == 3 and faults.served["head_error"] == 3
    finally:
        server.shutdown()


def test_the_bucket_is_where_the_test_put_it(s3, remote):
    assert remote == f"s3://{BUCKET}/toy"


def test_a_shard_gone_since_the_listing_stops_the_read(remote, caplog):
    """No wait makes a missing object come back (nor a denied one): not retried, and not counted as a
    shard's lost samples either, since every shard after it would meet the same: the run stops."""
    with (
        caplog.at_level(logging.WARNING, logger="eva_fastclip.data.remote"),
        pytest.raises(ShardUnreachable, match=r"shard-000009.tar: its size: FileNotFoundError.*not retried"),
    ):
        RemoteShard(f"{remote}/shard-000009.tar", FAST)
    assert "retry" not in caplog.text
