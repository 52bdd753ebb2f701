"""What a rank's set-up decides with the other ranks or for its process (tests/test_engine_setup.py has the
rest): the precision every rank agrees on, the host memory a CPU rank keeps, and the plan's error every
rank reads; pieces of the session's 2-rank suite."""

import ctypes
import json
import os

import pytest
import torch
import torch.distributed as dist

from eva_fastclip.plan.precision import Hardware, common_hardware
from eva_fastclip.reliability.process import keep_freed_host_memory

TWO_RANK_PIECES = ("host_memory", "hardware", "preflight_error")


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost")]  # fmt: skip


def _has_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


def mmapped_by_a_large_block() -> int:
    """Bytes glibc maps afresh (its own accounting, ``hblkhd``) for a 64 MiB block, above the largest
    mmap threshold glibc accepts."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    before = libc.mallinfo2().hblkhd
    block = torch.ones(16 * 2**20)
    grown = libc.mallinfo2().hblkhd - before
    del block
    return grown


def large_blocks(out):
    """Rank 0 of the 2-rank suite, before the ranks join the process group (which keeps freed memory):
    a large block with glibc's default settings, then after keep_freed_host_memory."""
    if int(os.environ["RANK"]) != 0 or not _has_mallinfo2():
        return
    default = mmapped_by_a_large_block()
    assert keep_freed_host_memory()
    keep = mmapped_by_a_large_block()
    (out / "mmapped.json").write_text(json.dumps({"default": default, "keep": keep}))


@pytest.mark.skipif(not _has_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
def test_large_blocks_come_from_the_heap_not_fresh_mmaps(two_rank_suite):
    """What keep_freed_host_memory controls: a large block (a step's gradient buffers) is carved from the
    heap, which is never trimmed, instead of a fresh mmap that free() unmaps at once, so the next step
    reuses its pages instead of faulting them in again. Checked through glibc's own accounting of mmapped
    bytes (deterministic), not through page-fault counts: where glibc places a reused block, and so how
    many faults a given allocation takes, differs between machines. Measured in a rank whose malloc
    nothing has set yet (large_blocks)."""
    mmapped = json.loads((two_rank_suite("host_memory") / "mmapped.json").read_text())
    assert mmapped["default"] >= 64 * 2**20  # glibc's default: the block is a fresh mapping
    assert mmapped["keep"] == 0


def agree_on_hardware(out):
    """Every rank of the 2-rank suite: rank 0's CPU has native bf16, rank 1's has not."""
    rank = dist.get_rank()
    mine = Hardware(cuda=False, native_bf16=rank == 0, description=f"CPU of rank {rank}")
    agreed = common_hardware(mine)
    (out / f"{rank}.json").write_text(json.dumps([agreed.native_bf16, agreed.description]))


def test_ranks_on_different_cpus_agree_on_one_precision(two_rank_suite):
    """A rank whose CPU has native bf16 must not pick bf16 while another rank's CPU would pick fp32."""
    out = two_rank_suite("hardware")
    results = [json.loads((out / f"{rank}.json").read_text()) for rank in (0, 1)]
    assert [native for native, _ in results] == [False, False]
    assert "another rank runs on CPU of rank 1" in results[0][1]


#: remote shards that record no size: rank 0's plan stops the run (FORMATS.md: a URL is read only in training)
#: OpenCLIP's remote shards: a command's output, which no record beside it counts
REMOTE_SHARDS = "pipe:curl -s https://host/x/shard-{000000..000003}.tar"


def preflight_error(out):
    """Every rank of the 2-rank suite: ``eva-fastclip train`` on remote shards without data.num_samples,
    as a user runs it; what it prints on stderr, and its exit code. The plan is made by rank 0, whose
    error reaches rank 1 pickled (reliability/process.py's on_rank0)."""
    import contextlib
    import io

    from eva_fastclip.cli import main

    sets = [f'data.train_shards=["{REMOTE_SHARDS}"]', "eval.zeroshot_dir=null", "eval.retrieval_shards=null"]
    sets += [f"train.output_dir={out / 'run'}", "data.workers=0"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["train", "--config", "configs/toy.json", *(a for s in sets for a in ("--set", s))])
    (out / f"{dist.get_rank()}.json").write_text(json.dumps({"code": code, "stderr": err.getvalue()}))


def test_a_plan_error_prints_the_same_readable_list_on_every_rank(two_rank_suite):
    """Rank 1 used to print "260 problem(s) before step 1" and the message one character per line: the
    PreflightError it got was rebuilt by pickle from the message, not the list."""
    out = two_rank_suite("preflight_error")
    printed = [json.loads((out / f"{rank}.json").read_text()) for rank in (0, 1)]
    assert [p["code"] for p in printed] == [2, 2]
    lines = [p["stderr"].strip().splitlines() for p in printed]
    assert lines[0] == lines[1]
    assert lines[0][0] == "eva-fastclip train: error: 1 problem(s) before step 1:"
    assert lines[0][1].startswith(
        "  - data.num_samples: cannot tell how many samples the shards hold: pipe:curl -s https://host/x/"
    )
    assert len(lines[0]) == 2
