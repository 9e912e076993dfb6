"""What one end of a channel tells the other about its tensor-parallel group in the handshake.

Two ranks of groups with the same TP size hold the same shapes, so their pool layouts (and layout
fingerprints) must agree as they always did. Across TP sizes the per-rank layouts differ by
design; what must agree is the unsharded model layout: every layout field of the model (with the
run's dtypes), its shard table, the page size and the band kind. `TpEnd.hello()` carries that with
the TP size and rank; the handshake (`transfer.pair.handshake`) compares it and checks that the pair can
be resharded.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from distpool.memory.sizing.layout import ALIGN_BYTES, KV_ORDER, SLOT_ORDER
from distpool.memory.sizing.sizing import PoolSizes
from distpool.model.shard import RankShard


@dataclass(frozen=True)
class TpEnd:
    """One rank's TP layout, as its channels present it: its shard and the unsharded layout."""

    shard: RankShard
    model: dict[str, Any]  # plain JSON values: what every rank of both groups must share

    @classmethod
    def of(cls, sizes: PoolSizes, shard: RankShard) -> TpEnd:
        """The end of the rank whose pool `sizes` describes (sized for `shard.spec`)."""
        args = sizes.args
        model = shard.model.with_dtypes(
            kv_dtype=args.kv_dtype, conv_dtype=args.conv_dtype, ssm_dtype=args.ssm_dtype
        )
        fields = {
            **model.layout_fields(),
            "shard_table": dataclasses.asdict(model.shard_table),
            "page_size": sizes.page_size,
            "unified": sizes.unified,
            "align_bytes": ALIGN_BYTES,
            "kv_order": list(KV_ORDER),
            "slot_order": list(SLOT_ORDER),
        }
        return cls(shard=shard, model=json.loads(json.dumps(fields, default=str)))

    def hello(self) -> dict[str, Any]:
        return {"size": self.shard.tp, "rank": self.shard.rank, "model": self.model}
