"""Server-sent event framing as OpenAI streams it."""

import pytest

from distpool.api.stream.sse import DONE, parse_sse, sse_data


def test_one_event_is_one_data_line_and_a_blank_line():
    event = sse_data({"text": "a\nb é"})
    assert event == 'data: {"text":"a\\nb é"}\n\n'.encode()
    assert event.count(b"\n") == 2  # a newline inside the text stays escaped in the JSON


def test_a_stream_parses_back_in_order_ending_with_done():
    body = sse_data({"i": 1}) + sse_data({"i": 2}) + DONE
    assert parse_sse(body) == [{"i": 1}, {"i": 2}, "[DONE]"]


@pytest.mark.parametrize("body", [b"data: {}\n", b"event: x\n\n", b'data: {"a":\n1}\n\n'])
def test_bad_framing_is_refused(body):
    with pytest.raises(ValueError):
        parse_sse(body)
