"""Text out of token ids as they arrive, and stop strings matched on that text.

`IncrementalDetokenizer` decodes a short window of ids (the ids already shown, for context, plus the
new ones) and emits only text that is final: while the window's text ends in U+FFFD, a multi-byte
character is still split across tokens and waits for its next bytes. `StopMatcher` holds back the
text that could still become a stop string and cuts the text at the first stop string found (the stop
string itself is not returned, as OpenAI does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

REPLACEMENT = "\ufffd"  # what a decoder gives for bytes that are not (yet) a whole character


class IncrementalDetokenizer:
    """`push(new_ids)` -> the text they complete; `flush()` -> what is left at the end.

    `decode(ids)` must be the tokenizer's decode (special tokens skipped). `context_ids`: the last
    ids before the first generated one (a prompt's tail), so that a first token's leading space is
    decoded as it would be inside the sequence."""

    def __init__(self, decode: Callable[[list[int]], str], context_ids: Sequence[int] = ()) -> None:
        self._decode = decode
        self._ids = list(context_ids[-6:])
        self._prefix_offset = 0  # ids[prefix_offset:read_offset]: already shown, kept for context
        self._read_offset = len(self._ids)

    def push(self, new_ids: Sequence[int]) -> str:
        self._ids.extend(new_ids)
        if len(self._ids) == self._read_offset:
            return ""
        shown = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= len(shown) or text.endswith(REPLACEMENT):
            return ""  # nothing new yet, or a character still split across tokens
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return text[len(shown) :]

    def flush(self) -> str:
        """The text of ids still held (a character left incomplete shows as U+FFFD)."""
        shown = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return text[len(shown) :] if len(text) > len(shown) else ""


@dataclass(frozen=True)
class StopCheck:
    """What may be shown now, and whether a stop string ended the text (nothing follows it)."""

    text: str
    stopped: bool = False


class StopMatcher:
    """Matches stop strings on streamed text. `push(text)` -> what is safe to show; `flush()` -> the
    held tail once the text has ended without a stop string."""

    def __init__(self, stop_strings: Sequence[str]) -> None:
        self._stops = tuple(s for s in stop_strings if s)
        self._held = ""

    def push(self, text: str) -> StopCheck:
        if not self._stops:
            return StopCheck(text)
        pending = self._held + text
        cut = min((i for i in (pending.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            return StopCheck(pending[:cut], stopped=True)
        keep = self._longest_stop_prefix_at_end(pending)
        self._held = pending[len(pending) - keep :] if keep else ""
        return StopCheck(pending[: len(pending) - keep])

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _longest_stop_prefix_at_end(self, text: str) -> int:
        """How many trailing characters of `text` begin some stop string (those must wait)."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
