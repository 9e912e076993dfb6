"""Typed failures of the transfer path: a channel that cannot be (re)built, and a failed transfer."""

from __future__ import annotations

from distpool.facts import Facts
from transfer.wire.failure import FailureKind


class ArgInvalid(Facts, ValueError):
    """An argument of the transfer engine (`field`: a channel's `port`, an arena `buffer`, a rank
    group's `size`, ...) holds `value`; it must be `expected` (e.g. "> 0", "in 1..65535").
    `value` is what the caller gave, or a description of it where it is a tensor."""

    def __init__(self, field: str, value: object, expected: str) -> None:
        self.field, self.value, self.expected = field, value, expected
        super().__init__(f"{field} must be {expected}, got {value!r}")


class AlreadyExpected(Facts, ValueError):
    """The receiver already expects request `request_id` on this channel."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        super().__init__(f"request {request_id!r} is already expected on this channel")


class ChannelError(Facts, Exception):
    """A channel could not be connected, or is broken and must be rebuilt before it carries more.

    `kind`: how a transfer that meets it fails; the link or the peer is gone unless said otherwise
    (a wait that ran past its deadline says TIMEOUT)."""

    kind = FailureKind.PEER_LOST

    def __init__(self, message: str, *, kind: FailureKind | None = None) -> None:
        super().__init__(message)
        if kind is not None:
            self.kind = kind


class FingerprintMismatch(ChannelError):
    """The two ends of a channel describe different pool layouts; `fields` maps each differing
    field to (this end's value, the peer's value)."""

    def __init__(self, fields: dict[str, tuple[object, object]]) -> None:
        self.fields = fields
        detail = "; ".join(
            f"{name} is {mine!r} here, {theirs!r} on the peer" for name, (mine, theirs) in fields.items()
        )
        super().__init__(f"pool layout differs from the peer's: {detail}")


# Why two ends' TP layouts do not pair (`ReshardRefused.problem`).
NO_TP_LAYOUT = "no_tp_layout"  # this end has none (TP 1), the peer is another rank or TP size
MALFORMED = "malformed"  # the peer's rank is not an int in 0..size-1 of an int size
UNSHARDABLE = "unshardable"  # the model cannot be sharded over the peer's TP size (`cause`)
NOTHING_TO_MOVE = "nothing_to_move"  # the plan moves no bytes from this source rank to this destination


class ReshardRefused(ChannelError):
    """The two ends' TP layouts cannot be resharded into each other, or this pair of ranks has
    nothing to move under the plan: `problem` (one of the names above); `peer_rank` / `peer_size`:
    what the peer's hello said. For NOTHING_TO_MOVE, the pair as (`src_rank`, `src_size`) ->
    (`dst_rank`, `dst_size`) and `needed`, the source ranks the destination's shard comes from;
    for UNSHARDABLE, `cause` (the model's refusal)."""

    def __init__(
        self,
        problem: str,
        *,
        peer_rank: object,
        peer_size: object,
        src: tuple[int, int] | None = None,
        dst: tuple[int, int] | None = None,
        needed: tuple[int, ...] = (),
        cause: Exception | None = None,
    ) -> None:
        self.problem, self.peer_rank, self.peer_size = problem, peer_rank, peer_size
        self.src, self.dst, self.needed, self.cause = src, dst, tuple(needed), cause
        super().__init__(self._describe())

    def _describe(self) -> str:
        if self.problem == NO_TP_LAYOUT:
            return (
                f"the peer is rank {self.peer_rank} of TP {self.peer_size}, this end has no TP layout (TP 1)"
            )
        if self.problem == MALFORMED:
            return f"the peer's TP layout is malformed: rank {self.peer_rank!r} of TP {self.peer_size!r}"
        if self.problem == UNSHARDABLE:
            return f"the peer's layout cannot be resharded into this one's: {self.cause}"
        (src_rank, src_size), (dst_rank, dst_size) = self.src, self.dst
        return (
            f"source rank {src_rank} of TP {src_size} sends nothing to destination rank {dst_rank} of "
            f"TP {dst_size}: that rank's shard comes from source ranks {list(self.needed)}"
        )


# Why a receiver refused a sender's header (`HeaderRefused.problem`): the code REFUSE carries.
NOT_EXPECTED = "not_expected"  # no reservation for the request came in time
TURNED_AWAY = "turned_away"  # the receiving worker refused the request before its header came
GIVEN_UP = "given_up"  # the reservation was aborted, or its deadline passed, before the header came
SENDER_WITHDREW = "sender_withdrew"  # the sender withdrew the transfer (its deadline passed)
HEADER_DIFFERS = "header_differs"  # version, sequence number, tokens or rows disagree (`field`)
CHUNK_LIMITS = "chunk_limits"  # chunk_bytes or direct_min_bytes outside this receiver's bounds
LAYOUT = "layout"  # the source table does not pair with the reservation (`cause`, at the receiver)
MALFORMED_HEADER = "malformed_header"  # the header does not decode
OFFER_STALE = "offer_stale"  # planned on an offer of the request that a later one replaced
REFUSAL_PROBLEMS = frozenset(
    (
        NOT_EXPECTED,
        TURNED_AWAY,
        GIVEN_UP,
        SENDER_WITHDREW,
        HEADER_DIFFERS,
        CHUNK_LIMITS,
        LAYOUT,
        MALFORMED_HEADER,
        OFFER_STALE,
    )
)


class HeaderRefused(Facts, Exception):
    """A receiver refused a sender's header: the transfer fails as `kind`, for `problem` (one of the
    names above), told to a person by `detail`. Both ends know these three (REFUSE carries them).
    At the receiver only: `field`, `mine` and `theirs` for HEADER_DIFFERS (the reservation's value,
    the header's); `cause` for LAYOUT, the typed refusal of the source table (`RowsDoNotPair`,
    `UnitSizesDiffer`, `RangesRefused`, or a ProtocolError for a table that does not decode)."""

    def __init__(
        self,
        kind: FailureKind,
        problem: str,
        detail: str,
        *,
        field: str = "",
        mine: object = None,
        theirs: object = None,
        cause: Exception | None = None,
    ) -> None:
        self.kind, self.problem, self.detail = FailureKind(kind), problem, detail
        self.field, self.mine, self.theirs, self.cause = field, mine, theirs, cause
        super().__init__(detail)


class TransferError(Facts, Exception):
    """One envelope transfer failed; the caller must release what it holds for `request_id`.

    `kind` says what kind of failure it was (read it, not the wording); `reason` says it to a
    person. `channel_broken` says whether the channel went down with it (rebuild before the next
    transfer). `cause`, where there is one, is the typed fact behind it (a `HeaderRefused` at
    either end of a refused header).
    """

    def __init__(
        self,
        request_id: str,
        kind: FailureKind,
        reason: str,
        *,
        channel_broken: bool = False,
        cause: Exception | None = None,
    ) -> None:
        super().__init__(f"transfer of request {request_id!r} failed ({kind.value}): {reason}")
        self.request_id = request_id
        self.kind = FailureKind(kind)
        self.reason = reason
        self.channel_broken = channel_broken
        self.cause = cause


class ProtocolError(ChannelError):
    """The peer sent something the protocol does not allow; the stream is out of step (rebuild)."""

    kind = FailureKind.PROTOCOL


class TrailerRefused(ProtocolError):
    """The stream's trailer for transfer `seq` read `words` (seq, filled, checksum): another
    transfer's (the stream is out of step) or no trailer at all."""

    def __init__(self, seq: int, words: list[int]) -> None:
        self.seq, self.words = seq, list(words)
        super().__init__(f"the stream's trailer reads {self.words} for transfer {seq}")

    @property
    def out_of_step(self) -> bool:
        """It is a trailer, of another transfer."""
        return self.words[0] != self.seq
