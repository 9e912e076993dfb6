"""What crosses between the driver and the workers, per request: one typed value each way.

The driver hands a prefill worker `PrefillItem`s and gets back one `PrefillResult` per request; a
decode worker's `next_events` hands out one `DecodeResult` per request (`DecodeEvents`, with tokens as
they are made when streaming). Both sides import these (serving above, prefill and decode below);
Ray pickles them as they are. The driver counts from them: a worker's own counters go with it when
it dies. A failed result says what kind of failure it was (`kind`, which the driver reads) and why,
in words (`reason`, which a person reads); a prefill's also what stopped it (`cause`, which a
caller tells apart).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

from distpool.memory.prefix import CacheNews
from distpool.model.sampling import LENGTH, Finish, SamplingParams
from distpool.model_impl.pool_model import Mismatch
from transfer.wire import FailureKind


@dataclass(frozen=True)
class PrefillItem:
    """One request of a prefill batch: prefill `prompt`, send its envelope to `decode_worker`."""

    request_id: str
    prompt: list[int]
    decode_worker: str  # reserved the destination; expects the envelope from this prefill worker
    params: SamplingParams = SamplingParams()  # how its first token is picked (the seed set)


# ---- prefill's result, per request --------------------------------------------------------------
class PrefillCause(Enum):
    """What stopped a prefill (`PrefillBusy.cause`, `PrefillFailed.cause`)."""

    NO_ROOM = "no room"  # the pool could not hold the prompt now
    WAVES_DIFFER = "waves differ"  # the TP ranks reserved different waves
    GROUP_NOT_FORMED = "group not formed"  # this rank's TP group has not formed (yet)
    ALREADY_HELD = "already held"  # the request id is held here already
    NO_ENVELOPE = "no envelope"  # the pool could not describe the request as an envelope
    NO_CHANNEL = "no channel"  # no channel to a rank of the decode worker
    TRANSFER = "transfer"  # the transfer failed (its `kind` says how)
    RANKS_DISAGREE = "ranks disagree"  # the prefill ranks computed different token counts


@dataclass(frozen=True)
class PrefillSent:
    """The envelope reached its decode worker; the transfer header carried the first token."""

    transfer_bytes: int
    transfer_s: float  # first byte to last
    source_runs: int  # runs of consecutive bytes the source envelope sat in
    computed_tokens: int  # prompt tokens prefill computed (after its cached prefix)
    # Prompt tokens per second the model computed in this request's wave (every job's tokens over
    # the model call's seconds): what prefill computes at, batching and waiting aside. 0: unknown.
    compute_tokens_per_s: float = 0.0


@dataclass(frozen=True)
class PrefillBusy:
    """No room on the prefill worker now; nothing is held there. Try again later."""

    kind: ClassVar[FailureKind] = FailureKind.NO_ROOM
    reason: str
    cause: PrefillCause


@dataclass(frozen=True)
class PrefillFailed:
    """Prefill or its transfer failed; nothing is held there. `retry`: another pair may succeed
    (False: retrying would only repeat it)."""

    kind: FailureKind
    reason: str
    retry: bool
    cause: PrefillCause


PrefillResult = PrefillSent | PrefillBusy | PrefillFailed


# ---- decode's result, per request ---------------------------------------------------------------
@dataclass(frozen=True)
class DecodeFinished:
    """Every token generated; the envelope's bytes were checked where the model can check them."""

    tokens: list[int]  # the first came from prefill
    decode_s: float  # first token to last
    admit_s: float  # landed to verified and in the decode batch
    destination_runs: int  # runs of consecutive bytes the transfer wrote into
    prefix_hit_tokens: int  # of the prompt, in pages held here already (never transferred)
    verified: bool  # every byte checked on arrival and at release
    # Bytes its transfers wrote, per rank of the decode worker (one entry per rank; none when
    # prefilled locally): the summary's `transfer_bytes_by_rank`.
    received_bytes: tuple[int, ...] = ()
    # Prefilled here from a kept final state (`DecodeWorker.local_prefill`): the prompt tokens it
    # computed (0: its envelope was transferred), and accepted -> its last chunk computed.
    local_computed_tokens: int = 0
    local_prefill_s: float = 0.0
    local_compute_s: float = 0.0  # of which its state copy and chunks (the decode steps between aside)
    finish: Finish = LENGTH  # why it ended: an EOS or stop id (which), or max_tokens


@dataclass(frozen=True)
class DecodeFailed:
    """Decode gave the request up after it was admitted; it holds nothing there any more."""

    kind: FailureKind  # CORRUPT: its envelope's bytes were wrong (never retried)
    reason: str
    retry: bool  # whether another pair may succeed (False: a bug on decode's side)
    mismatch: Mismatch | None = None  # CORRUPT: the first wrong byte, where the model found one

    @property
    def corrupt(self) -> bool:
        return self.kind is FailureKind.CORRUPT


DecodeResult = DecodeFinished | DecodeFailed


# ---- decode's answer to a local prefill -----------------------------------------------------------
@dataclass(frozen=True)
class LocalPrefillStarted:
    """Decode holds the state after `held_tokens` of the prompt and prefills the rest itself; the
    request's result comes from `next_finished` like any other."""

    held_tokens: int


@dataclass(frozen=True)
class ViewedState:
    """Why the driver asks a decode worker for a local prefill: its view of that worker's cache,
    with the worker's reports applied up to `report`, holds the state after `held_tokens` of the
    prompt."""

    held_tokens: int
    report: int


class Refusal(Enum):
    """Why decode refused a local prefill."""

    # It keeps no state the prompt extends, and had reported the state gone before the driver chose
    # (or never kept it): the driver's view was stale.
    NO_STATE = "no_state"
    # The state went in a report that had not reached the driver when it chose (or is not sent yet).
    NEWS_IN_FLIGHT = "news_in_flight"
    NO_ROOM = "no_room"  # no room with headroom for the running requests
    EVICTED = "evicted"  # making room for it evicted the state it extends


@dataclass(frozen=True)
class LocalPrefillRefused:
    """Decode keeps no state the prompt extends or has no room; it holds nothing for the request:
    take the disaggregated path."""

    kind: Refusal
    reason: str


LocalPrefillAnswer = LocalPrefillStarted | LocalPrefillRefused


# ---- decode's long-poll: results, and tokens as they are made -----------------------------------
@dataclass(frozen=True)
class DecodeEvents:
    """What one `DecodeWorker.next_events` call hands out: each request that ended since the last call
    (`finished`, once), and, when streaming, each live request's tokens made since the last call
    (`tokens`: request id -> (index of the first, the tokens)). A request's first token is there as
    soon as its transfer header landed, before its envelope moved. `cache`: what its prefix cache
    cached and evicted since the last call (taken with `finished`, so that the driver's view of its
    cache equals its own once the driver applied them)."""

    finished: dict[str, DecodeResult]
    tokens: dict[str, tuple[int, list[int]]]
    cache: CacheNews = field(default_factory=CacheNews)
