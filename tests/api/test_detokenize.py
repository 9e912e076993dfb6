"""Incremental detokenization and stop strings: text leaves as tokens arrive, whole characters only,
and a stop string is cut out wherever the chunks split it."""

from hypothesis import given, settings
from hypothesis import strategies as st

from distpool.api.stream.detokenize import IncrementalDetokenizer, StopMatcher
from tests.api.byte_tokenizer import EOS_ID, byte_ids

TEXT = "a é 日本 🙂!"


def stream(detokenizer: IncrementalDetokenizer, ids: list[int], sizes: list[int]) -> list[str]:
    pieces, at = [], 0
    for size in sizes:
        pieces.append(detokenizer.push(ids[at : at + size]))
        at += size
    pieces.append(detokenizer.push(ids[at:]))
    pieces.append(detokenizer.flush())
    return pieces


def test_a_character_split_across_tokens_waits_for_its_last_byte(byte_tokenizer):
    detok = IncrementalDetokenizer(byte_tokenizer.decode)
    emoji = byte_ids("🙂")  # four bytes, four tokens
    assert [detok.push([b]) for b in emoji] == ["", "", "", "🙂"]
    assert detok.push(byte_ids("x")) == "x"
    assert detok.flush() == ""


def test_one_token_at_a_time_never_emits_a_broken_character(byte_tokenizer):
    detok = IncrementalDetokenizer(byte_tokenizer.decode)
    pieces = stream(detok, byte_ids(TEXT), [1] * len(byte_ids(TEXT)))
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in piece for piece in pieces)
    assert "日" in pieces and "本" in pieces  # each character leaves with its last byte


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=len(TEXT.encode())), max_size=8))
def test_any_split_of_the_ids_gives_the_whole_text(byte_tokenizer, cuts):
    ids = byte_ids(TEXT)
    bounds = sorted(set(cuts))
    sizes = [b - a for a, b in zip([0, *bounds], bounds, strict=False)]
    pieces = stream(IncrementalDetokenizer(byte_tokenizer.decode), ids, sizes)
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in piece for piece in pieces)


def test_special_tokens_give_no_text_and_a_prompt_tail_is_context_only(byte_tokenizer):
    detok = IncrementalDetokenizer(byte_tokenizer.decode, context_ids=byte_ids("prompt "))
    assert detok.push(byte_ids("ok")) == "ok"
    assert detok.push([EOS_ID]) == ""
    assert detok.flush() == ""


def test_an_unfinished_character_at_the_end_shows_as_the_replacement_character(byte_tokenizer):
    detok = IncrementalDetokenizer(byte_tokenizer.decode)
    assert detok.push(byte_ids("ab") + byte_ids("é")[:1]) == ""  # held: the text ends mid-character
    assert detok.flush() == "ab\ufffd"


def test_a_stop_string_inside_one_chunk_cuts_the_text_before_it():
    matcher = StopMatcher(["STOP"])
    check = matcher.push("hello STOP and more")
    assert (check.text, check.stopped) == ("hello ", True)


def test_a_stop_string_straddling_chunks_is_held_back_then_cut():
    matcher = StopMatcher(["</end>", "zz"])
    assert matcher.push("abc </").text == "abc "  # "</" may begin "</end>": held
    assert matcher.push("en").text == ""
    check = matcher.push("d> tail")
    assert (check.text, check.stopped) == ("", True)


def test_held_text_that_does_not_become_a_stop_string_is_released():
    matcher = StopMatcher(["</end>"])
    assert matcher.push("x </e").text == "x "
    check = matcher.push("ntry")
    assert (check.text, check.stopped) == ("</entry", False)
    assert matcher.push("<").text == ""
    assert matcher.flush() == "<"  # the text ended: what was held is shown


def test_the_earliest_of_several_stop_strings_wins():
    check = StopMatcher(["world", "lo w"]).push("hello world")
    assert (check.text, check.stopped) == ("hel", True)


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=24), max_size=6))
def test_a_stop_string_is_found_however_the_text_is_chunked(cuts):
    text = "one two <stop> three four"
    bounds = sorted(set(cuts))
    chunks = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    matcher, shown, stopped = StopMatcher(["<stop>"]), [], False
    for chunk in chunks:
        check = matcher.push(chunk)
        shown.append(check.text)
        if check.stopped:
            stopped = True
            break
    assert stopped and "".join(shown) == "one two "
