"""The process groups of a channel or a TP group: how they are made, and how a Gloo group's links are closed.

Payload goes over Gloo (CPU arenas, `num_streams` devices: Gloo picks a message's connection by
tag % number of devices) or NCCL (CUDA arenas); control messages go over Gloo always (the payload
group itself on CPU, a one-device group beside NCCL's on CUDA; see `transfer.pair.control`).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from transfer.connect.rendezvous import delta
from transfer.wire import TAG_CLOSE

# torch's private API used here: `ProcessGroupGloo._Options` with its `_timeout` and `_devices`,
# `ProcessGroupNCCL.Options._timeout`, and a Gloo receive that times out closing its context's links
# (`close_links`). Checked against these (major, minor) releases, which pyproject.toml declares
# (tests/transfer/test_torch_private_api.py holds the two equal).
CHECKED_TORCH_RELEASES: tuple[tuple[int, int], ...] = ((2, 13),)

# A channel's waits carry its deadlines (work.wait(timeout)); NCCL's watchdog would tear the whole
# process down when its own timeout fires, so a channel's NCCL group gets one far beyond any deadline.
NCCL_WATCHDOG_OFF = datetime.timedelta(days=1)


def gloo_group(
    store: dist.Store,
    rank: int,
    size: int,
    timeout: datetime.timedelta,
    num_devices: int,
    *,
    loopback: bool,
) -> dist.ProcessGroup:
    """A `size`-rank Gloo group with `num_devices` connections per pair of ranks; `timeout` bounds
    its forming and every collective on it (on 127.0.0.1 when the ranks meet over loopback)."""
    gloo = dist.ProcessGroupGloo
    options = gloo._Options()
    options._timeout = timeout
    make_device = (
        (lambda: gloo.create_device(hostname="127.0.0.1")) if loopback else gloo.create_default_device
    )
    options._devices = [make_device() for _ in range(num_devices)]
    return gloo(store, rank, size, options)


def nccl_group(
    store: dist.Store, rank: int, size: int, device: torch.device, *, timeout: datetime.timedelta
) -> dist.ProcessGroup:
    """A `size`-rank NCCL group on `device`; NCCL's watchdog ends the process when a collective
    takes longer than `timeout`. It forms lazily: its first collective reads `store`."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    torch.cuda.set_device(device)
    return dist.ProcessGroupNCCL(store, rank, size, options)


def channel_groups(
    store: dist.Store,
    rank: int,
    device: torch.device,
    num_streams: int,
    *,
    timeout: datetime.timedelta,
    loopback: bool,
) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """A channel's two-rank groups: (payload, control). On CPU one Gloo group with `num_streams`
    connections carries both (control None: it shares the payload group). NCCL moves device memory
    only, in order: control needs its own link, a one-connection Gloo group formed under `control/`
    in `store` (an NCCL group whose control group fails to form is aborted before the error goes on).
    """
    if device.type != "cuda":
        return gloo_group(store, rank, 2, timeout, num_streams, loopback=loopback), None
    payload = nccl_group(store, rank, 2, device, timeout=NCCL_WATCHDOG_OFF)
    try:
        control = gloo_group(dist.PrefixStore("control/", store), rank, 2, timeout, 1, loopback=loopback)
    except Exception:
        destroy_group(payload, "nccl", 1 - rank, 1)
        raise
    return payload, control


def destroy_group(group: dist.ProcessGroup, backend: str, peer_rank: int, num_devices: int) -> None:
    """Take a channel's payload group down now: NCCL's aborted, Gloo's links closed."""
    if backend == "nccl":
        try:
            group.abort()
        except Exception:  # a group already poisoned by its peer may refuse to abort cleanly
            pass
    else:
        close_links(group, peer_rank, num_devices)


def close_links(group: dist.ProcessGroup, peer_rank: int, num_devices: int) -> None:
    """Close a Gloo group's connections on each of its devices now, waking whatever waits on them
    (here and at the peer). Gloo closes a context's connections when a wait on it times out, and
    offers no other way that wakes a blocked receive: a receive nothing is ever sent to, on each
    device, given a millisecond."""
    for device in range(num_devices):
        try:
            probe = torch.empty(1, dtype=torch.uint8)
            group.recv([probe], peer_rank, TAG_CLOSE + device).wait(delta(0.001))
        except Exception:  # the expected outcome, or a link that was closed already
            pass
