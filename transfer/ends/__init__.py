"""The two ends of a channel and what they move: a transfer as each end sees it.

`handle.py`: `Transfer` (its states) and `TransferOptions`; `end.py`: what both ends share (the job,
the worker thread, staging, how a transfer concludes); `sender.py`, with its check of the receiver's
offer against its envelope (`offer_check.py`), and `receiver.py`, with its offers (`offers.py`) and
its check of a header against its reservation (`header_check.py`); one transfer's chunks going out
or landing (`send_pipeline.py`, `receive_pipeline.py`) through `staging.py` (gather, scatter,
checksum; `segments.py`: strided stretches); `activity.py`: whether a worker's ends move bytes;
`link.py`: the raw link measured on a channel."""

from transfer.ends.activity import Activity
from transfer.ends.handle import ChunkHook, Transfer, TransferOptions, TransferState
from transfer.ends.link import measure
from transfer.ends.receiver import EnvelopeReceiver
from transfer.ends.sender import EnvelopeSender
from transfer.ends.staging import PIPELINE_DEPTH

__all__ = [
    "Activity",
    "ChunkHook",
    "EnvelopeReceiver",
    "EnvelopeSender",
    "PIPELINE_DEPTH",
    "Transfer",
    "TransferOptions",
    "TransferState",
    "measure",
]
