"""No sample lost uncounted (docs/data.md, "Corrupt samples"): a shard cut mid-file counts every sample it
did not deliver, by number, however a shard is split between readers; an epoch that lost some says so;
a ``pipe:`` command's failure (a transfer cut by the server: curl's exit 18) is named and its lost
samples counted; a reader that stops early ends its command quietly."""

import http.server
import json
import logging
import shutil
import socket
import tarfile
import threading
from pathlib import Path

import open_clip
import psutil
import pytest
from test_corrupt_data import PREPROCESS, good, index_from_image

from eva_fastclip.data import TrainLoader, write_shard
from eva_fastclip.data.shard_io import CommandFailed
from eva_fastclip.data.tar_reader import SKIP_REASONS, FailureLog, shard_samples

PER_SHARD = 8
CUT_SAMPLE = 2  # the shard "b.tar" ends inside this sample's first member


def inside_first_member(shard: Path, key: str) -> int:
    """A byte in the middle of the data of the first member of sample ``key`` in ``shard``."""
    with tarfile.open(shard) as tar:
        member = next(m for m in tar.getmembers() if m.name.split(".")[0] == key)
    return member.offset_data + member.size // 2


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """Three shards of 8 samples (0-7, 8-15, 16-23) with OpenCLIP's sizes.json; the second one cut short
    in the middle of sample 10's first member, as an interrupted copy leaves it."""
    folder = tmp_path_factory.mktemp("cut")
    for n, name in enumerate("abc"):
        write_shard(folder / f"{name}.tar", [good(i) for i in range(n * PER_SHARD, (n + 1) * PER_SHARD)])
    (folder / "whole").mkdir()
    shutil.copy(folder / "b.tar", folder / "whole" / "b.tar")
    cut = inside_first_member(folder / "b.tar", f"{PER_SHARD + CUT_SAMPLE:03d}")
    with (folder / "b.tar").open("r+b") as stream:
        stream.truncate(cut)
    (folder / "sizes.json").write_text(json.dumps({f"{name}.tar": PER_SHARD for name in "abc"}))
    return folder


LOST = PER_SHARD - CUT_SAMPLE - 1  # the samples after the cut one: 11 to 15
EXPECTED = {reason: 0 for reason in SKIP_REASONS} | {"incomplete": 1, "unread": LOST}


@pytest.mark.parametrize(
    "splits",
    [[(0, None)], [(0, 3), (3, None)], [(0, 1), (1, 2), (2, 5), (5, None)], [(0, 6), (6, None)]],
    ids=["whole", "split-before-the-cut", "split-at-the-cut", "split-after-the-cut"],
)
def test_a_cut_shard_counts_what_it_lost_however_it_is_split(shards, splits):
    """Readers of parts of the cut shard (as consumers of an epoch read it) deliver its samples before
    the cut and together count the cut one as incomplete and each later one as unread, once."""
    failures, delivered = FailureLog(max_in_a_row=100), []
    for first, stop in splits:
        url = str(shards / "b.tar")
        delivered += [s["__key__"] for s in shard_samples(url, failures, first, stop, count=PER_SHARD)]
    assert delivered == [f"{PER_SHARD + i:03d}" for i in range(CUT_SAMPLE)]
    assert dict(zip(SKIP_REASONS, failures.counts)) == EXPECTED


def test_a_shard_cut_at_a_member_boundary_counts_what_its_record_says_it_lacks(shards, tmp_path):
    """A copy cut between two samples reads as a whole tar (tarfile ends it at the missing header, with no
    error): the samples its record counts beyond that end are counted as unread; and a shard holding a
    repeated key (in the record's count, skipped as a duplicate) counts no sample as unread."""
    shard = tmp_path / "b.tar"
    shutil.copy(shards / "whole" / "b.tar", shard)
    with tarfile.open(shard) as tar:
        boundary = next(m for m in tar.getmembers() if m.name.startswith(f"{PER_SHARD + 5:03d}.")).offset
    with shard.open("r+b") as stream:
        stream.truncate(boundary)
    failures = FailureLog(max_in_a_row=100)
    delivered = [s["__key__"] for s in shard_samples(str(shard), failures, count=PER_SHARD)]
    assert len(delivered) == 5
    assert dict(zip(SKIP_REASONS, failures.counts)) == {reason: 0 for reason in SKIP_REASONS} | {"unread": 3}

    write_shard(shard, [good(0), good(1), good(1), good(2)])
    failures = FailureLog(max_in_a_row=100)
    assert [s["__key__"] for s in shard_samples(str(shard), failures, count=4)] == ["000", "001", "002"]
    assert dict(zip(SKIP_REASONS, failures.counts)) == {r: 0 for r in SKIP_REASONS} | {"duplicate_key": 1}


def test_without_a_count_the_loss_is_named_unknown(shards, caplog):
    failures = FailureLog(max_in_a_row=100)
    with caplog.at_level(logging.WARNING):
        assert len(list(shard_samples(str(shards / "b.tar"), failures))) == CUT_SAMPLE
    assert (
        "unreadable from sample 3 on" in caplog.text and "how many samples are lost is unknown" in caplog.text
    )


@pytest.fixture(scope="module")
def tokenize():
    return open_clip.get_tokenizer("ViT-B-32")


@pytest.mark.parametrize("workers", [0, 2])
def test_an_epoch_over_a_cut_shard_reports_the_gap(shards, tokenize, workers, caplog):
    """One epoch of the three shards (24 samples by their record): the 18 it can read are drawn, the
    6 it cannot are counted (1 incomplete, 5 unread), and the end of the epoch says so; the batches'
    places of the lost samples are filled by samples drawn twice."""
    loader = TrainLoader(
        [str(shards / f"{name}.tar") for name in "abc"], preprocess=PREPROCESS, tokenize=tokenize,
        batch_size=4, index_size=3 * PER_SHARD, shuffle_buffer=0, workers=workers,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING):
        drawn = [index_from_image(image) for images, *_ in loader for image in images]
    readable = set(range(3 * PER_SHARD)) - set(range(PER_SHARD + CUT_SAMPLE, 2 * PER_SHARD))
    assert len(drawn) == 3 * PER_SHARD and set(drawn) == readable
    assert loader.skipped_by_reason == EXPECTED
    gap = f"{1 + LOST} skipped this epoch (incomplete 1, unread {LOST})"
    assert gap in caplog.text and "not every sample of its share was drawn once" in caplog.text
    if workers == 0:  # (a worker process logs the shard's own line there)
        assert f"b.tar: samples {CUT_SAMPLE + 1} to {PER_SHARD - 1} unread: after a read error" in caplog.text


class CuttingHandler(http.server.SimpleHTTPRequestHandler):
    """Serves the shards; ``cut_after`` bytes into a file it drops the connection (a lost transfer)."""

    cut_after: int | None = None

    def copyfile(self, source, outputfile):
        if self.cut_after is None:
            return super().copyfile(source, outputfile)
        outputfile.write(source.read(self.cut_after))
        outputfile.flush()
        self.connection.shutdown(socket.SHUT_RDWR)

    def log_message(self, *args):
        pass


@pytest.fixture
def server(shards):
    handler = type("Handler", (CuttingHandler,), {"directory": str(shards / "whole")})
    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), lambda *a: handler(*a, directory=str(shards / "whole"))
    )
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield handler, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_a_failed_pipe_command_is_named_and_its_loss_counted(server, shards, caplog):
    """OpenCLIP's ``pipe:curl`` over a server that drops the connection in the middle of sample 10's
    first member: curl exits 18, which names the read error; what the shard did not deliver is counted
    as for a cut file."""
    handler, address = server
    handler.cut_after = inside_first_member(shards / "whole" / "b.tar", f"{PER_SHARD + CUT_SAMPLE:03d}")
    failures = FailureLog(max_in_a_row=100)
    url = f"pipe:curl -s -f {address}/b.tar"
    with caplog.at_level(logging.WARNING):
        delivered = [s["__key__"] for s in shard_samples(url, failures, count=PER_SHARD)]
    assert len(delivered) == CUT_SAMPLE
    assert dict(zip(SKIP_REASONS, failures.counts)) == EXPECTED
    assert "pipe: command exited with status 18: curl -s -f" in caplog.text
    assert isinstance(CommandFailed("curl", 18), OSError)


def test_a_pipe_read_in_part_ends_its_command_quietly(server, capfd):
    """A reader that needs only the first 2 samples (a consumer's segment, a resume's fast-forward) ends
    the command (curl's 23 on the closed pipe is not a failure), counts nothing and prints nothing."""
    _, address = server
    failures = FailureLog(max_in_a_row=100)
    url = f"pipe:curl -s -f {address}/b.tar --limit-rate 20k"  # still sending when the reader stops
    assert len(list(shard_samples(url, failures, 0, 2, count=PER_SHARD))) == 2
    assert failures.counts == [0] * len(SKIP_REASONS)
    assert not [p for p in psutil.Process().children(recursive=True) if p.name() == "curl"]
    err = capfd.readouterr().err
    assert "Exception ignored" not in err and "GeneratorExit" not in err, err
