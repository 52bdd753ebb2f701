"""Object stores the tests start on the loopback: moto's S3 server (real S3 over HTTP to s3fs and boto3,
nothing patched in-process) and a plain HTTP server, each with faults injected at the server.

Faults (:class:`Faults`), applied to GETs of objects whose key ends with ``suffix``, each at most once per
object and byte range unless it is ``unreachable``:

- ``cut``: the response is sent up to that fraction of its body and the connection dropped;
- ``error``: a 500 in place of the first response;
- ``stall_s``: the first response waits this long before its first byte;
- ``unreachable``: keys (names) whose every GET is a 500;
- ``put_stall_s``: every PUT (an upload) waits this long first.

``served`` counts what was done, for the tests to check that the faults happened."""

from __future__ import annotations

import collections
import http.server
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from moto.server import ThreadedMotoServer
from werkzeug.serving import make_server

BUCKET = "shards"


@dataclass
class Faults:
    suffix: str = ".tar"
    cut: float | None = None
    error: bool = False
    stall_s: float = 0.0
    put_stall_s: float = 0.0  # every PUT (an upload) waits this long first
    unreachable: set[str] = field(default_factory=set)
    served: collections.Counter = field(default_factory=collections.Counter)
    _seen: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def clear(self) -> None:
        self.cut, self.error, self.stall_s, self.put_stall_s = None, False, 0.0, 0.0
        self.unreachable = set()
        self._seen = set()

    def first_get(self, key: str) -> bool:
        """Whether this is the first GET of ``key`` since the faults were set (each is faulted once)."""
        with self._lock:
            first = key not in self._seen
            self._seen.add(key)
            return first

    def wrap(self, app):
        """A WSGI app that serves ``app`` with these faults."""

        def faulty(environ, start_response):
            key = environ.get("PATH_INFO", "")
            if environ["REQUEST_METHOD"] == "PUT" and self.put_stall_s:
                self.served["put_stall"] += 1
                time.sleep(self.put_stall_s)
            if environ["REQUEST_METHOD"] != "GET" or not key.endswith(self.suffix):
                return app(environ, start_response)
            name = key.rsplit("/", 1)[-1]
            if name in self.unreachable:
                self.served["unreachable"] += 1
                start_response("500 Internal Server Error", [("Content-Length", "0")])
                return [b""]
            faulted = f"{key}#{environ.get('HTTP_RANGE', '')}"  # each range of an object faulted once
            if not (self.cut is not None or self.error or self.stall_s) or not self.first_get(faulted):
                return app(environ, start_response)
            if self.stall_s:
                self.served["stall"] += 1
                time.sleep(self.stall_s)
            if self.error:
                self.served["error"] += 1
                start_response("500 Internal Server Error", [("Content-Length", "0")])
                return [b""]
            if self.cut is None:
                return app(environ, start_response)
            self.served["cut"] += 1
            return _cut(app(environ, start_response), self.cut)

        return faulty


def _cut(body, fraction: float):
    """The body's bytes up to ``fraction`` of them, then an error: the server drops the connection."""
    data = b"".join(body)
    yield data[: int(len(data) * fraction)]
    raise ConnectionAbortedError("cut by the test's fault")


class S3Server(ThreadedMotoServer):
    """moto's standalone S3 server on a free loopback port, its app wrapped by :class:`Faults`."""

    def __init__(self) -> None:
        super().__init__(ip_address="127.0.0.1", port=0, verbose=False)
        self.faults = Faults()

    def _server_entry(self) -> None:
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )

        app = self.faults.wrap(DomainDispatcherApplication(create_backend_app))
        self._server = make_server(
            self._ip_address, self._port, app, True, request_handler=MotoRequestHandler
        )
        self._server_ready_event.set()
        self._server.serve_forever()

    @property
    def endpoint(self) -> str:
        host, port = self.get_host_and_port()
        return f"http://{host}:{port}"

    def environment(self) -> dict[str, str]:
        """What a process needs to reach it: the standard AWS variables, nothing of ours."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def upload(self, folder: Path, prefix: str) -> str:
        """Every file of ``folder`` to ``s3://BUCKET/prefix/``; returns that URL."""
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint, **_keys())
        if BUCKET not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
            client.create_bucket(Bucket=BUCKET)
        for path in sorted(Path(folder).iterdir()):
            if path.is_file():
                client.upload_file(str(path), BUCKET, f"{prefix}/{path.name}")
        return f"s3://{BUCKET}/{prefix}"


def _keys() -> dict[str, str]:
    return {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}


def start_s3() -> S3Server:
    """A server, and this process's environment pointed at it (and so the processes it starts)."""
    import s3fs

    server = S3Server()
    server.start()
    os.environ.update(server.environment())
    # fsspec keeps one S3FileSystem per set of arguments for the process's life: one made for an earlier
    # server (another test module's) would still call that server's endpoint
    s3fs.S3FileSystem.clear_instance_cache()
    return server


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """A static file server that answers Range requests (``bytes=a-b``), as any object store does."""

    faults: Faults

    def send_head(self):
        path = Path(self.translate_path(self.path))
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if not path.is_file() or match is None:
            return super().send_head()
        size = path.stat().st_size
        start, end = int(match[1]), min(int(match[2] or size - 1), size - 1)
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        with path.open("rb") as stream:
            stream.seek(start)
            return _Slice(stream.read(end - start + 1))

    def do_GET(self):
        if not self._faulted("GET"):
            super().do_GET()

    def do_HEAD(self):
        if not self._faulted("HEAD"):
            super().do_HEAD()

    def _faulted(self, method: str) -> bool:
        """A 500 in place of the first response of each method for each shard (or every one, for one
        unreachable)."""
        name, faults = self.path.rsplit("/", 1)[-1], self.faults
        if not self.path.endswith(faults.suffix):
            return False
        if name in faults.unreachable or (faults.error and faults.first_get(f"{method} {self.path}")):
            faults.served["error" if method == "GET" else "head_error"] += 1
            self.send_error(500)
            return True
        return False

    def log_message(self, *args):
        pass


class _Slice:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def read(self, *_):
        data, self.data = self.data, b""
        return data

    def close(self):
        pass


def start_http(folder: Path) -> tuple[http.server.ThreadingHTTPServer, Faults]:
    """An HTTP server of ``folder`` on a free loopback port, with its faults."""
    faults = Faults()
    handler = type("Handler", (RangeHandler,), {"faults": faults})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: handler(*a, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, faults


def serve(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.object_store s3|http ROOT [SUBFOLDER ...]``: ROOT served on the loopback by
    a process of its own (a benchmark's CPU counts leave it out), one JSON line on stdout saying where
    (s3: every file of each SUBFOLDER uploaded under ``s3://BUCKET/<SUBFOLDER>/``), until stdin closes."""
    import argparse
    import json
    import sys

    parser = argparse.ArgumentParser(prog="python -m benchmarks.object_store")
    parser.add_argument("kind", choices=["s3", "http"])
    parser.add_argument("root", type=Path)
    parser.add_argument("folders", nargs="*")
    args = parser.parse_args(argv)
    if args.kind == "s3":
        server = start_s3()
        for folder in args.folders:
            server.upload(args.root / folder, folder)
        said = {"environment": server.environment(), "url": f"s3://{BUCKET}"}
    else:
        httpd, _ = start_http(args.root)
        said = {"url": f"http://127.0.0.1:{httpd.server_address[1]}"}
    print(json.dumps(said), flush=True)
    sys.stdin.read()  # until the benchmark ends (closes the pipe)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(serve())
