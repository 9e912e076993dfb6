"""What prefill and decode workers share: one pool, the reference model, channels to peers, stats."""

from __future__ import annotations

import dataclasses
import socket
import threading

import torch

from distpool.configurator import PoolArgs, plan
from distpool.envelope import Envelope
from distpool.layout import layout_description
from distpool.pools import build_pool
from distpool.reference_model import ReferenceModel
from transfer.peers import RECEIVER_RANK, SENDER_RANK, PeerChannels


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class WorkerBase:
    role: str  # "prefill" | "decode": the disaggregation mode this worker's pool is planned for

    def __init__(
        self,
        *,
        name: str,
        model_config: str | dict,
        pool_args: PoolArgs,
        budget_bytes: int,
        device: str = "auto",
        seed: int = 0,
        transfer_timeout_s: float = 10.0,
        chunk_bytes: int = 32 << 20,
    ) -> None:
        self.name = name
        self.device = resolve_device(device)
        self.model = ReferenceModel(model_config, seed=seed, device=self.device)
        args = dataclasses.replace(pool_args, disaggregation_mode=self.role)
        self.plan = plan(self.model.spec, args, budget_bytes)
        self.pool = build_pool(self.plan, self.device)
        self._lock = threading.RLock()  # guards the pool and the model; never held across a transfer
        self.channels = PeerChannels(
            own_name=name,
            rank=SENDER_RANK if self.role == "prefill" else RECEIVER_RANK,
            fingerprint=self.pool.fingerprint,
            layout=layout_description(self.plan),
            device=self.device,
            timeout_s=transfer_timeout_s,
            chunk_bytes=chunk_bytes,
        )
        self._peak = {"pages": 0, "slots": 0}

    # ---- identity and wiring ------------------------------------------------------------------
    def ping(self) -> str:
        return self.name

    def node_id(self) -> str | None:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None

    def rendezvous_address(self) -> tuple[str, int]:
        """Host and a free port on this node for a channel's rendezvous store (prefill ends host it)."""
        import ray

        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        with socket.socket() as s:
            s.bind(("", 0))
            return host, s.getsockname()[1]

    def open_channel(self, peer: str, host: str, port: int) -> None:
        """Open (or rebuild) the channel to `peer`; the peer must do the same concurrently.
        The prefill end hosts the rendezvous store at `host:port`."""
        self.channels.open(peer, host=host, port=port)

    def channel_broken(self, peer: str) -> bool:
        return self.channels.broken(peer)

    # ---- requests this worker owns ------------------------------------------------------------
    def _pin_envelope(self, owned: dict, request_id: str) -> tuple[Envelope, torch.Tensor]:
        """Pin an owned request for a transfer; returns its envelope and byte ranges."""
        with self._lock:
            if request_id not in owned:
                raise ValueError(f"request {request_id!r} is not held by {self.name}")
            self.pool.pin(request_id)
            return self.pool.envelope(request_id), self.pool.envelope_ranges(request_id)

    def _free(self, owned: dict, request_id: str, *, pinned: bool = False) -> bool:
        """Forget an owned request and give its memory back. Returns whether it was owned."""
        with self._lock:
            if owned.pop(request_id, None) is None:
                return False
            if pinned:
                self.pool.unpin(request_id)
            self.pool.release(request_id)
            return True

    # ---- accounting ---------------------------------------------------------------------------
    def _note_peak(self) -> None:
        """Called after every reserve and decode step, so it reads only the cheap counts (`stats()`
        also plans a compaction to report what would be schedulable)."""
        counts = self.pool.allocator.counts()
        for name in self._peak:
            held = counts[f"{name}_used"] + counts[f"{name}_reserved"]
            self._peak[name] = max(self._peak[name], held)

    def stats(self) -> dict:
        with self._lock:
            self._note_peak()
            s = self.pool.stats()
            self.pool.check_invariants()
            return {
                "name": self.name,
                "role": self.role,
                "node_id": self.node_id(),
                "pages_used": s["pages_held"],
                "pages_peak": self._peak["pages"],
                "pages_capacity": s["pages_capacity"],
                "slots_used": s["slots_held"],
                "slots_peak": self._peak["slots"],
                "slots_capacity": s["slots_capacity"],
            }

    def shutdown(self) -> None:
        self.channels.close_all()
