"""A TP group's ranks form their own process group through a proven rendezvous, relayed by rank 0.

The scenarios run each rank in a process of its own (forked from a server that imported torch once):
N ranks form and all-reduce; an outsider without the secret tries its luck while rank 0 listens; a
rank never comes. The relay store under it is checked on its own over socket pairs.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import struct
import threading
import time
from dataclasses import dataclass

import pytest
import torch

from tests.transfer.transfer_peer import SECRET, free_port
from transfer import ArgInvalid, ChannelError, ProtocolError, form_rank_group
from transfer.connect import (
    PEER_FAILED,
    PEERS_DONE,
    FrameTooLarge,
    PeersMissing,
    RankGroupNotFormed,
    StoreEnded,
)
from transfer.connect.auth import ControlAuth
from transfer.connect.relay_store import MAX_VALUE_BYTES, RelayStore
from transfer.connect.rendezvous import NONCE_BYTES, PROOF_S, RendezvousPort, join_peer

HOST = "127.0.0.1"
OUTSIDER_SECRET = b"not-this-deployment-secret-0123456"
SLACK_S = 20.0  # process start-up and CI noise: a generous bound, never a measurement


@dataclass(frozen=True)
class Outcome:
    """What one rank saw: the all-reduced sum of every rank's value, or the error that stopped it."""

    rank: int
    total: float | None
    error: Exception | None
    elapsed_s: float


def _rank_main(rank: int, size: int, port: int, timeout_s: float, results, device_type: str) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's few cores
    start = time.monotonic()
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    try:
        group = form_rank_group(
            name="tp-test",
            rank=rank,
            size=size,
            host=HOST,
            port=port,
            secret=SECRET,
            device=device,
            timeout_s=timeout_s,
        )
        value = torch.tensor([10.0 * (rank + 1)], device=device)
        group.allreduce([value]).wait()
        results.put(Outcome(rank, value.item(), None, time.monotonic() - start))
    except Exception as exc:  # crosses to the test process as itself, with its fields
        results.put(Outcome(rank, None, exc, time.monotonic() - start))


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # torch imported once, not once per rank
    return ctx


class Ranks:
    """Rank processes of one group at one port, started when asked; `outcomes` collects them all."""

    def __init__(self, size: int, timeout_s: float, device_type: str = "cpu") -> None:
        self.ctx = _context()
        self.size, self.timeout_s, self.port = size, timeout_s, free_port()
        self.device_type = device_type  # "cuda": rank r on cuda:r (NCCL)
        self.results = self.ctx.Queue()
        self.processes: list = []

    def start(self, *ranks: int) -> None:
        for rank in ranks:
            args = (rank, self.size, self.port, self.timeout_s, self.results, self.device_type)
            process = self.ctx.Process(target=_rank_main, args=args, daemon=True)
            process.start()
            self.processes.append(process)

    def outcomes(self) -> dict[int, Outcome]:
        try:
            got = [self.results.get(timeout=self.timeout_s + SLACK_S) for _ in self.processes]
        finally:
            for process in self.processes:
                process.join(5)
                if process.is_alive():
                    process.kill()
        return {outcome.rank: outcome for outcome in got}


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL)")


@pytest.mark.parametrize(
    "size, device_type",
    [(2, "cpu"), (3, "cpu"), pytest.param(2, "cuda", marks=[pytest.mark.gpu2, two_gpus])],
)
def test_ranks_form_a_group_and_all_reduce_to_the_sum(size, device_type):
    ranks = Ranks(size, timeout_s=20, device_type=device_type)
    ranks.start(*range(size))
    outcomes = ranks.outcomes()
    expected = sum(10.0 * (rank + 1) for rank in range(size))
    assert {rank: (o.total, o.error) for rank, o in outcomes.items()} == {
        rank: (expected, None) for rank in range(size)
    }


def _outsider_main(port: int, results) -> None:
    """Knock at rank 0's port twice without the secret: a proof under another secret, and a frame
    of store writes after junk in place of a proof. Both connections must be dropped."""
    seen = {}
    try:
        join_peer(HOST, port, ControlAuth(OUTSIDER_SECRET, "tp-test"), time.monotonic() + 5)
        seen["wrong secret"] = "joined"
    except ChannelError as exc:
        seen["wrong secret"] = f"refused: {exc}"
    with socket.create_connection((HOST, port), timeout=5) as sock:
        sock.settimeout(PROOF_S + 3)
        nonce = sock.recv(NONCE_BYTES)
        frame = struct.pack("<II", 6, 6) + b"rank_1" + b"forged"  # a store write, were it one
        try:
            sock.sendall(b"\x00" * 64 + frame * 100)
            seen["junk"] = "dropped" if _read_until_closed(sock) else "still open"
        except OSError:  # reset: dropped too
            seen["junk"] = "dropped"
    results.put((len(nonce), seen))


def _read_until_closed(sock: socket.socket) -> bool:
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_an_outsider_without_the_secret_is_dropped_and_the_group_still_forms():
    ranks = Ranks(3, timeout_s=20)
    ranks.start(0)  # rank 0 listens until ranks 1 and 2 proved the secret
    heard = ranks.ctx.Queue()
    outsider = ranks.ctx.Process(target=_outsider_main, args=(ranks.port, heard), daemon=True)
    outsider.start()
    nonce_bytes, seen = heard.get(timeout=30)
    outsider.join(5)
    ranks.start(1, 2)  # only now: the outsider was dropped while rank 0 still waited for them
    outcomes = ranks.outcomes()

    assert nonce_bytes == NONCE_BYTES
    assert seen["wrong secret"].startswith("refused")
    assert seen["junk"] == "dropped"
    assert {rank: (o.total, o.error) for rank, o in outcomes.items()} == {r: (60.0, None) for r in range(3)}


@pytest.mark.parametrize("missing", [0, 2])
def test_a_rank_that_never_comes_fails_the_others_within_the_timeout(missing):
    timeout_s = 2.0
    ranks = Ranks(3, timeout_s=timeout_s)
    ranks.start(*[rank for rank in range(3) if rank != missing])
    outcomes = ranks.outcomes()

    assert sorted(outcomes) == [rank for rank in range(3) if rank != missing]
    for outcome in outcomes.values():
        error = outcome.error
        assert isinstance(error, RankGroupNotFormed), outcome
        assert (error.name, error.rank, error.size) == ("tp-test", outcome.rank, 3)
        assert outcome.elapsed_s < timeout_s + SLACK_S
    causes = {rank: outcome.error.cause for rank, outcome in outcomes.items()}
    if missing == 0:  # the joiners looked for rank 0 until the deadline
        assert all(isinstance(cause, PeersMissing) for cause in causes.values()), causes
        assert {rank: (c.listening, c.awaited, c.proven) for rank, c in causes.items()} == {
            1: (False, 1, 0),
            2: (False, 1, 0),
        }
    else:  # rank 0 waited for ranks 1 and 2 and heard from rank 1 only
        assert isinstance(causes[0], PeersMissing), causes
        assert (causes[0].listening, causes[0].awaited, causes[0].proven, causes[0].missing) == (
            True,
            2,
            1,
            1,
        )


def test_a_group_of_one_rank_is_refused():
    with pytest.raises(ArgInvalid) as refused:
        form_rank_group(
            name="solo",
            rank=0,
            size=1,
            host=HOST,
            port=free_port(),
            secret=SECRET,
            device=torch.device("cpu"),
            timeout_s=1,
        )
    assert (refused.value.field, refused.value.value) == ("size", 1)


def test_rank_zero_hears_every_rank_that_connects_at_once():
    auth, port = ControlAuth(SECRET, "at-once"), free_port()
    rendezvous = RendezvousPort(HOST, port)
    deadline = time.monotonic() + 10
    joined: list[socket.socket] = []
    joiners = [
        threading.Thread(target=lambda: joined.append(join_peer(HOST, port, auth, deadline)))
        for _ in range(4)
    ]
    for joiner in joiners:
        joiner.start()
    accepted = rendezvous.accept_peers(auth, deadline, 4)
    for joiner in joiners:
        joiner.join(10)
    rendezvous.close()
    for sock in [*joined, *accepted]:
        sock.close()
    assert (len(accepted), len(joined)) == (4, 4)


# ---- the relay store on its own ---------------------------------------------------------------------


def relay_of_three(timeout_s: float = 2.0) -> tuple[RelayStore, RelayStore, RelayStore]:
    """(hub, client 1, client 2): the hub holds one socket pair's end per client."""
    hub_to_1, one = socket.socketpair()
    hub_to_2, two = socket.socketpair()
    hub = RelayStore([hub_to_1, hub_to_2], name="hub", timeout_s=timeout_s)
    return (
        hub,
        RelayStore([one], name="one", timeout_s=timeout_s),
        RelayStore([two], name="two", timeout_s=timeout_s),
    )


def test_a_set_at_one_rank_reaches_every_rank_through_the_hub():
    hub, one, two = relay_of_three()
    try:
        one.set("rank_1", b"address of 1")
        hub.set("rank_0", b"address of 0")
        assert two.get("rank_1") == b"address of 1"
        assert hub.get("rank_1") == b"address of 1"
        assert (one.get("rank_0"), two.get("rank_0")) == (b"address of 0", b"address of 0")
        assert one.num_keys() == two.num_keys() == hub.num_keys() == 2
    finally:
        for store in (one, two, hub):
            store.close()


def test_a_rank_done_with_the_store_does_not_end_it_for_the_others():
    hub, one, two = relay_of_three()
    try:
        one.set("rank_1", b"1")
        assert two.get("rank_1") == b"1"
        one.close()  # rank 1 formed and left
        two.set("rank_2", b"2")
        hub.set("rank_0", b"0")
        assert hub.get("rank_2") == b"2"
        assert two.get("rank_0") == b"0"
        assert hub.check(["rank_1", "rank_2"])  # still open at the hub
        two.close()
        with pytest.raises(StoreEnded) as ended:
            hub.get("never set")
        assert (ended.value.name, ended.value.why, ended.value.num_peers) == ("hub", PEERS_DONE, 2)
    finally:
        for store in (one, two, hub):
            store.close()


def test_an_over_limit_frame_ends_the_store_and_is_not_relayed():
    hub_to_raw, raw = socket.socketpair()
    hub_to_2, two_end = socket.socketpair()
    hub = RelayStore([hub_to_raw, hub_to_2], name="hub", timeout_s=5)
    two = RelayStore([two_end], name="two", timeout_s=5)
    try:
        raw.sendall(struct.pack("<II", 4, MAX_VALUE_BYTES + 1) + b"huge")
        with pytest.raises(StoreEnded) as failed:
            hub.get("rank_1")
        assert failed.value.why == PEER_FAILED
        frame = failed.value.cause
        assert isinstance(frame, FrameTooLarge) and isinstance(frame, ProtocolError)
        assert (frame.key_bytes, frame.value_bytes, frame.max_value_bytes) == (
            4,
            MAX_VALUE_BYTES + 1,
            MAX_VALUE_BYTES,
        )
        hub.close()  # the group cannot form: rank 0 gives up, and rank 2 hears it
        with pytest.raises(StoreEnded) as ended:
            two.get("huge")
        assert (ended.value.why, ended.value.num_peers) == (PEERS_DONE, 1)
        assert two.num_keys() == 0
    finally:
        raw.close()
        for store in (hub, two):
            store.close()
