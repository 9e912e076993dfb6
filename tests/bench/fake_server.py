"""The front end over the fake engine on a real socket (uvicorn in a thread of the test process, no
Ray), for the benchmark's tests."""

from __future__ import annotations

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
def serving_in_thread(engine: FakeEngine, port: int = 0) -> Iterator[str]:
    """The app over `engine` on `port` of 127.0.0.1 (0: a free one); yields its base URL. In a thread,
    uvicorn leaves the process's signals alone."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
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
