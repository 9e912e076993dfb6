"""`distpool serve` end to end: one server (1P1D, transformers' modeling code on a tiny Bamba checkpoint
with a word-level tokenizer and a chat template, float64) started as the command a user runs, in a Ray
cluster of its own, and the official `openai` client against it. Greedy tokens equal transformers'
`generate`; a seed repeats its tokens; stop ids, stop strings, EOS and max_tokens end with their
finish_reason; 32 concurrent streams finish; bad requests get their status while others stream;
streams closed mid-way leave nothing held; SIGTERM drains and exits 0 (the module's last test)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError, OpenAI
from transformers import AutoTokenizer

from tests.hf_checkpoints import WORDS, generate, load_for_generate, save_checkpoint, save_tokenizer

pytestmark = pytest.mark.ray

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}sky{% endif %}"
)
PROMPT = [1, 5, 9, 14, 3, 22, 7, 30, 11]  # <s> and eight words
MAX_TOKENS = 12
START_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_checkpoint(folder: Path) -> tuple[Path, list[int], int]:
    """The checkpoint, generate's greedy reply to PROMPT, and the EOS id chosen: a token of that reply
    (not its first three), so that a request without ignore_eos stops there."""
    save_checkpoint("bamba", folder, seed=3)
    save_tokenizer(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    reply = generate(load_for_generate(folder), PROMPT, MAX_TOKENS)
    eos = next(t for i, t in enumerate(reply) if i >= 3 and t not in reply[:i])
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if path.exists():
            data = json.loads(path.read_text())
            data["eos_token_id"] = eos
            path.write_text(json.dumps(data))
    return folder, reply, eos


class Server:
    def __init__(self, folder: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "distpool", "serve", "--model", str(folder)]
        cmd += ["--model-impl", "transformers", "--dtype", "float64", "--page-size", "4"]
        cmd += ["--context-len", "256", "--memory-gib", "0.03125", "--port", str(self.port)]
        cmd += ["--served-model-name", "tiny", "--drain-timeout", "20", "--num-cpus", "4"]
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(START_TIMEOUT_S):
            self.stop()
            raise AssertionError("distpool serve did not start:\n" + "".join(self.lines[-30:]))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if "distpool: serving" in line:
                self.ready.set()
        self.ready.set()  # it ended: the start failed

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder, reply, eos = make_checkpoint(tmp_path_factory.mktemp("served") / "tiny-bamba")
    server = Server(folder)
    yield server, folder, reply, eos
    server.stop()


@pytest.fixture(scope="module")
def client(served) -> OpenAI:
    return OpenAI(base_url=served[0].base + "/v1", api_key="none", max_retries=0)


def completion_ids(client: OpenAI, **kwargs) -> tuple[list[int], str]:
    """(token ids, finish_reason) of one completion: the ids from the stream's chunks in order."""
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    kwargs["extra_body"] = {**kwargs.get("extra_body", {}), "return_token_ids": True}
    stream = client.completions.create(model="tiny", prompt=PROMPT, stream=True, **kwargs)
    ids, finish, chunks = [], None, 0
    for chunk in stream:
        for choice in chunk.choices:
            ids += choice.model_extra.get("token_ids") or []
            finish = choice.finish_reason or finish
            chunks += 1
    return ids, finish


def test_greedy_streamed_and_whole_equal_generate(served, client):
    server, folder, reply, eos = served
    expected = reply[: reply.index(eos) + 1]  # it stops at the checkpoint's EOS, which is kept in ids
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS)
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage.prompt_tokens == len(PROMPT) and whole.usage.completion_tokens == len(expected)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert whole.choices[0].text == tokenizer.decode(expected[:-1], skip_special_tokens=True)
    ids, finish = completion_ids(client, extra_body={"ignore_eos": True})
    assert (ids, finish) == (reply, "length")


def test_chat_renders_the_template_and_streams(served, client):
    messages = [{"role": "user", "content": "the cat sat on the mat"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6)
    streamed = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert whole.choices[0].message.content == text
    rendered = AutoTokenizer.from_pretrained(served[1]).apply_chat_template(
        messages, add_generation_prompt=True
    )
    assert whole.usage.prompt_tokens == len("the cat sat on the mat".split()) + 1  # ... sky
    assert whole.usage.prompt_tokens == len(rendered if isinstance(rendered, list) else rendered["input_ids"])


def test_seed_repeats_its_tokens_and_stop_rules_end_requests(served, client):
    server, folder, reply, eos = served
    sampled = [
        completion_ids(client, temperature=1.0, seed=11, extra_body={"ignore_eos": True}) for _ in range(2)
    ]
    assert sampled[0] == sampled[1] and len(sampled[0][0]) == MAX_TOKENS
    stop_id = reply[1]
    ids, finish = completion_ids(client, extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    assert (ids, finish) == (reply[:2], "stop")
    ids, finish = completion_ids(client, max_tokens=2, extra_body={"ignore_eos": True})
    assert (ids, finish) == (reply[:2], "length")
    # A stop string: a word of the reply after its first; the text ends before it.
    word = next(WORDS[t - 2] for t in reply[1:] if 2 <= t < len(WORDS) + 2)
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, stop=[word], extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "stop" and word not in out.choices[0].text.split()
    assert out.usage.completion_tokens < MAX_TOKENS


def test_bad_requests_get_their_status_while_others_stream(served, client):
    server = served[0]

    async def main():
        good = AsyncOpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)
        streams = [
            good.completions.create(
                model="tiny",
                prompt=PROMPT,
                max_tokens=MAX_TOKENS,
                stream=True,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            for _ in range(4)
        ]

        async def read(create):  # token ids of a streamed completion
            ids = []
            async for chunk in await create:
                for choice in chunk.choices:
                    ids += choice.model_extra.get("token_ids") or []
            return ids

        async with httpx.AsyncClient(base_url=server.base) as http:
            bad = [
                http.post("/v1/completions", content=b"{not json"),
                http.post("/v1/completions", json={"model": "tiny", "prompt": [1, 99999], "max_tokens": 2}),
                http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT * 40, "max_tokens": 2}),
                http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "n": 3}),
            ]
            return await asyncio.gather(*(read(s) for s in streams)), await asyncio.gather(*bad)

    replies, answers = asyncio.run(main())
    assert all(ids == served[2] for ids in replies), (replies, served[2])
    assert [a.status_code for a in answers] == [400, 400, 400, 400]
    assert all(set(a.json()["error"]) == {"message", "type", "param", "code"} for a in answers)
    with pytest.raises(BadRequestError):
        client.completions.create(model="tiny", prompt=[1, 64], max_tokens=2)


def test_32_concurrent_streams_finish_and_20_closed_streams_free_their_requests(served):
    server, reply = served[0], served[2]

    async def main():
        client = AsyncOpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)

        async def read(max_tokens: int, close_after: int | None = None) -> list[int]:
            ids = []
            stream = await client.completions.create(
                model="tiny",
                prompt=PROMPT,
                max_tokens=max_tokens,
                stream=True,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            async for chunk in stream:
                for choice in chunk.choices:
                    ids += choice.model_extra.get("token_ids") or []
                if close_after is not None and len(ids) >= close_after:
                    await stream.close()  # the client leaves mid-way
                    break
            return ids

        full = await asyncio.gather(*(read(MAX_TOKENS) for _ in range(32)))
        closed = await asyncio.gather(*(read(240, close_after=1) for _ in range(20)))
        return full, closed

    full, closed = asyncio.run(main())
    assert all(ids == reply for ids in full)
    assert all(1 <= len(ids) < 240 for ids in closed)


def test_bench_serve_against_the_live_server_at_two_rates(served, tmp_path):
    """`distpool bench serve` (issue 37) against this server: its JSON's figures agree with each other."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "distpool", "bench", "serve", "--base-url", served[0].base]
    cmd += ["--request-rate", "4,inf", "--num-prompts", "6", "--dataset", "random", "--input-len", "12"]
    cmd += ["--output-len", "4", "--vocab-size", "64", "--goodput", "ttft:5000", "tpot:2000"]
    cmd += ["--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert [run["request_rate"] for run in runs] == [4, "inf"]
    for run in runs:
        assert run["completed"] == 6 and run["failed"] == 0
        for name in ("ttft", "tpot", "itl", "e2el"):
            assert run[f"median_{name}_ms"] <= run[f"p99_{name}_ms"]
        assert run["request_goodput"] <= run["request_throughput"] + 1e-9
        assert 0.0 <= run["slo_attainment"] <= 1.0
        assert run["total_output_tokens"] == 6 * 4


def test_sigterm_drains_and_exits_0_with_nothing_leaked(served, client):
    """Last: a stream running when SIGTERM comes finishes; the summary counts the 20 cancelled
    streams above and finds no page or slot held once the prefix caches are dropped."""
    server = served[0]
    result: dict = {}

    def long_stream():
        result["ids"], result["finish"] = completion_ids(
            client, max_tokens=60, extra_body={"ignore_eos": True}
        )

    reader = threading.Thread(target=long_stream)
    reader.start()
    time.sleep(1.0)
    server.proc.send_signal(signal.SIGTERM)
    reader.join(60)
    assert server.proc.wait(90) == 0, "".join(server.lines[-20:])
    assert result.get("finish") == "length" and len(result["ids"]) == 60
    summary = next(line for line in server.lines if line.startswith("distpool: served"))
    assert "leaked 0 pages, 0 slots" in summary
    cancelled = int(summary.split("cancelled ")[1].split(",")[0])
    assert cancelled >= 20, summary
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.base + "/health", timeout=2)
