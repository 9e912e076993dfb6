"""A rendezvous port is held from the moment it is handed out until rank 0 listens on it (issue 34:
`free_port` closed the port it picked, and another process could bind it before rank 0 did)."""

from __future__ import annotations

import multiprocessing as mp
import socket
import struct
import threading
import time

import pytest

from transfer.connect import RendezvousHungUp, rendezvous
from transfer.connect.auth import ControlAuth
from transfer.connect.rendezvous import RendezvousPort, hold_socket, join_peer, reserve_port, reserve_socket

SECRET = b"s" * 32


@pytest.mark.parametrize("reuse", [False, True])
def test_a_reserved_port_cannot_be_taken_by_another_socket(reuse):
    port = reserve_port()
    with socket.socket() as intruder:
        intruder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, int(reuse))
        with pytest.raises(OSError):
            intruder.bind(("127.0.0.1", port))
    RendezvousPort("127.0.0.1", port).close()  # taken over, and given up


def connect_once(rendezvous: RendezvousPort, port: int, auth: ControlAuth) -> None:
    """One rendezvous on `port`: a peer joins and proves the secret; bytes pass both ways."""
    deadline, joined = time.monotonic() + 10, {}
    peer = threading.Thread(
        target=lambda: joined.setdefault("sock", join_peer("127.0.0.1", port, auth, deadline))
    )
    peer.start()
    accepted = rendezvous.accept_peer(auth, deadline)
    peer.join(10)
    with accepted, joined["sock"] as theirs:
        accepted.sendall(b"hello")
        assert theirs.recv(5) == b"hello"


def test_rank_0_listens_on_the_socket_reserved_for_it_on_every_rebuild():
    """Each rebuild listens on the reserved port again (a socket bound as port 0 would give its port
    back when it stops listening, and listen on another one the next time)."""
    port = reserve_port()
    rendezvous = RendezvousPort("127.0.0.1", port)  # takes the held socket: no EADDRINUSE
    auth = ControlAuth(SECRET, "reserved")
    try:
        for _ in range(3):  # formed, then rebuilt twice
            connect_once(rendezvous, port, auth)
            assert rendezvous._socket.getsockname()[1] == port
    finally:
        rendezvous.close()
    with socket.socket() as later:  # closed: the port is free again (past its connections' TIME_WAIT)
        later.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        later.bind(("127.0.0.1", port))


def _hold_and_rendezvous(listener: socket.socket, rounds: int) -> None:
    port = hold_socket(listener)
    rendezvous = RendezvousPort("127.0.0.1", port)
    auth = ControlAuth(SECRET, "handed")
    for _ in range(rounds):
        rendezvous.accept_peer(auth, time.monotonic() + 20).close()
    rendezvous.close()


def test_a_socket_handed_to_another_process_is_where_its_rank_0_listens():
    listener = reserve_socket()
    port = listener.getsockname()[1]
    process = mp.get_context("spawn").Process(target=_hold_and_rendezvous, args=(listener, 2), daemon=True)
    process.start()
    listener.close()  # the child holds its own copy: the port stays bound
    auth = ControlAuth(SECRET, "handed")
    try:
        for _ in range(2):
            join_peer("127.0.0.1", port, auth, time.monotonic() + 30).close()
    finally:
        process.join(30)
        process.kill()
    assert process.exitcode == 0


def _reset_first_then_rendezvous(port: int, resets: int, auth: ControlAuth) -> None:
    """Rank 0 that resets its first `resets` connections before saying anything (as a queued
    connection is reset when rank 0 stops listening), then rendezvouses properly."""
    with socket.create_server(("127.0.0.1", port)) as server:
        for _ in range(resets):
            conn, _ = server.accept()
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()  # linger 0: RST, not FIN
    RendezvousPort("127.0.0.1", port).accept_peer(auth, time.monotonic() + 10).close()


def test_a_connection_reset_before_rank_0_spoke_is_tried_again():
    """Regression: rank 1 connecting just as rank 0 stopped listening (between a first connect's
    last accept and a rebuild's listen) had its queued connection reset and gave up at once."""
    port = reserve_port()
    RendezvousPort("127.0.0.1", port).close()  # give the reservation back: the stand-in rank 0 binds it
    auth = ControlAuth(SECRET, "reset")
    rank0 = threading.Thread(target=_reset_first_then_rendezvous, args=(port, 2, auth))
    rank0.start()
    try:
        join_peer("127.0.0.1", port, auth, time.monotonic() + 10).close()
    finally:
        rank0.join(10)


class _SlowPauses:
    """`time` as the rendezvous sees it on a loaded machine: each pause between tries runs long."""

    monotonic = staticmethod(time.monotonic)

    @staticmethod
    def sleep(seconds: float) -> None:
        time.sleep(seconds + 0.6)


@pytest.mark.parametrize("pauses", ["prompt", "slow"])
def test_a_rank_0_that_only_resets_is_given_up_at_the_deadline(pauses, monkeypatch):
    # "slow": the deadline passes in the pause after a reset, before the next try (a clean-clone
    # run met it): a rank 0 that answered and hung up was reported as never having shown up.
    if pauses == "slow":
        monkeypatch.setattr(rendezvous, "time", _SlowPauses)
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        stop = threading.Event()

        def reset_all() -> None:
            server.settimeout(0.1)
            while not stop.is_set():
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.close()

        resetter = threading.Thread(target=reset_all)
        resetter.start()
        started = time.monotonic()
        try:
            with pytest.raises(RendezvousHungUp) as hung_up:
                join_peer("127.0.0.1", port, ControlAuth(SECRET, "reset"), started + 1.0)
            assert (hung_up.value.host, hung_up.value.port) == ("127.0.0.1", port)
        finally:
            stop.set()
            resetter.join(5)
        assert time.monotonic() - started < 5
