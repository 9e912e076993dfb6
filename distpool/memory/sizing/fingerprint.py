"""The layout fingerprint: a hash of every field that decides where a byte of an envelope lives.

Prefill and decode pools must agree on it exactly; the transfer handshake compares the description
field by field so that a mismatch names what differs.
"""

from __future__ import annotations

import hashlib
import json

from distpool.memory.sizing.layout import ALIGN_BYTES, KV_ORDER, SLOT_ORDER
from distpool.memory.sizing.sizing import PoolSizes


def layout_description(sizes: PoolSizes) -> dict[str, object]:
    """Every field that decides where a byte of an envelope lives, as plain JSON values."""
    return {
        **json.loads(json.dumps(sizes.spec.layout_fields(), default=str)),
        "page_size": sizes.page_size,
        "unified": sizes.unified,
        "page_stride_bytes": sizes.page_stride_bytes,
        "swa_page_stride_bytes": sizes.swa_page_stride_bytes,
        "slot_stride_bytes": sizes.slot_stride_bytes,
        "align_bytes": ALIGN_BYTES,
        "kv_order": list(KV_ORDER),
        "slot_order": list(SLOT_ORDER),
    }


def layout_fingerprint(sizes: PoolSizes) -> str:
    blob = json.dumps(layout_description(sizes), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
