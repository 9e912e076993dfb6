"""What the benchmark sends: sessions of one or more turns, each turn a prompt and an output length.

A single-turn dataset is a list of one-turn sessions; a multi-turn one sends each session's turns in
order, each after the previous reply, with the conversation so far in front of the new message.
"""

from __future__ import annotations

from dataclasses import dataclass

# Text stand-ins for token ids (chat sends text): one short common word per id, so a prompt of n ids
# is a text of n words, about n tokens for a real tokenizer.
WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one "
    "had by word but not what all were we when your can said there use an each which she do how their "
    "if will up other about out many then them these so some her would make like him into time has "
    "look two more write go see number no way could people my than first water been call who oil its "
    "now find long down day did get come made may part"
).split()


def words_of(ids: tuple[int, ...]) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in ids)


@dataclass(frozen=True)
class Turn:
    """One request's new part: `prompt_ids` (completions' token-id prompt; None for a dataset of text)
    and the same prompt as `text`; `output_len`: the tokens asked for (`max_tokens`, EOS ignored)."""

    prompt_ids: tuple[int, ...] | None
    text: str
    output_len: int

    @staticmethod
    def of_ids(ids: tuple[int, ...] | list[int], output_len: int) -> Turn:
        ids = tuple(ids)
        return Turn(prompt_ids=ids, text=words_of(ids), output_len=output_len)

    @property
    def planned_prompt_len(self) -> int:
        """Its prompt's length in tokens as planned (text: words), when the server states none."""
        return len(self.prompt_ids) if self.prompt_ids is not None else len(self.text.split())


@dataclass(frozen=True)
class Session:
    session_id: str
    turns: tuple[Turn, ...]

    def __post_init__(self) -> None:
        if not self.turns:
            raise ValueError(f"session {self.session_id} has no turns")


def num_requests(sessions: list[Session]) -> int:
    return sum(len(s.turns) for s in sessions)
