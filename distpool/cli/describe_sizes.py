"""Pool sizes as `distpool check` prints them: one labelled line per fact."""

from __future__ import annotations

from distpool.memory.sizing import GIB, PoolSizes, TpSizes


def _human_bytes(n: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def format_sizes(p: PoolSizes, tp: TpSizes | None = None) -> str:
    """`p` is one pool, or with `tp` (its `rank`) one rank's pool of a TP group: then the page and
    slot lines are the model's and the rank's parts follow."""
    s = p.summary() if tp is None else tp.summary()
    spec = p.spec
    sharded = tp is not None and tp.tp > 1
    lines = [
        f"model        {', '.join(spec.architectures) or spec.model_type} ({spec.source})",
        f"kind         {spec.kind}",
        f"layers       {spec.num_layers}: {spec.num_full_attention_layers} full attention, "
        f"{spec.num_sliding_window_layers} sliding window, {spec.num_mamba_layers} mamba",
        f"pool         {'unified arena' if p.unified else 'static pools'}, mode "
        f"{p.args.disaggregation_mode or 'colocated'}, budget {_human_bytes(p.budget_bytes)}"
        + (" per rank" if sharded else ""),
        f"page         {p.page_size} tokens = {s['page_bytes']} bytes ({_human_bytes(s['page_bytes'])})",
    ]
    if s["swa_page_bytes"]:
        lines.append(f"swa page     {s['swa_page_bytes']} bytes, window {spec.sliding_window} tokens")
    if s["slot_bytes"]:
        lines.append(f"slot         {s['slot_bytes']} bytes ({_human_bytes(s['slot_bytes'])}) per request")
    if sharded:
        lines += _rank_lines(s)
    lines += [
        f"pages        {s['num_pages']}" + (f" (+{s['num_swa_pages']} swa)" if p.num_swa_pages else ""),
        f"slots        {s['num_slots']}",
    ]
    if p.page_bytes == 0 and p.swa_page_bytes == 0:  # attention-free: memory does not grow with tokens
        lines.append(f"capacity     {s['num_slots']} requests of any length (state only, no KV)")
    else:
        lines.append(
            f"capacity     {s['requests_at_full_context']} requests at full context ({p.args.context_len} "
            f"tokens); max {s['max_total_tokens']} tokens with {s['max_running_requests']} requests running"
        )
    return "\n".join(lines)


def _rank_lines(s: dict) -> list[str]:
    lines = [
        f"tp           {s['tp']} ranks, each with a pool of its own; pages, slots and capacity are one rank's"
    ]
    for label, key in (("rank page", "rank_page_bytes"), ("rank swa pg", "rank_swa_page_bytes")):
        if s[key]:
            lines.append(f"{label:12} {s[key]} bytes ({_human_bytes(s[key])})")
    if s["rank_slot_bytes"]:
        lines.append(
            f"rank slot    {s['rank_slot_bytes']} bytes ({_human_bytes(s['rank_slot_bytes'])}) per request"
        )
    replicated = ", ".join(s["replicated"])
    lines.append(f"replicated   {replicated + ' (whole on every rank)' if replicated else 'nothing'}")
    return lines
