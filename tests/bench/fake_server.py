"""The front end over the fake engine on a real socket (uvicorn, no Ray), for the benchmark's tests:
in a thread of the test process, or as a process standing in for `distpool serve`:

    python -m tests.bench.fake_server [--step-delay S] [--exit-status N] --port P

which serves until SIGTERM or SIGINT, then exits with status N (0)."""

from __future__ import annotations

import argparse
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from distpool.api.app import build_app
from distpool.api.engine import ModelCard
from distpool.api.settings import ApiSettings
from tests.api.byte_tokenizer import EOS_ID, VOCAB_SIZE
from tests.api.fake_engine import FakeEngine

CONTEXT_LEN = 16384


def fake_engine(tokenizer_folder: str | None = None, step_delay_s: float = 0.002) -> FakeEngine:
    """Without a tokenizer (as the synthetic model) its streams carry token ids; with the byte
    tokenizer, text, and chat works."""
    card = ModelCard(
        served_name="fake-model",
        context_len=CONTEXT_LEN,
        vocab_size=VOCAB_SIZE,
        eos_token_ids=(EOS_ID,),
        tokenizer_folder=tokenizer_folder,
    )
    return FakeEngine(card, first_delay_s=0.005, step_delay_s=step_delay_s)


@contextmanager
def serving_in_thread(engine: FakeEngine) -> Iterator[str]:
    """The app over `engine` on a free port of 127.0.0.1; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(build_app(engine, ApiSettings()), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the fake server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--step-delay", type=float, default=0.002)
    parser.add_argument("--exit-status", type=int, default=0)
    ns = parser.parse_args()
    engine = fake_engine(step_delay_s=ns.step_delay)
    uvicorn.run(build_app(engine, ApiSettings()), host="127.0.0.1", port=ns.port, log_level="warning")
    print(f"served {len(engine.finished)} requests", flush=True)
    return ns.exit_status


if __name__ == "__main__":
    raise SystemExit(main())
