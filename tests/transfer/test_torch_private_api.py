"""torch's private Gloo API that `transfer.connect.groups` uses holds on the installed torch, which must be a
release it was checked against (`CHECKED_TORCH_RELEASES`, what pyproject.toml declares)."""

from __future__ import annotations

import datetime
import threading
import time

import torch
import torch.distributed as dist

from tests.declared_versions import declared_range, range_of, release_of
from transfer.connect.groups import CHECKED_TORCH_RELEASES, close_links, gloo_group

GROUP_TIMEOUT = datetime.timedelta(seconds=30)


def test_the_installed_torch_is_a_release_the_private_api_was_checked_against():
    assert release_of(torch.__version__) in CHECKED_TORCH_RELEASES, (
        f"torch {torch.__version__} is installed; transfer/connect/groups.py's use of torch's private "
        f"Gloo API was checked against {CHECKED_TORCH_RELEASES}: check it on {torch.__version__} and add "
        f"it, or install torch{range_of(CHECKED_TORCH_RELEASES)}"
    )


def test_pyproject_declares_exactly_the_checked_releases():
    assert declared_range("torch") == range_of(CHECKED_TORCH_RELEASES)


def two_rank_gloo_groups(num_devices: int) -> list[dist.ProcessGroup]:
    store, groups = dist.HashStore(), [None, None]

    def form(rank: int) -> None:
        groups[rank] = gloo_group(store, rank, 2, GROUP_TIMEOUT, num_devices, loopback=True)

    threads = [threading.Thread(target=form, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert all(groups), "a two-rank Gloo group did not form"
    return groups


def test_a_gloo_group_takes_its_timeout_and_devices_and_closing_its_links_wakes_the_peer():
    groups = two_rank_gloo_groups(num_devices=2)
    assert groups[0].options._timeout == GROUP_TIMEOUT
    assert len(groups[0].options._devices) == 2
    outcome: dict[str, object] = {}

    def receive() -> None:  # rank 1 waits for a message rank 0 never sends (device 5 % 2 = 1)
        began = time.monotonic()
        try:
            groups[1].recv([torch.empty(1, dtype=torch.uint8)], 0, 5).wait()
            outcome["result"] = "received"
        except RuntimeError as exc:
            outcome["result"] = exc
        outcome["waited_s"] = time.monotonic() - began

    waiter = threading.Thread(target=receive)
    waiter.start()
    time.sleep(0.2)
    close_links(groups[0], peer_rank=1, num_devices=2)
    waiter.join(timeout=10)
    assert not waiter.is_alive(), "rank 1's receive still waits after rank 0 closed its links"
    assert isinstance(outcome["result"], RuntimeError)
    assert outcome["waited_s"] < 5  # woken by the close, not by the group's 30 s timeout
