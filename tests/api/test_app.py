"""The front end's app over a fake engine, in process (no Ray): OpenAI's shapes, streaming as tokens
come, stop strings, errors in OpenAI's shape, the API key, the waiting limit, and cancellation of a
generation whose client has gone."""

from __future__ import annotations

import asyncio

import pytest

from distpool.api.app import build_app
from distpool.api.engine import Engine, GenerationArgs, ModelCard, WorkerHealth
from distpool.api.settings import ApiSettings
from distpool.api.stream.sse import parse_sse
from tests.api.asgi_calls import client, raw_call, wait_until
from tests.api.byte_tokenizer import BOS_ID, EOS_ID, VOCAB_SIZE, byte_ids
from tests.api.fake_engine import FakeEngine

REPLY = "héllo, wörld 🙂 STOP never shown"


def text_reply(text: str):
    return lambda prompt_ids, args: byte_ids(text)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, timeout=30))


def serve(engine: FakeEngine, **settings):
    return build_app(engine, ApiSettings(**settings))


async def post(app, path: str, payload, **kwargs):
    async with client(app, kwargs.pop("api_key", None)) as http:
        if isinstance(payload, bytes):
            return await http.post(path, content=payload, **kwargs)
        return await http.post(path, json=payload, **kwargs)


def assert_error(response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "Traceback" not in response.text
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def stream_events(response) -> list:
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.content)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


def test_the_fake_engine_is_an_engine(card):
    assert isinstance(FakeEngine(card), Engine)  # the protocol's methods, as the real engine must have them


# --- completions ---------------------------------------------------------------------------------


def test_a_completion_returns_the_text_its_finish_reason_and_usage(card):
    engine = FakeEngine(card, text_reply("héllo"))
    response = run(post(serve(engine), "/v1/completions", {"prompt": "ab", "max_tokens": 6}))
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny-bytes"
    assert body["choices"] == [{"index": 0, "text": "héllo", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    (request_id,) = engine.started
    assert engine.args[request_id] == GenerationArgs(max_tokens=6)
    assert engine.prompts[request_id] == (BOS_ID, *byte_ids("ab"))  # text: the tokenizer's BOS first
    assert engine.finished == [request_id] and engine.cancelled == []


def test_a_streamed_completion_sends_text_as_tokens_come_then_usage_and_done(card):
    engine = FakeEngine(card, text_reply("héllo 🙂!"))
    payload = {"prompt": [5, 6], "max_tokens": 12, "stream": True, "stream_options": {"include_usage": True}}
    events = stream_events(run(post(serve(engine), "/v1/completions", payload)))
    *chunks, usage = events
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 12,
        "total_tokens": 14,
    }
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == "héllo 🙂!"
    assert all("\ufffd" not in t for t in texts)  # a character's bytes never split across chunks
    assert len(chunks) >= 5  # one event per token, a few ms apart: many chunks, not one at the end
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert {c["id"] for c in chunks} == {usage["id"]} and all(
        c["object"] == "text_completion" for c in chunks
    )


def test_a_stop_string_ends_the_request_at_once_and_is_not_returned(card):
    engine = FakeEngine(card, text_reply(REPLY))
    for stream in (False, True):
        payload = {"prompt": "x", "max_tokens": 40, "stop": ["ST", "STOP"], "stream": stream}
        response = run(post(serve(engine), "/v1/completions", payload))
        if stream:
            chunks = stream_events(response)
            text = "".join(c["choices"][0]["text"] for c in chunks)
            reason = chunks[-1]["choices"][0]["finish_reason"]
        else:
            (choice,) = response.json()["choices"]
            text, reason = choice["text"], choice["finish_reason"]
        assert (text, reason) == ("héllo, wörld 🙂 ", "stop")
    assert len(engine.aborted) == 2 and engine.aborted == engine.started
    stop_at = len(byte_ids("héllo, wörld 🙂 ST"))
    assert all(engine.events_sent[rid] <= stop_at + 1 for rid in engine.started)  # not run to max_tokens


def test_eos_ends_with_stop_and_its_text_is_left_out(card):
    engine = FakeEngine(card, lambda ids, args: [*byte_ids("ok"), EOS_ID, *byte_ids("more")])
    body = run(post(serve(engine), "/v1/completions", {"prompt": "x", "max_tokens": 10})).json()
    assert body["choices"][0]["text"] == "ok" and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 3  # the EOS counts as generated
    body = run(
        post(serve(engine), "/v1/completions", {"prompt": "x", "max_tokens": 7, "ignore_eos": True})
    ).json()
    assert body["choices"][0]["text"] == "okmore" and body["choices"][0]["finish_reason"] == "length"


def test_stop_token_ids_reach_the_engine_and_end_with_stop(card):
    engine = FakeEngine(card, text_reply("abcdef"))
    payload = {"prompt": "x", "max_tokens": 6, "stop_token_ids": [ord("c")], "seed": 3, "temperature": 0.5}
    body = run(post(serve(engine), "/v1/completions", payload)).json()
    assert body["choices"][0] == {"index": 0, "text": "ab", "logprobs": None, "finish_reason": "stop"}
    (args,) = engine.args.values()
    assert (args.stop_token_ids, args.seed, args.temperature) == ((ord("c"),), 3, 0.5)


def test_several_prompts_give_one_choice_each(card):
    engine = FakeEngine(card)  # echoes each prompt
    payload = {"prompt": [byte_ids("ab"), byte_ids("xyz")], "max_tokens": 4}
    body = run(post(serve(engine), "/v1/completions", payload)).json()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "abab"), (1, "xyzx")]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}
    events = stream_events(run(post(serve(engine), "/v1/completions", {**payload, "stream": True})))
    texts = {0: "", 1: ""}
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == {0: "abab", 1: "xyzx"}


def test_a_model_without_a_tokenizer_takes_ids_and_returns_ids(card):
    bare = ModelCard(served_name="bare", context_len=32, vocab_size=VOCAB_SIZE)
    engine = FakeEngine(bare)
    body = run(post(serve(engine), "/v1/completions", {"prompt": [7, 8, 9], "max_tokens": 4})).json()
    assert body["choices"][0]["text"] == "" and body["choices"][0]["token_ids"] == [7, 8, 9, 7]
    response = run(post(serve(engine), "/v1/completions", {"prompt": "text"}))
    assert_error(response, 400, param="prompt", code="no_tokenizer")


# --- chat ----------------------------------------------------------------------------------------


def test_chat_renders_the_template_and_answers_as_the_assistant(card, byte_tokenizer):
    engine = FakeEngine(card, text_reply("hi there"))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    body = run(post(serve(engine), "/v1/chat/completions", {"messages": messages, "max_tokens": 8})).json()
    assert body["object"] == "chat.completion"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hi there"},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    (prompt,) = engine.prompts.values()
    assert prompt == byte_tokenizer.render_chat(messages)
    assert prompt == tuple(byte_ids("<|system|>be brief\n<|user|>hello\n<|assistant|>"))  # no BOS added
    assert body["usage"]["prompt_tokens"] == len(prompt)


def test_a_streamed_chat_sends_the_role_first_then_content(card):
    engine = FakeEngine(card, text_reply("ça va"))
    payload = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 6, "stream": True}
    chunks = stream_events(run(post(serve(engine), "/v1/chat/completions", payload)))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert all("role" not in d for d in deltas[1:])
    assert "".join(d.get("content", "") for d in deltas) == "ça va"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_a_streamed_chat_whose_first_delta_has_text_sends_the_role_in_a_chunk_of_its_own(card):
    # The first token's text is visible at once ("h"): a chunk holding the role and that text as two
    # choices of index 0 hid the text from clients that read `choices[0]` (the official client does).
    engine = FakeEngine(card, text_reply("hi there"))
    payload = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 8, "stream": True}
    chunks = stream_events(run(post(serve(engine), "/v1/chat/completions", payload)))
    assert all(len({c["index"] for c in chunk["choices"]}) == len(chunk["choices"]) for chunk in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content", "") for d in deltas) == "hi there"


def test_chat_without_a_template_is_a_400_that_says_so(card, plain_tokenizer_folder):
    plain = ModelCard(
        served_name="plain",
        context_len=64,
        vocab_size=VOCAB_SIZE,
        tokenizer_folder=str(plain_tokenizer_folder),
    )
    response = run(
        post(
            serve(FakeEngine(plain)), "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}
        )
    )
    error = assert_error(response, 400, param="messages", code="no_chat_template")
    assert "chat template" in error["message"]


# --- models and health ---------------------------------------------------------------------------


def test_models_lists_the_served_model(card):
    async def get():
        async with client(serve(FakeEngine(card))) as http:
            return await http.get("/v1/models")

    body = run(get()).json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["tiny-bytes"]
    assert body["data"][0]["max_model_len"] == 64


def test_health_is_200_when_every_worker_answers_and_503_naming_those_that_do_not(card):
    async def get(engine):
        async with client(serve(engine)) as http:
            return await http.get("/health")

    assert run(get(FakeEngine(card))).status_code == 200
    workers = (WorkerHealth("prefill-0", True), WorkerHealth("decode-1", False, "no answer in 5 s"))
    response = run(get(FakeEngine(card, workers=workers)))
    assert response.status_code == 503
    assert "decode-1" in response.json()["message"] and "prefill-0" not in response.json()["message"]

    class Unreachable(FakeEngine):
        async def health(self):
            raise ConnectionError("engine replica gone")

    response = run(get(Unreachable(card)))
    assert response.status_code == 503 and "engine replica gone" in response.json()["message"]


# --- refusals ------------------------------------------------------------------------------------


def test_the_api_key_is_checked_before_any_work(card):
    engine = FakeEngine(card)
    app = serve(engine, api_key="sesame")
    assert_error(run(post(app, "/v1/completions", b"{not json")), 401, code="invalid_api_key")
    assert_error(run(post(app, "/v1/completions", {"prompt": "x"}, api_key="wrong")), 401)
    assert engine.started == []
    assert (
        run(post(app, "/v1/completions", {"prompt": "x", "max_tokens": 2}, api_key="sesame")).status_code
        == 200
    )

    async def get(path, key=None):
        async with client(app, key) as http:
            return await http.get(path)

    assert run(get("/v1/models")).status_code == 401 and run(get("/v1/models", "sesame")).status_code == 200
    assert run(get("/health")).status_code == 200  # the orchestrator's probe carries no key


@pytest.mark.parametrize(
    ("payload", "status", "param", "code"),
    [
        (b"{nope", 400, None, "invalid_json"),
        (b'"a string"', 400, None, "invalid_type"),
        ({"prompt": "x", "max_tokens": "9"}, 400, "max_tokens", "invalid_value"),
        ({"prompt": [1, 2, 999]}, 400, "prompt", "token_id_out_of_range"),
        ({"prompt": [1] * 70}, 400, "prompt", "context_length_exceeded"),
        ({"prompt": "x", "n": 3}, 400, "n", "unsupported_parameter"),
        ({"prompt": "x", "model": "other"}, 404, "model", "model_not_found"),
    ],
)
def test_bad_requests_get_openai_errors_and_reach_no_engine(card, payload, status, param, code):
    engine = FakeEngine(card)
    assert_error(run(post(serve(engine), "/v1/completions", payload)), status, param=param, code=code)
    assert engine.started == []


def test_a_body_over_4_mib_is_refused_whether_or_not_its_size_is_declared(card):
    engine = FakeEngine(card)
    big = b'{"prompt": "' + b"a" * (4 << 20) + b'"}'
    assert_error(run(post(serve(engine), "/v1/completions", big)), 400, code="body_too_large")
    call = raw_call(serve(engine), "/v1/completions", big, body_parts=64)  # chunked: no content-length
    run(call.run())
    assert call.status == 400 and b"body_too_large" in b"".join(call.chunks)
    assert engine.started == []


def test_unknown_routes_and_methods_answer_in_openai_shape(card):
    async def calls():
        async with client(serve(FakeEngine(card))) as http:
            return await http.get("/v1/nothing"), await http.get("/v1/completions")

    missing, wrong_method = run(calls())
    assert_error(missing, 404)
    assert_error(wrong_method, 405)


def test_more_than_max_waiting_requests_get_503_with_retry_after(card):
    engine = FakeEngine(card, first_delay_s=0.3)
    app = serve(engine, max_waiting_requests=2, retry_after_s=2)
    payload = {"prompt": "x", "max_tokens": 2}

    async def scenario():
        async with client(app) as http:
            first = [asyncio.create_task(http.post("/v1/completions", json=payload)) for _ in range(2)]
            await wait_until(lambda: len(engine.started) == 2)
            refused = await http.post("/v1/completions", json=payload)
            done = await asyncio.gather(*first)
            later = await http.post("/v1/completions", json=payload)
            return refused, done, later

    refused, done, later = run(scenario())
    error = assert_error(refused, 503, code="server_busy")
    assert refused.headers["retry-after"] == "2" and "2 requests are waiting" in error["message"]
    assert [r.status_code for r in done] == [200, 200] and later.status_code == 200
    assert app.state.front_end.waiting.num_waiting == 0


def test_an_engine_at_capacity_gives_503_with_its_retry_after(card):
    response = run(
        post(serve(FakeEngine(card, busy=True)), "/v1/completions", {"prompt": "x", "stream": True})
    )
    assert_error(response, 503, code="server_busy")
    assert response.headers["retry-after"] == "3"


def test_a_request_the_engine_fails_is_a_500_or_an_error_event(card):
    engine = FakeEngine(card, fail_after=3)
    error = assert_error(
        run(post(serve(engine), "/v1/completions", {"prompt": "x"})), 500, code="generation_failed"
    )
    assert "decode-0 was lost" in error["message"]
    events = stream_events(run(post(serve(engine), "/v1/completions", {"prompt": "x", "stream": True})))
    assert events_text(events[:-1]) == "x"  # the echo of <s> x <s>: three tokens, then the failure
    assert events[-1]["error"]["code"] == "generation_failed"


def events_text(events: list) -> str:
    return "".join(e["choices"][0]["text"] for e in events)


def test_other_clients_keep_streaming_while_bad_requests_arrive(card):
    engine = FakeEngine(card, text_reply("steady stream"), step_delay_s=0.01)
    app = serve(engine)

    async def scenario():
        async with client(app) as http:
            good = asyncio.create_task(
                http.post("/v1/completions", json={"prompt": "x", "max_tokens": 13, "stream": True})
            )
            bad = [http.post("/v1/completions", content=b"{bad") for _ in range(10)]
            bad += [http.post("/v1/completions", json={"prompt": [VOCAB_SIZE]}) for _ in range(10)]
            return await good, await asyncio.gather(*bad)

    good, bad = run(scenario())
    assert events_text(stream_events(good)) == "steady stream"
    assert {r.status_code for r in bad} == {400}


# --- cancellation --------------------------------------------------------------------------------


def test_a_client_leaving_a_stream_cancels_its_generation(card):
    engine = FakeEngine(card, text_reply("a long answer that goes on"), step_delay_s=0.02)
    app = serve(engine)
    call = raw_call(app, "/v1/completions", {"prompt": "x", "max_tokens": 26, "stream": True})

    async def scenario():
        task = asyncio.create_task(call.run())
        await wait_until(lambda: len(call.chunks) >= 3)
        call.leave.set()
        await asyncio.wait_for(task, 5)

    run(scenario())
    (request_id,) = engine.started
    assert engine.cancelled == [request_id] and engine.finished == []
    assert engine.events_sent[request_id] < 26
    assert app.state.front_end.waiting.num_waiting == 0


def test_a_client_leaving_before_a_whole_answer_cancels_its_generation(card):
    engine = FakeEngine(card, first_delay_s=1.0, step_delay_s=0.05)  # leaving while prefill computes
    app = serve(engine)
    calls = [
        raw_call(app, "/v1/completions", {"prompt": [[1, 2], [3]], "max_tokens": 40}),
        raw_call(
            app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True}
        ),
    ]

    async def scenario():
        tasks = [asyncio.create_task(call.run()) for call in calls]
        await wait_until(lambda: len(engine.started) == 3)
        for call in calls:
            call.leave.set()  # the streamed chat leaves while prefill is still computing
        await asyncio.wait_for(asyncio.gather(*tasks), 5)

    run(scenario())
    assert sorted(engine.cancelled) == sorted(engine.started) and engine.finished == []
    assert app.state.front_end.waiting.num_waiting == 0
    assert all(call.chunks == [] for call in calls)  # nothing was sent to clients that had gone
