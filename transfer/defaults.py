"""Every default and limit of the transfer engine, in one place: `TransferOptions`, both channel ends,
the workers' channels and the command line read them from here and nowhere else.
"""

from __future__ import annotations

# Every transfer deadline, in seconds: long enough for the largest envelope over a slow link, short
# enough that a silent peer fails the request while a retry is still worth it.
DEFAULT_TIMEOUT_S = 10.0
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 0.1, 3600.0

# The pipelining unit and staging buffer size. Staging buffers grow to the messages actually sent,
# so the limit bounds what a sender may ask a receiver to allocate, never what an envelope costs.
DEFAULT_CHUNK_BYTES = 32 << 20
MAX_CHUNK_BYTES = 1 << 30

# Default zero-copy thresholds (see TransferOptions and `transfer.plans.messages.plan_messages`).
# Runs this long are sent as messages of their own, straight from and into the arenas, unless one
# staged batch of their chunk copies fewer bytes; the threshold doubles as what one more message
# costs in bytes copied. On this class of 2-core CPU machine a Gloo message costs about as much as copying
# 256 KiB (README, "Transfer data path"): 384 KiB pages scattered on both sides go as one message
# each, a 2 MiB half of an SSM state resharded across TP goes zero-copy beside its staged KV-head
# slices, and an envelope of small pieces still goes as a few staged chunks.
DIRECT_MIN_BYTES_CPU = 256 << 10
DIRECT_MIN_BYTES_CUDA = 16 << 20

# How long a reserved destination waits for its sender to begin (queueing and prefill included); the
# driver cancels it sooner when the request fails elsewhere.
EXPECT_WAIT_S = 120.0
# How long a receiver holds a header for a request nobody expects (yet) before refusing it: the
# channel waits meanwhile. Long enough to cover the destination's reservation, made while prefill
# computes (a busy actor answers within tens of milliseconds); a request whose reservation was
# refused or given up is refused at once instead.
UNEXPECTED_WAIT_S = 1.0
# Refusals a receiver remembers for headers still on their way (a few per request in flight).
MAX_REFUSALS_KEPT = 4096
# How long an idle receiver waits for the next bell before it looks again.
IDLE_WAIT_S = 3600.0
# The longest a failing receiver tries to tell the sender why, before it tears down.
TELL_PEER_S = 0.5
