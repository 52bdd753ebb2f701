"""The loader benchmark's remote contestants (``python -m benchmarks.data_loader --remote``): the same shards
served on the loopback by processes of their own, so that their CPU is not the loaders'.

- **ours_s3**: our loader on ``s3://`` URLs, from moto's S3 server (real S3 over HTTP to s3fs), each
  shard read in range requests (data/remote.py);
- **openclip_pipe**: OpenCLIP's loader on ``pipe:curl -s -f http://...`` URLs, its documented remote form,
  from an HTTP server of the same folder. curl's CPU is counted: the loader workers' reaped children's
  (``/proc``'s cutime and cstime, eva_fastclip/data/throughput.py).

Both are compared with their own loader on the local files, in samples per CPU-second.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

OURS_S3, OPENCLIP_PIPE = "ours_s3", "openclip_pipe"


@contextlib.contextmanager
def remote_servers(root: Path, kinds: list[str]) -> Iterator[dict[str, str]]:
    """The S3 and HTTP servers of ``root`` (each kind's folder uploaded to S3), and this process's
    environment pointed at the S3 server while they run: {"s3": base URL, "http": base URL}."""
    started, said = [], {}
    saved = dict(os.environ)
    # benchmarks/ is found from the repository's root, whatever the folder this runs in
    path = os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    try:
        for kind in ("s3", "http"):
            command = [sys.executable, "-m", "benchmarks.object_store", kind, str(root), *kinds]
            proc = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
            )
            started.append(proc)
            line = json.loads(proc.stdout.readline())
            said[kind] = line["url"]
            os.environ.update(line.get("environment", {}))
        yield said
    finally:
        os.environ.clear()
        os.environ.update(saved)
        for proc in started:
            proc.stdin.close()
            proc.wait(timeout=30)


def remote_urls(paths: dict[str, list[str]], root: Path, servers: dict[str, str]) -> dict[str, dict]:
    """contestant -> kind -> its URLs of the shards ``paths`` (files under ``root``)."""

    def relative(path: str) -> str:
        return Path(path).resolve().relative_to(Path(root).resolve()).as_posix()

    return {
        OURS_S3: {kind: [f"{servers['s3']}/{relative(p)}" for p in ps] for kind, ps in paths.items()},
        OPENCLIP_PIPE: {
            kind: [f"pipe:curl -s -f {servers['http']}/{relative(p)}" for p in ps]
            for kind, ps in paths.items()
        },
    }


def remote_table(summary: list[dict[str, Any]]) -> list[str]:
    """The remote contestants against their loaders on local files, in samples per CPU-second."""
    lines = [
        "",
        "From the loopback servers (their CPU left out), samples per CPU-second:",
        "",
        "| shards | workers | ours local | ours S3 | S3 / local | OpenCLIP local | OpenCLIP pipe:curl | "
        "pipe / local | ours S3 / OpenCLIP pipe |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary:
        cpu = {name: row[name]["samples_per_cpu_s"] for name in ("ours", OURS_S3, "openclip", OPENCLIP_PIPE)}
        lines.append(
            f"| {row['kind']} | {row['workers']} | {cpu['ours']:.0f} | {cpu[OURS_S3]:.0f} | "
            f"**{cpu[OURS_S3] / cpu['ours']:.2f}** | {cpu['openclip']:.0f} | {cpu[OPENCLIP_PIPE]:.0f} | "
            f"{cpu[OPENCLIP_PIPE] / cpu['openclip']:.2f} | {cpu[OURS_S3] / cpu[OPENCLIP_PIPE]:.2f} |"
        )
    return lines
