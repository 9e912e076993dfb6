"""Whole-envelope transfer between a prefill pool and a decode pool over torch.distributed.

Bottom to top (the import contract in pyproject.toml enforces the order):
- `wire/`: what crosses between the ends (the protocol's messages), failure kinds, typed errors;
  `defaults.py`: every default and limit of the engine;
- `plans/`: which bytes move: coalesced runs and messages, plans across TP sizes;
  `connect/`: how ranks meet: a rendezvous that proves the secret, process groups;
- `pair/`: one channel between a prefill rank and a decode rank, its hello and control plane;
- `ends/`: the channel's two ends and the transfers they move;
- `parts.py`: one request's transfers over a rank's channels; `faults.py`: faults injected on
  purpose; `peers.py`: a worker's channels, what the workers call.
Each subpackage's `__init__` names what the others may use.
"""

from transfer.connect import form_rank_group
from transfer.ends import EnvelopeReceiver, EnvelopeSender, Transfer, TransferOptions, TransferState
from transfer.pair import RECEIVER_RANK, SENDER_RANK, Channel
from transfer.parts import Parts
from transfer.plans import Chunk, Message, check_ranges, plan_messages, plan_runs
from transfer.wire import (
    AlreadyExpected,
    ArgInvalid,
    ChannelError,
    FailureKind,
    FingerprintMismatch,
    HeaderRefused,
    ProtocolError,
    ReshardRefused,
    TransferError,
)

__all__ = [
    "AlreadyExpected",
    "ArgInvalid",
    "RECEIVER_RANK",
    "SENDER_RANK",
    "Channel",
    "ChannelError",
    "Chunk",
    "EnvelopeReceiver",
    "EnvelopeSender",
    "FailureKind",
    "FingerprintMismatch",
    "HeaderRefused",
    "Message",
    "Parts",
    "ProtocolError",
    "ReshardRefused",
    "Transfer",
    "TransferError",
    "TransferOptions",
    "TransferState",
    "check_ranges",
    "form_rank_group",
    "plan_messages",
    "plan_runs",
]
