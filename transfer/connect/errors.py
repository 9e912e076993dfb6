"""What a rendezvous or a rank group's forming fails with, as facts: where, who was awaited, why.

Each is a `ChannelError` (the channel, or the group, cannot form), picklable with its fields."""

from __future__ import annotations

from transfer.wire import ChannelError, ProtocolError


class PeersMissing(ChannelError):
    """The rendezvous at `host:port` reached its deadline with peers missing: `awaited` peers were
    waited for and `proven` of them proved the secret. `listening`: this end was rank 0, waiting
    for the others; else it was a joiner and rank 0 never answered."""

    def __init__(self, host: str, port: int, *, awaited: int, proven: int, listening: bool) -> None:
        self.host, self.port = host, port
        self.awaited, self.proven, self.listening = awaited, proven, listening
        where = f"{host}:{port}"
        if not listening:
            message = f"no rendezvous at {where}: the rank-0 peer never showed up"
        elif awaited == 1:
            message = f"no rank-1 peer proved the secret at {where}: it never showed up"
        else:
            missing = awaited - proven
            message = f"{proven} of {awaited} peers proved the secret at {where}; {missing} never showed up"
        super().__init__(message)

    @property
    def missing(self) -> int:
        return self.awaited - self.proven


class SecretNotProven(ChannelError):
    """What listens at `host:port` answered the nonce exchange without proving the deployment's secret."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        super().__init__(f"whatever listens at {host}:{port} does not hold this deployment's secret")


class RendezvousHungUp(ChannelError):
    """Every connection to `host:port` up to the deadline ended before rank 0 sent its nonce."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        super().__init__(f"the rendezvous at {host}:{port} hung up before it began")


class FrameTooLarge(ProtocolError):
    """A rendezvous store frame announced `key_bytes` + `value_bytes`, over the limits
    `max_key_bytes` + `max_value_bytes`; nothing of it was read."""

    def __init__(self, key_bytes: int, value_bytes: int, max_key_bytes: int, max_value_bytes: int) -> None:
        self.key_bytes, self.value_bytes = key_bytes, value_bytes
        self.max_key_bytes, self.max_value_bytes = max_key_bytes, max_value_bytes
        super().__init__(
            f"a rendezvous frame of {key_bytes} + {value_bytes} bytes "
            f"(at most {max_key_bytes} + {max_value_bytes})"
        )


# Why a relay store ended (`StoreEnded.why`).
FORMED = "formed"  # closed here: the group formed and its rendezvous is over
PEERS_DONE = "peers_done"  # every peer closed its end
PEER_FAILED = "peer_failed"  # a connection failed or sent what a store does not allow (`cause`)


class StoreEnded(ChannelError):
    """The relay store `name` (of `num_peers` connections) ended before the call: `why` is one of
    FORMED, PEERS_DONE, PEER_FAILED; `cause` is the failure, for PEER_FAILED."""

    def __init__(self, name: str, why: str, num_peers: int, cause: BaseException | None = None) -> None:
        self.name, self.why, self.num_peers, self.cause = name, why, num_peers, cause
        if why == FORMED:
            reason = "the group formed: its rendezvous is over"
        elif why == PEERS_DONE:
            reason = "the peer ended the rendezvous" if num_peers == 1 else "every peer ended the rendezvous"
        else:
            reason = f"the rendezvous with a peer failed: {cause}"
        super().__init__(f"{name}: {reason}")


class RankGroupNotFormed(ChannelError):
    """Rank `rank` of the `size`-rank group `name` at `host:port` did not form it within
    `timeout_s`: `cause` is what stopped it (a ChannelError of the rendezvous; the group's own
    errors, which Gloo and NCCL raise as RuntimeError, arrive as a plain ChannelError naming them)."""

    def __init__(
        self, name: str, rank: int, size: int, host: str, port: int, timeout_s: float, cause: ChannelError
    ) -> None:
        self.name, self.rank, self.size = name, rank, size
        self.host, self.port, self.timeout_s, self.cause = host, port, timeout_s, cause
        super().__init__(
            f"rank group {name} rank {rank} of {size} at {host}:{port} did not form within "
            f"{timeout_s:.1f} s: {cause}"
        )
