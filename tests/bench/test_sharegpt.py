"""ShareGPT files: single-turn takes each conversation's first exchange, multi-turn its exchanges in
order; lengths from --output-len or the reply; malformed files are refused naming the file."""

from __future__ import annotations

import json

import pytest

from distpool.bench.datasets import DatasetArgs, build_sessions
from distpool.bench.sharegpt import load_sharegpt

CONVERSATIONS = [
    {
        "id": "a",
        "conversations": [
            {"from": "human", "value": "What is a page?"},
            {"from": "gpt", "value": "x" * 40},
            {"from": "human", "value": "And a slot?"},
            {"from": "gpt", "value": "y" * 8},
            {"from": "human", "value": "unanswered"},
        ],
    },
    {
        "id": "b",
        "conversations": [{"from": "gpt", "value": "a reply first"}, {"from": "human", "value": "q"}],
    },
    {"id": "c", "conversations": [{"from": "user", "value": "Hi"}, {"from": "assistant", "value": "Hello!"}]},
    {"id": "d"},
    "not a conversation",
]


@pytest.fixture
def sharegpt_file(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(CONVERSATIONS))
    return path


def test_single_turn_takes_each_first_exchange(sharegpt_file):
    sessions = load_sharegpt(sharegpt_file, 10, multi_turn=False, output_len=None, seed=0)
    by_id = {s.session_id: s for s in sessions}
    assert set(by_id) == {"sharegpt-a", "sharegpt-c"}  # b starts with a reply, d and the string hold none
    (turn,) = by_id["sharegpt-a"].turns
    assert turn.text == "What is a page?" and turn.prompt_ids is None
    assert turn.output_len == 10  # 40 characters at 4 a token
    assert by_id["sharegpt-c"].turns[0].output_len == 2  # "Hello!": 6 characters


def test_multi_turn_keeps_the_exchanges_in_order_up_to_the_request_count(sharegpt_file):
    sessions = load_sharegpt(sharegpt_file, 10, multi_turn=True, output_len=7, seed=0)
    a = next(s for s in sessions if s.session_id == "sharegpt-a")
    assert [t.text for t in a.turns] == ["What is a page?", "And a slot?"]
    assert all(t.output_len == 7 for s in sessions for t in s.turns)
    capped = load_sharegpt(sharegpt_file, 2, multi_turn=True, output_len=None, seed=0)
    assert sum(len(s.turns) for s in capped) == 2


def test_the_seed_orders_the_conversations(tmp_path):
    path = tmp_path / "many.json"
    exchange = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "r"}]
    path.write_text(json.dumps([{"id": i, "conversations": exchange} for i in range(30)]))
    first = [s.session_id for s in load_sharegpt(path, 5, multi_turn=False, output_len=1, seed=1)]
    assert first == [s.session_id for s in load_sharegpt(path, 5, multi_turn=False, output_len=1, seed=1)]
    assert first != [s.session_id for s in load_sharegpt(path, 5, multi_turn=False, output_len=1, seed=2)]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "is not a ShareGPT JSON file"),
        ('{"conversations": []}', "a JSON list of conversations"),
        ('[{"conversations": [{"from": "human", "value": "q"}]}]', "holds no conversation"),
    ],
)
def test_malformed_files_are_refused_naming_the_file(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as caught:
        load_sharegpt(path, 3, multi_turn=False, output_len=None, seed=0)
    assert str(path) in str(caught.value)


def test_a_missing_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot read --dataset-path"):
        load_sharegpt(tmp_path / "absent.json", 3, multi_turn=False, output_len=None, seed=0)


def test_the_sharegpt_dataset_goes_through_build_sessions(sharegpt_file):
    args = DatasetArgs(
        dataset="sharegpt", num_prompts=3, seed=0, vocab_size=100, dataset_path=str(sharegpt_file)
    )
    assert len(build_sessions(args, context_len=None)) == 2


def test_generated_datasets_are_seeded_and_sized():
    args = DatasetArgs(dataset="random", num_prompts=5, seed=4, vocab_size=50, input_len=12, output_len=3)
    sessions = build_sessions(args, context_len=64)
    assert sessions == build_sessions(args, context_len=64)
    assert [len(s.turns[0].prompt_ids) for s in sessions] == [12] * 5
    assert all(0 <= i < 50 for s in sessions for i in s.turns[0].prompt_ids)
    assert all(len(s.turns[0].text.split()) == 12 for s in sessions)
    with pytest.raises(ValueError, match="exceed the server's context of 14 tokens"):
        build_sessions(args, context_len=14)
