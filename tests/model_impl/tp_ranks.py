"""The reference model's tensor-parallel scenario, and the Gloo group of ranks that runs it.

`serve` is what every TP size runs on its own rank pool: prefill a batch of prompts (one also
writing a checkpoint for the prefix cache), prefill a prompt after that cached prefix, decode, a
second turn for one request prefilled in place after its cached tokens, decode again: every cached
start reads K/V and state back from the rank's pool. `resume` decodes from prefilled rows written
into a fresh pool, as a transfer lands them. `cache_rows` reads what a pool holds for a request;
`shard_rows` cuts TP 1's rows to one rank's.

`run_ranks(tp, main, inputs, workdir)` runs `main(rank, group, inputs)` on each rank of a `tp`-rank
Gloo group over 127.0.0.1 with a finite timeout (a stuck peer fails the test, never hangs it). The
ranks are forked from a server that imported this module once, so a rank starts in well under a
second; results come back by file and a rank that raises fails the run with its traceback.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from distpool.memory.arena_pool import ArenaPool
from distpool.model.hf_config import spec_from_hf
from distpool.model.shard import RankShard
from distpool.model_impl.prefill_job import PrefillJob
from distpool.model_impl.reference.configs import REFERENCE_HYBRID_CONFIG
from distpool.model_impl.reference.model import ReferenceModel
from distpool.model_impl.reference.tensor_parallel import held_ids
from tests.factories import make_rank_pool
from transfer.connect.groups import gloo_group
from transfer.connect.rendezvous import reserve_socket

SPEC = spec_from_hf(REFERENCE_HYBRID_CONFIG)  # 4 query, 2 KV, 4 Mamba heads; 2 groups
STEPS = 5  # decode steps after each prefill
BUDGET_BYTES = 128 << 10  # per rank pool: the three requests with room to spare
GROUP_TIMEOUT = datetime.timedelta(seconds=30)
RUN_TIMEOUT_S = 120.0


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(SPEC.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


CHECKPOINT_PAGES = 3  # "c" leaves a checkpoint after its first 3 pages (make_rank_pool: 4 tokens each)
PROMPTS = {"a": tokens(5, 1), "b": tokens(11, 2), "c": tokens(17, 3)}
PROMPTS["d"] = PROMPTS["c"][:14] + tokens(5, 5)  # prefilled after "c"'s cached first 3 pages
TURN = tokens(4, 4)  # the second turn of "a"

Rows = dict[tuple[int, str], torch.Tensor]  # (layer, tensor name) -> rows, see `cache_rows`


@dataclass
class Served:
    """One request: every token of its sequence (prompts and generated, in order) and where in it
    the generated ones are."""

    tokens: list[int]
    generated: list[int]  # positions in `tokens`

    @property
    def generated_tokens(self) -> list[int]:
        return [self.tokens[i] for i in self.generated]


@dataclass(frozen=True)
class Run:
    """What one rank (or TP 1) saw in `serve`: its requests, and their rows after the first
    prefill and at the end."""

    served: dict[str, Served]
    prefilled_rows: dict[str, Rows]
    final_rows: dict[str, Rows]

    @property
    def first_tokens(self) -> dict[str, int]:
        return {rid: one.generated_tokens[0] for rid, one in self.served.items()}


def rank_pool(rank_shard: RankShard) -> ArenaPool:
    return make_rank_pool(rank_shard, unified=True, budget_bytes=BUDGET_BYTES, prefix_cache=True)


def cache_rows(model: ReferenceModel, pool: ArenaPool, request_id: str) -> Rows:
    """Copies of what `pool` holds for the request: K and V of its tokens, (num_tokens, kv_heads,
    head_dim), per attention layer; its state, (1, *state shape), per Mamba layer and tensor. Axis
    1 of each is the tensor's shard axis."""
    spec, rows = model.spec, {}
    num_tokens, pages = pool.num_tokens(request_id), pool.page_ids(request_id)
    for layer in spec.full_attention_layers:
        for name, cache in zip("kv", pool.kv_view(layer), strict=True):
            rows[layer, name] = cache[pages].flatten(0, 1)[:num_tokens].clone()
    slot = pool.slot_id(request_id)
    for layer in spec.mamba_layers:
        for tensor, view in zip(spec.mamba.tensors, pool.state_view(layer), strict=True):
            rows[layer, tensor.name] = view[slot][None].clone()
    return rows


def write_rows(pool: ArenaPool, request_id: str, rows: Rows) -> None:
    """Put `rows` (as `cache_rows` reads them, in the pool's own shapes) into the request's pages
    and slot."""
    pages, slot = pool.page_ids(request_id), pool.slot_id(request_id)
    names = [tensor.name for tensor in pool.sizes.spec.mamba.tensors]
    for (layer, name), value in rows.items():
        if name in ("k", "v"):
            at = torch.arange(value.shape[0])
            pool.kv_view(layer)["kv".index(name)][pages[at // pool.page_size], at % pool.page_size] = value
        else:
            pool.state_view(layer)[names.index(name)][slot] = value[0]


def shard_rows(rank_shard: RankShard, rows: Rows) -> Rows:
    """The rank's part of unsharded rows."""
    return {key: value.index_select(1, held_ids(rank_shard.tensor(key[1]))) for key, value in rows.items()}


def decode(model: ReferenceModel, pool: ArenaPool, served: dict[str, Served], steps: int) -> None:
    """`steps` greedy steps of every request in `served`, batched, appended to their tokens."""
    ids = list(served)
    for _ in range(steps):
        for rid in ids:
            pool.extend(rid, 1)
        step = model.decode_step(pool, ids, [served[rid].tokens[-1] for rid in ids])
        for rid, token in zip(ids, step, strict=True):
            served[rid].generated.append(len(served[rid].tokens))
            served[rid].tokens.append(token)


def serve(model: ReferenceModel) -> Run:
    """ "a", "b", "c" prefilled as one batch ("c" leaving a checkpoint), then "d" after "c"'s cached
    pages; all decoded; then TURN for "a", prefilled in place after its cached tokens, and every
    request decoded again."""
    pool, first = rank_pool(model.tp.shard), ["a", "b", "c"]
    for rid in first:
        pool.reserve(rid, len(PROMPTS[rid]))
    handle, slot = pool.prefix_cache.take_checkpoint()
    snapshot = (CHECKPOINT_PAGES * pool.page_size, slot)
    jobs = [PrefillJob(rid, PROMPTS[rid], snapshot=snapshot if rid == "c" else None) for rid in first]
    done = model.prefill(pool, jobs)
    pool.prefix_cache.cache_request("c", PROMPTS["c"], {CHECKPOINT_PAGES: handle})
    match = pool.prefix_cache.match(PROMPTS["d"])
    assert (match.num_tokens, match.checkpoint) == (CHECKPOINT_PAGES * pool.page_size, handle)
    pool.reserve("d", len(PROMPTS["d"]), prefix=match)
    checkpoint = pool.prefix_cache.checkpoint_slot(handle)
    done += model.prefill(
        pool, [PrefillJob("d", PROMPTS["d"], cached=match.num_tokens, checkpoint_slot=checkpoint)]
    )
    served = {
        d.request_id: Served([*PROMPTS[d.request_id], d.first_token], [len(PROMPTS[d.request_id])])
        for d in done
    }
    prefilled_rows = {rid: cache_rows(model, pool, rid) for rid in PROMPTS}
    decode(model, pool, served, STEPS)
    cached, sequence = pool.num_tokens("a"), served["a"].tokens + TURN
    job = PrefillJob("a", sequence, cached=cached, checkpoint_slot=pool.slot_id("a"))
    pool.extend("a", len(sequence) - cached)
    (again,) = model.prefill(pool, [job])
    served["a"].tokens[:] = [*sequence, again.first_token]
    served["a"].generated.append(len(sequence))
    decode(model, pool, served, STEPS)
    final_rows = {rid: cache_rows(model, pool, rid) for rid in PROMPTS}
    pool.check_invariants()
    return Run(served=served, prefilled_rows=prefilled_rows, final_rows=final_rows)


def resume(model: ReferenceModel, rows: dict[str, Rows], firsts: dict[str, int]) -> dict[str, list[int]]:
    """Decode PROMPTS from their prefilled `rows` written into a fresh pool (the model's rank's
    shapes), as a transfer lands them: each request's first token and the STEPS after it."""
    pool = rank_pool(model.tp.shard)
    served = {}
    for rid, prompt in PROMPTS.items():
        pool.reserve(rid, len(prompt))
        write_rows(pool, rid, rows[rid])
        served[rid] = Served(tokens=[*prompt, firsts[rid]], generated=[len(prompt)])
    decode(model, pool, served, STEPS)
    pool.check_invariants()
    return {rid: one.generated_tokens for rid, one in served.items()}


def rank_main(
    rank: int, group: dist.ProcessGroup, inputs: tuple[int, Run]
) -> tuple[Run, dict[str, list[int]]]:
    """One rank of TP `tp`: `serve` on its own pool, then `resume` from its shard of TP 1's prefill."""
    tp, tp1 = inputs
    model = ReferenceModel.for_rank(SPEC, tp=tp, rank=rank, group=group)
    mine = {rid: shard_rows(model.tp.shard, rows) for rid, rows in tp1.prefilled_rows.items()}
    return serve(model), resume(model, mine, tp1.first_tokens)


# ---- the ranks -----------------------------------------------------------------------------------
def run_ranks(
    tp: int, main: Callable[[int, dist.ProcessGroup, Any], Any], inputs: Any, workdir: Path
) -> list[Any]:
    """`main(rank, group, inputs)` on each rank of a `tp`-rank Gloo group, in processes of their
    own: the results, in rank order. `main` must be a module-level function."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # torch and the model imported once, not once per rank
    # The store's port, bound here and handed to rank 0, which listens on it: never free in between.
    listener = reserve_socket()
    port = listener.getsockname()[1]
    given, outs = workdir / "inputs.pt", [workdir / f"rank{rank}.pt" for rank in range(tp)]
    torch.save(inputs, given)  # by file: no shared-memory handles through the pipe
    processes = [
        ctx.Process(
            target=_rank_main,
            args=(rank, tp, port, listener if rank == 0 else None, main, given, outs[rank]),
            daemon=True,
        )
        for rank in range(tp)
    ]
    with listener:  # each rank 0 holds its own copy once started
        for process in processes:
            process.start()
    for process in processes:
        process.join(RUN_TIMEOUT_S)
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    results = []
    for rank, (process, out) in enumerate(zip(processes, outs, strict=True)):
        if not out.exists():
            raise AssertionError(f"rank {rank} of TP {tp} left no result (exit code {process.exitcode})")
        ok, value = torch.load(out, weights_only=False)
        if not ok:
            raise AssertionError(f"rank {rank} of TP {tp} failed:\n{value}")
        results.append(value)
    return results


def _rank_main(
    rank: int, tp: int, port: int, listener: socket.socket | None, main: Callable, given: Path, out: Path
) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's few cores
    try:
        inputs = torch.load(given, weights_only=False)
        fd = listener.detach() if listener is not None else None  # the store owns it from here
        store = dist.TCPStore(
            "127.0.0.1", port, tp, is_master=rank == 0, timeout=GROUP_TIMEOUT, master_listen_fd=fd
        )
        group = gloo_group(store, rank, tp, GROUP_TIMEOUT, 1, loopback=True)
        result = (True, main(rank, group, inputs))
    except BaseException:
        result = (False, traceback.format_exc())
    torch.save(result, out)
