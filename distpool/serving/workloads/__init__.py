"""The requests a run serves: generated or read workloads, multi-turn conversations, and the
request flags of `distpool run` checked against each other.

`workload.py`: `Request`, seeded workloads by prompt-length distribution, JSONL prompts;
`conversation.py`: multi-turn conversations, each turn fed by the last one's outcome;
`request_flags.py`: where a run's requests come from.
"""

from distpool.serving.workloads.conversation import DEFAULT_TURNS, MultiTurn, TurnFeed, generate_conversations
from distpool.serving.workloads.request_flags import (
    DEFAULT_PROMPT_LEN,
    DEFAULT_REQUESTS,
    DEFAULT_WORKLOAD,
    RequestFlags,
)
from distpool.serving.workloads.workload import WORKLOADS, Request, generate

__all__ = [
    "DEFAULT_PROMPT_LEN",
    "DEFAULT_REQUESTS",
    "DEFAULT_TURNS",
    "DEFAULT_WORKLOAD",
    "MultiTurn",
    "Request",
    "RequestFlags",
    "TurnFeed",
    "WORKLOADS",
    "generate",
    "generate_conversations",
]
