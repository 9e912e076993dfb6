"""A server started for the benchmark: `distpool serve DEPLOYMENT_FLAGS --port P` (or another command
that takes `--port`) as a subprocess, waited for until GET /health answers 200, stopped with SIGTERM
after the runs and expected to drain and exit 0."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

DISTPOOL_SERVE = (sys.executable, "-m", "distpool", "serve")
HOST = "127.0.0.1"
POLL_S = 0.5
PROGRESS_EVERY_S = 10.0
LOG_TAIL_CHARS = 3000
FLAGS_THE_BENCH_SETS = ("--port", "--host")


class LaunchError(RuntimeError):
    """The launched server did not come up, or did not stop as asked; the message holds its log's end."""


def deployment_flags(*texts: str) -> list[str]:
    """Shell-style flag strings (--launch-args, then a deployment's own) as one argument list;
    ValueError for what the bench sets itself."""
    flags = [flag for text in texts for flag in shlex.split(text)]
    for flag in flags:
        if flag.split("=", 1)[0] in FLAGS_THE_BENCH_SETS:
            raise ValueError(
                f"{flag.split('=', 1)[0]} is chosen by the benchmark for the server it launches "
                f"({HOST}, a free port). Fix: drop it from the deployment flags"
            )
    return flags


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def launched_server(
    flags: list[str],
    *,
    command: tuple[str, ...] | None = None,
    start_timeout_s: float = 900.0,
    stop_timeout_s: float = 300.0,
    progress: Callable[[str], None] = print,
) -> Iterator[str]:
    """Start `command + flags + --port P`, yield its base URL once /health answers 200, then SIGTERM
    it and wait for exit status 0. LaunchError when it exits early, misses the deadline, or stops
    badly (unless the body raised already: that error is the one that counts). `command`: None for
    DISTPOOL_SERVE."""
    port = free_port()
    argv = [*(DISTPOOL_SERVE if command is None else command), *flags, "--port", str(port)]
    base_url = f"http://{HOST}:{port}"
    with tempfile.TemporaryDirectory(prefix="distpool-bench-") as folder:
        log_path = Path(folder) / "server.log"
        with log_path.open("wb") as log:
            progress(f"launching: {shlex.join(argv)}")
            server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                _wait_healthy(server, base_url, start_timeout_s, log_path, progress)
            except BaseException:
                _kill(server)
                raise
            body_failed = True
            try:
                yield base_url
                body_failed = False
            finally:
                _stop(server, stop_timeout_s, log_path, quiet=body_failed)
                if not body_failed:  # its last line: `distpool serve`'s summary of what it served
                    last = _tail(log_path).strip().splitlines()[-1:] or [""]
                    progress(f"server stopped, exit status 0: {last[0]}")


def _wait_healthy(
    server: subprocess.Popen, base_url: str, timeout_s: float, log_path: Path, progress
) -> None:
    start = time.monotonic()
    next_note = start + PROGRESS_EVERY_S
    with httpx.Client(timeout=5.0) as http:
        while True:
            if server.poll() is not None:
                raise LaunchError(
                    f"the server exited with status {server.returncode} before answering:\n{_tail(log_path)}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if http.get(f"{base_url}/health").status_code == 200:
                    progress(f"server ready at {base_url} after {time.monotonic() - start:.0f} s")
                    return
            now = time.monotonic()
            if now - start > timeout_s:
                raise LaunchError(
                    f"the server did not answer GET {base_url}/health with 200 within {timeout_s:g} s "
                    f"(raise --launch-timeout if it is still loading):\n{_tail(log_path)}"
                )
            if now >= next_note:
                progress(f"waiting for {base_url}/health: {now - start:.0f} s of {timeout_s:g} s")
                next_note = now + PROGRESS_EVERY_S
            time.sleep(POLL_S)


def _stop(server: subprocess.Popen, timeout_s: float, log_path: Path, quiet: bool) -> None:
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
    try:
        status = server.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill(server)
        if not quiet:
            raise LaunchError(
                f"the server did not exit within {timeout_s:g} s of SIGTERM; killed:\n{_tail(log_path)}"
            ) from None
        return
    if status != 0 and not quiet:
        raise LaunchError(f"the server exited with status {status} after SIGTERM:\n{_tail(log_path)}")


def _kill(server: subprocess.Popen) -> None:
    """SIGKILL the server's process group (its own session: the server and the workers it started)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)
    server.wait()


def _tail(log_path: Path) -> str:
    text = log_path.read_bytes()[-LOG_TAIL_CHARS:].decode(errors="replace")
    return text or "(the server printed nothing)"
