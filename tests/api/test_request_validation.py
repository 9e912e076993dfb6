"""Request bodies checked before any work: every bad one is an ApiError 400 naming its field."""

import json

import pytest

from distpool.api.engine import GenerationArgs
from distpool.api.errors import ApiError
from distpool.api.request.body import parse_body
from distpool.api.request.chat_request import ChatRequest
from distpool.api.request.completion_request import CompletionRequest
from distpool.api.request.prompts import chat_prompt, check_request_ids, completion_prompts
from tests.api.byte_tokenizer import BOS_ID, byte_ids


def completion(**fields) -> CompletionRequest:
    request = parse_body(CompletionRequest, json.dumps({"prompt": "hi", **fields}).encode())
    request.check_supported()
    return request


def refusal(make, **fields) -> ApiError:
    with pytest.raises(ApiError) as caught:
        make(**fields)
    assert caught.value.status == 400
    return caught.value


def test_a_full_request_becomes_generation_args():
    request = completion(
        max_tokens=5, min_tokens=2, temperature=0.7, top_p=0.9, top_k=40, seed=7, stop=["\n"],
        stop_token_ids=[3, 3, 4], ignore_eos=True, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    assert request.generation_args(5) == GenerationArgs(
        max_tokens=5,
        min_tokens=2,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        seed=7,
        stop_token_ids=(3, 4),
        ignore_eos=True,
    )
    assert request.stop_strings == ("\n",) and request.include_usage


def test_defaults_are_greedy_and_one_prompt():
    request = completion()
    assert request.prompts == ("hi",)
    assert request.generation_args(16) == GenerationArgs(max_tokens=16)


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [
        ("text", ("text",)),
        ([5, 6], ((5, 6),)),
        (["a", "b"], ("a", "b")),
        ([[1, 2], "c"], ((1, 2), "c")),
    ],
)
def test_prompt_forms(prompt, prompts):
    assert completion(prompt=prompt).prompts == prompts


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": "5"}, "max_tokens"),  # a string is not a number
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"stream": 1}, "stream"),  # 1 is not a boolean
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"stop": 5}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids.0"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[1], [-3]]}, "prompt"),
        ({"prompt": [1.5]}, "prompt"),
        ({"stream_options": {"include_usage": "x"}}, "stream_options.include_usage"),
    ],
)
def test_a_wrong_type_or_range_names_its_field(fields, param):
    error = refusal(completion, **fields)
    assert error.param == param and error.message.startswith(param)
    assert error.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 2}, "n"),
        ({"logprobs": 1}, "logprobs"),
        ({"best_of": 3}, "best_of"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -1}, "frequency_penalty"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"echo": True}, "echo"),
        ({"suffix": "x"}, "suffix"),
    ],
)
def test_an_unsupported_openai_field_at_a_non_default_value_is_named(fields, param):
    error = refusal(completion, **fields)
    assert error.param == param and error.code == "unsupported_parameter"
    assert param in error.message


def test_openai_fields_at_their_defaults_pass():
    completion(
        n=1, logprobs=None, best_of=1, presence_penalty=0, frequency_penalty=0.0, logit_bias={}, echo=False
    )


def test_unknown_fields_are_ignored_and_logged_once(caplog):
    with caplog.at_level("WARNING"):
        for _ in range(3):
            completion(my_extra_field=1).log_unknown_fields("/v1/test-once")
    assert [r.getMessage() for r in caplog.records].count(
        "/v1/test-once: ignoring unknown field 'my_extra_field'"
    ) == 1


@pytest.mark.parametrize(
    ("body", "code"), [(b"{not json", "invalid_json"), (b"[1, 2]", "invalid_type"), (b"", "invalid_json")]
)
def test_malformed_bodies(body, code):
    with pytest.raises(ApiError) as caught:
        parse_body(CompletionRequest, body)
    assert (caught.value.status, caught.value.code) == (400, code)


def test_a_missing_prompt_is_named():
    with pytest.raises(ApiError) as caught:
        parse_body(CompletionRequest, b"{}")
    assert caught.value.param == "prompt" and "required" in caught.value.message


def test_stream_options_need_stream():
    assert refusal(completion, stream_options={"include_usage": True}).param == "stream_options"


def test_min_tokens_above_max_tokens_is_refused():
    assert refusal(completion, min_tokens=9, max_tokens=3).param == "min_tokens"


def chat(**fields) -> ChatRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    request = parse_body(ChatRequest, json.dumps(body).encode())
    request.check_supported()
    return request


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content",
        ),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"logprobs": True}, "logprobs"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_chat_refusals_name_their_field(fields, param):
    assert refusal(chat, **fields).param == param


def test_chat_text_parts_are_joined_and_max_completion_tokens_wins():
    request = chat(
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ],
        max_tokens=3,
        max_completion_tokens=5,
    )
    assert request.messages[0].content == "ab" and request.requested_max_tokens() == 5


def test_text_prompts_are_tokenized_and_ids_pass_as_they_are(card, byte_tokenizer):
    prompts = completion_prompts(completion(prompt=["hé", [7, 8]]), card, byte_tokenizer)
    assert [p.prompt_ids for p in prompts] == [(BOS_ID, *byte_ids("hé")), (7, 8)]
    assert [p.max_tokens for p in prompts] == [16, 16]  # OpenAI's default for completions


def test_a_prompt_past_the_context_names_the_numbers(card, byte_tokenizer):
    with pytest.raises(ApiError) as caught:
        completion_prompts(completion(prompt=[1] * 64), card, byte_tokenizer)
    assert caught.value.code == "context_length_exceeded"
    assert "64 tokens" in caught.value.message and "context is 64" in caught.value.message
    with pytest.raises(ApiError) as caught:
        completion_prompts(completion(prompt=[1] * 60, max_tokens=10), card, byte_tokenizer)
    assert caught.value.param == "max_tokens"
    assert "70 in all" in caught.value.message and "to 4 or less" in caught.value.message


def test_the_default_max_tokens_is_what_the_context_leaves(card, byte_tokenizer):
    assert completion_prompts(completion(prompt=[1] * 60), card, byte_tokenizer)[0].max_tokens == 4
    (prompt,) = [chat_prompt(chat(), card, byte_tokenizer)]
    assert prompt.max_tokens == card.context_len - len(prompt.prompt_ids)  # chat: the rest of the context


def test_token_ids_outside_the_vocabulary_are_refused(card, byte_tokenizer):
    with pytest.raises(ApiError) as caught:
        completion_prompts(completion(prompt=[[1, 2], [3, 260, 999]]), card, byte_tokenizer)
    assert (
        caught.value.param == "prompt.1"
        and "260" in caught.value.message
        and "0 to 259" in caught.value.message
    )
    with pytest.raises(ApiError) as caught:
        check_request_ids(completion(stop_token_ids=[5000]), card, byte_tokenizer)
    assert caught.value.param == "stop_token_ids"


def test_without_a_tokenizer_text_and_stop_strings_and_chat_are_refused(card):
    with pytest.raises(ApiError) as caught:
        completion_prompts(completion(prompt="text"), card, None)
    assert caught.value.code == "no_tokenizer"
    with pytest.raises(ApiError) as caught:
        check_request_ids(completion(stop="x"), card, None)
    assert caught.value.param == "stop"
    with pytest.raises(ApiError) as caught:
        chat_prompt(chat(), card, None)
    assert caught.value.code == "no_chat_template"


def test_a_tokenizer_without_a_chat_template_is_refused_with_a_reason(card, plain_tokenizer_folder):
    from distpool.api.request.tokenizer import load_tokenizer

    with pytest.raises(ApiError) as caught:
        chat_prompt(chat(), card, load_tokenizer(str(plain_tokenizer_folder)))
    assert caught.value.code == "no_chat_template" and "no chat template" in caught.value.message


def test_min_tokens_raise_the_default_max_tokens_within_the_context(card, byte_tokenizer):
    (prompt,) = completion_prompts(completion(prompt=[1, 2], min_tokens=30), card, byte_tokenizer)
    assert prompt.max_tokens == 30  # the default 16 would end before min_tokens
    with pytest.raises(ApiError) as caught:
        completion_prompts(completion(prompt=[1] * 60, min_tokens=5), card, byte_tokenizer)
    assert caught.value.param == "min_tokens" and "leaves 4" in caught.value.message
