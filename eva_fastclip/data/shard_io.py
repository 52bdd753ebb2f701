"""A shard's bytes as a stream: a local file, a remote one (data/remote.py), or a ``pipe:`` command's output.

A ``pipe:`` command (OpenCLIP's ``pipe:curl -s URL`` or ``pipe:aws s3 cp URL -``) is run here rather
than through webdataset's ``gopen``, for two reasons:

- its failure is an error of the read that meets it: at the end of its output its exit status is read,
  and a non-zero one (curl's 22 on an HTTP 404, 18 on a cut transfer) is :class:`CommandFailed`, naming
  the command and the status, which the tar reader reports as the cause of the shard's early end
  (:func:`command_failure`) and counts what the shard did not deliver;
- a stream closed before the end (a reader that needed only part of the shard, a resume's fast-forward)
  ends the command itself (SIGTERM): its exit then (curl's 23 on a closed pipe) is ours, not a failure,
  where ``gopen`` raises it from ``close()`` inside a generator's ``GeneratorExit``, and the error is lost.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
from collections.abc import Iterator
from typing import BinaryIO

from .remote import RemoteShard, Retries, is_remote

PIPE_PREFIX = "pipe:"
#: how long a command told to end may take before it is killed
_END_WAIT_S = 5.0
#: how long a command may go on after its output ended (a slow exit: gsutil's) before it is a failure
_STATUS_WAIT_S = 60.0


class CommandFailed(OSError):
    """A ``pipe:`` command that exited with a failure before or at the end of its output."""

    def __init__(self, command: str, status: int) -> None:
        super().__init__(f"pipe: command exited with status {status}: {command}")
        self.command, self.status = command, status

    def __reduce__(self):  # raised in loader workers: pickle rebuilds it from these, not from args
        return type(self), (self.command, self.status)


class CommandOutput(io.RawIOBase):
    """A shell command's standard output, read once to its end; its exit status checked there."""

    def __init__(self, command: str) -> None:
        self.command = command
        # a session of its own: a pipeline's every process is ended with it (terminate() reaches the shell)
        self.proc = subprocess.Popen(
            command, shell=True, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True
        )

    def readable(self) -> bool:
        return True

    failure: CommandFailed | None = None  # set at the end of its output when it failed

    def readinto(self, buffer) -> int:
        got = self.proc.stdout.readinto(buffer)
        if not got and len(buffer) and self._status() != 0:  # the end of its output: did it succeed?
            # an end of data to the reader (raised here, the bytes of this read would be dropped by the
            # buffered reader); the tar reader asks command_failure() why its data ended
            self.failure = CommandFailed(self.command, self.proc.returncode)
        return got

    def _status(self) -> int:
        """The exit status, once its output ended (a command that lingers after it: ended, a failure)."""
        try:
            return self.proc.wait(_STATUS_WAIT_S)
        except subprocess.TimeoutExpired:
            self._end(signal.SIGKILL)
            return self.proc.wait()

    def _end(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def close(self) -> None:
        if self.closed:
            return
        if self.proc.poll() is None:  # closed before its end: ended by us, its status is not a failure
            self._end(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(_END_WAIT_S)
            if self.proc.poll() is None:
                self._end(signal.SIGKILL)
                self.proc.wait()
        self.proc.stdout.close()
        super().close()


def command_failure(stream: BinaryIO | None) -> CommandFailed | None:
    """How the ``pipe:`` command behind ``stream`` failed, once its output ended; else None."""
    return getattr(getattr(stream, "raw", None), "failure", None)


@contextlib.contextmanager
def open_shard(url: str, retries: Retries | None = None) -> Iterator[BinaryIO]:
    """The shard at ``url`` as a binary stream, read front to back; a remote one's requests retried."""
    if url.startswith(PIPE_PREFIX):
        stream: BinaryIO = io.BufferedReader(CommandOutput(url[len(PIPE_PREFIX) :]), 1 << 20)
    elif is_remote(url):
        stream = RemoteShard(url, retries or Retries())  # (holds a chunk already: no buffer of its own)
    else:
        stream = open(url.removeprefix("file://"), "rb")  # noqa: SIM115 (closed below)
    try:
        yield stream
    finally:
        stream.close()
