"""Whole-envelope transfer between a prefill pool and a decode pool over torch.distributed."""

from transfer.channel import RECEIVER_RANK, SENDER_RANK, Channel
from transfer.errors import ChannelError, FingerprintMismatch, ProtocolError, ReshardRefused, TransferError
from transfer.failure import FailureKind
from transfer.handle import Transfer, TransferOptions, TransferState
from transfer.parts import Parts
from transfer.plan import Chunk, Message, check_ranges, plan_messages, plan_runs
from transfer.rank_group import form_rank_group
from transfer.receiver import EnvelopeReceiver
from transfer.sender import EnvelopeSender

__all__ = [
    "RECEIVER_RANK",
    "SENDER_RANK",
    "Channel",
    "ChannelError",
    "Chunk",
    "EnvelopeReceiver",
    "EnvelopeSender",
    "FailureKind",
    "FingerprintMismatch",
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
