"""The front end as a Ray Serve application, called with the official `openai` client: completions
and chat, streamed and not, a stop string, refusals, and a stream closed mid-way cancelling its
generation on the engine's replica. One cluster for the module, in a subprocess of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from tests.api.serve_fake_app import API_KEY
from transfer.connect.rendezvous import free_port

ROOT = Path(__file__).resolve().parents[2]
READY_S = 180.0  # a cold cluster, Serve's controller and proxy, two deployments, on a loaded machine

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.api.byte_tokenizer import save_byte_tokenizer

    folder = save_byte_tokenizer(tmp_path_factory.mktemp("serve_tokenizer"))
    port = free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.api.serve_fake_app", str(port), str(folder)],
        cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = _read_line(proc, READY_S)
        assert line == "READY", f"the server did not start: {line!r}"
        yield proc, f"http://127.0.0.1:{port}/v1"
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _read_line(proc, timeout_s: float) -> str:
    import selectors

    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    if not selector.select(timeout_s):
        return f"(nothing in {timeout_s} s)"
    return proc.stdout.readline().strip()


def record(proc) -> dict:
    proc.stdin.write("record\n")
    proc.stdin.flush()
    return json.loads(_read_line(proc, 30))


def test_the_openai_client_against_ray_serve(server):
    proc, base_url = server
    client = openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["tiny-bytes"]

    whole = client.completions.create(model="tiny-bytes", prompt="hi", max_tokens=10)
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == ("Ça marche", "length")
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (3, 10)

    chunks = list(
        client.completions.create(
            model="tiny-bytes", prompt=[5, 6], max_tokens=60, stop=["STOP"], stream=True,
            stream_options={"include_usage": True}, extra_body={"top_k": 5, "ignore_eos": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == "Ça marche 🙂 " and chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].usage.prompt_tokens == 2 and len(chunks) > 3

    messages = [{"role": "user", "content": "salut"}]
    chat = client.chat.completions.create(model="tiny-bytes", messages=messages, max_completion_tokens=5)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content == "Ça m"
    streamed = list(
        client.chat.completions.create(model="tiny-bytes", messages=messages, max_tokens=10, stream=True)
    )
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == "Ça marche"
    assert streamed[-1].choices[0].finish_reason == "length"

    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny-bytes", prompt="x", max_tokens=1, n=2)
    assert caught.value.status_code == 400 and caught.value.body["param"] == "n"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()

    before = record(proc)
    stream = client.completions.create(model="tiny-bytes", prompt="x", max_tokens=100, stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        after = record(proc)
        new = set(after["started"]) - set(before["started"])
        if new and new <= set(after["cancelled"]):
            break
        time.sleep(0.2)
    assert len(new) == 1 and new <= set(after["cancelled"]) and not new & set(after["finished"])
