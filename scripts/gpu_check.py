"""GPU check on cuda:0 (and more GPUs where present): six checks, one JSON file, within 5 minutes.

Each check records wall_s and its figures; a failing one records {"ok": false, "error": ...} and the
others still run. Exit 0 when every check that ran passed (or there is no GPU: {"gpus": 0, "skipped":
why}), else 1. Run it through scripts/gpu_check.sh [--json PATH] (default out/gpu_check.json).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from distpool.memory.arena_pool import ArenaPool, build_pool  # noqa: E402
from distpool.memory.pool import DoesNotFit  # noqa: E402
from distpool.memory.sizing import PoolArgs, size_pools  # noqa: E402
from distpool.model.hf_config import spec_from_hf  # noqa: E402
from distpool.model.presets import resolve_model  # noqa: E402
from distpool.model_impl.reference.configs import REFERENCE_HYBRID_CONFIG  # noqa: E402
from distpool.model_impl.reference.model import ReferenceModel  # noqa: E402
from transfer.ends.staging import gather, scatter  # noqa: E402

# ---- parameters ---------------------------------------------------------------------------------
SEED = 0
DEADLINE_S = 280.0  # gpu_check.sh kills everything at 300 s; subprocess checks get what is left
MIB, GIB = 1 << 20, 1 << 30
# name -> (config, budget bytes, context_len): arenas that requests of context_len fill, so holes matter
POOL_CASES = {
    "reference-hybrid": (REFERENCE_HYBRID_CONFIG, 64 * MIB, 4096),
    "nemotron-h-8b": (resolve_model("nemotron-h-8b"), 1 * GIB, 4096),  # ~97 MiB slots, 256 KiB pages
}
TOKEN_PROMPT_LENS, TOKEN_MAX_NEW, TOKEN_POOL_BYTES = (3, 17, 40, 97), 12, 16 * MIB
GATHER_PIECE_BYTES, TIMING_REPEATS = 64 * 1024, 5  # 4096 pieces by default: 256 MiB; median of 5 runs
PD_ARGS = "--model nemotron-h-8b --model-impl synthetic --device cuda --requests 6 --memory-gib 4".split()
PD_FIELDS = ("completed", "verified_envelopes", "corrupt_envelopes", "transfer_gbps", "link_utilization")
PD_TIMEOUT_S, GPU2_TIMEOUT_S = 100, 150
# The reference model served at TP 2 -> 1 and 1 -> 2 (a GPU per rank: three), with token parity.
TP_ARGS = "--model-impl reference --device cuda --requests 8 --max-new-tokens 8 --parity-sample 8".split()
TP_SIZES, TP_TIMEOUT_S = ((2, 1), (1, 2)), 60
TP_FIELDS = ("completed", "parity_checked", "parity_mismatches", "parity_near_ties")
MIN_SUBPROCESS_S = 20  # a subprocess check with less time left fails as out of time
# deployment.py gives each worker a GPU of its own only when there is one GPU per worker.
ONE_GPU_REASON = "needs two GPUs: on one, both workers share cuda:0 and NCCL refuses two ranks on one GPU"
_START = time.monotonic()


class CheckFailed(Exception):
    """A check that ran and found something wrong; `figures` are recorded beside the error."""

    def __init__(self, message: str, figures: dict | None = None) -> None:
        super().__init__(message)
        self.figures = figures or {}


def _timed(fn: Callable[[], object], device: str) -> float:
    """Wall seconds of `fn`, with the device's queued work drained before and after."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda _: None)
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def _request_views(pool: ArenaPool, request_id: str) -> Iterator[tuple[str, torch.Tensor, object]]:
    """(key, view, index) for every tensor of the request, from its physical ids as they are now."""
    spec = pool.sizes.spec
    pages = pool.page_ids(request_id).to(pool.buffer.device)
    for layer in spec.full_attention_layers:
        for name, view in zip("kv", pool.kv_view(layer), strict=True):  # (pages, page_size, heads, dim)
            yield f"{request_id}/{layer}/{name}", view, pages
    for layer in spec.mamba_layers:  # state tensors: (num_slots, *shape)
        for tensor, view in zip(spec.mamba.tensors, pool.state_view(layer), strict=True):
            yield f"{request_id}/{layer}/{tensor.name}", view, pool.slot_id(request_id)


def _patterns(pool: ArenaPool, request_ids: list[str], verify_when: str | None = None) -> None:
    """Write each request's seeded patterns (verify_when None), or check that they are still there."""
    for rid in request_ids:
        for key, view, index in _request_views(pool, rid):
            g = torch.Generator(device=view.device).manual_seed(zlib.crc32(key.encode()))
            expected = torch.randn(view[index].shape, generator=g, device=view.device).to(view.dtype)
            if verify_when is None:
                view[index] = expected
            elif not torch.equal(view[index], expected):
                raise CheckFailed(f"{key}: bytes changed {verify_when}")


def _timed_compaction(pool: ArenaPool, device: str, compact: Callable[[], object]) -> dict:
    moved = pool.compactions()[1]
    seconds = _timed(compact, device)
    nbytes = pool.compactions()[1] - moved
    return {"bytes": nbytes, "seconds": round(seconds, 6), "gbps": round(nbytes / seconds / 1e9, 3)}


def pool_scenario(config: Path, budget_bytes: int, context_len: int, device: str) -> dict:
    """Fill a unified pool in batches, release every other request, reserve one request that fits
    only after compaction, then release more and compact(); patterns are checked after each move."""
    args = PoolArgs(enable_unified_memory=True, context_len=context_len)
    sizes = size_pools(spec_from_hf(config), args, budget_bytes)
    pool = build_pool(sizes, device)
    rng = np.random.default_rng(SEED)
    held, batch_size = [], 16
    while batch_size:  # all-or-nothing batches, halved until even one request does not fit
        batch = [(f"r{len(held) + i}", int(rng.integers(1, context_len + 1))) for i in range(batch_size)]
        try:
            pool.reserve_batch(batch)
            held += [rid for rid, _ in batch]
        except DoesNotFit:
            batch_size //= 2
    pool.check_invariants()
    _patterns(pool, held)
    survivors = held[0::2]
    pool.release_batch(held[1::2])
    while True:  # one page more than fits now; release more until compaction would make it fit
        big_tokens = (pool.available()["pages"] + 1) * pool.page_size
        if pool.can_reserve(big_tokens, compact=True):
            break
        if len(survivors) <= 1:
            raise CheckFailed("no request size needed compaction: the scenario proves nothing")
        pool.release(survivors.pop())
    assert not pool.can_reserve(big_tokens), "the big request was sized to not fit without compaction"
    before = [(pool.page_ids(rid).tolist(), pool.slot_id(rid)) for rid in survivors]
    reserve = _timed_compaction(pool, device, lambda: pool.reserve("big", big_tokens, compact=True))
    pool.check_invariants()
    _patterns(pool, survivors, "across reserve(compact=True)")
    after = [(pool.page_ids(rid).tolist(), pool.slot_id(rid)) for rid in survivors]
    moved = sum(a != b for a, b in zip(before, after, strict=True))
    if moved == 0:
        raise CheckFailed("the compaction moved no patterned request: the scenario proves nothing")
    pool.release_batch(survivors[1::2])  # more holes, then an explicit compact()
    survivors = survivors[0::2]
    explicit = _timed_compaction(pool, device, pool.compact)
    pool.check_invariants()
    _patterns(pool, survivors, "across compact()")
    figures = {"arena_mib": sizes.arena_bytes // MIB, "requests": len(held), "big_request_tokens": big_tokens}
    return figures | {"requests_moved": moved, "reserve_compaction": reserve, "compact": explicit}


def check_pool(device: str, cases: dict[str, tuple[Path, int, int]] = POOL_CASES) -> dict:
    return {name: pool_scenario(*case, device) for name, case in cases.items()}


def check_reference_tokens(device: str, reference_device: str = "cpu") -> dict:
    """The same seeded model and prompts on both devices must generate the same tokens."""
    spec = spec_from_hf(REFERENCE_HYBRID_CONFIG)
    sizes = size_pools(spec, PoolArgs(enable_unified_memory=True), TOKEN_POOL_BYTES)
    rng = np.random.default_rng(SEED)
    prompts = [rng.integers(0, spec.vocab_size, n).tolist() for n in TOKEN_PROMPT_LENS]
    outputs = [
        ReferenceModel(spec, seed=SEED, device=dev).generate(build_pool(sizes, dev), prompts, TOKEN_MAX_NEW)
        for dev in (reference_device, device)
    ]
    mismatches = [i for i, (a, b) in enumerate(zip(*outputs, strict=True)) if a != b]
    figures = {"prompt_lens": list(TOKEN_PROMPT_LENS), "mismatched_prompts": len(mismatches)}
    if mismatches:
        raise CheckFailed(f"prompts {mismatches} generated other tokens on {device}", figures)
    return figures


def check_staged_gather_scatter(device: str, arena_bytes: int = 1 * GIB, num_pieces: int = 4096) -> dict:
    """Pieces at random places gathered into one buffer and scattered to other (disjoint) places;
    GB/s of each next to one contiguous copy of the same bytes (median of TIMING_REPEATS)."""
    piece_bytes = GATHER_PIECE_BYTES
    num_positions = arena_bytes // piece_bytes
    if 2 * num_pieces > num_positions:
        raise ValueError(f"{2 * num_pieces} pieces need more than the arena's {num_positions} positions")
    src_pos, dst_pos = np.split(np.random.default_rng(SEED).permutation(num_positions)[: 2 * num_pieces], 2)
    nbytes = np.full(num_pieces, piece_bytes, dtype=np.int64)
    g = torch.Generator(device=device).manual_seed(SEED)
    arena = torch.randint(0, 256, (arena_bytes,), dtype=torch.uint8, device=device, generator=g)
    rows = arena.view(-1, piece_bytes)  # (num_positions, piece_bytes): an independent path to the bytes
    expected = rows[torch.from_numpy(src_pos).to(device)].flatten()
    # zeroed: freed memory of an earlier run may already hold exactly these bytes
    packed, copy_dst = torch.zeros_like(expected), torch.empty_like(expected)
    runs = {
        "gather": lambda: gather(arena, src_pos * piece_bytes, nbytes, packed),
        "scatter": lambda: scatter(packed, dst_pos * piece_bytes, nbytes, arena),
        "contiguous_copy": lambda: copy_dst.copy_(packed),
    }
    gbps = {}
    for name, run in runs.items():  # in this order: scatter sends what gather packed
        run()  # warm-up: caching allocator, kernels
        seconds = float(np.median([_timed(run, device) for _ in range(TIMING_REPEATS)]))
        gbps[f"{name}_gbps"] = round(expected.numel() / seconds / 1e9, 3)
        if name == "gather" and not torch.equal(packed, expected):
            raise CheckFailed("gather: the packed buffer differs from the source pieces")
    for what, pos in (("destination", dst_pos), ("source", src_pos)):  # the source must be untouched
        if not torch.equal(rows[torch.from_numpy(pos).to(device)].flatten(), expected):
            raise CheckFailed(f"scatter: the {what} pieces differ from the packed buffer")
    figures = {"arena_mib": arena_bytes // MIB, "pieces": num_pieces, "bytes": expected.numel(), **gbps}
    for name in ("gather", "scatter"):
        figures[f"{name}_vs_copy"] = round(gbps[f"{name}_gbps"] / gbps["contiguous_copy_gbps"], 3)
    return figures


def _run_subprocess(cmd: list[str], cap_s: float) -> tuple[int, str]:
    """(exit status, output) of `cmd`; its process group dies after min(cap_s, time left)."""
    timeout = min(cap_s, DEADLINE_S - (time.monotonic() - _START) - 5)
    if timeout < MIN_SUBPROCESS_S:
        raise CheckFailed(f"out of time: {timeout:.0f} s left before the {DEADLINE_S:.0f} s deadline")
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        tail = proc.communicate()[0][-2000:]
        raise CheckFailed(f"timed out after {timeout:.0f} s", {"output_tail": tail}) from None
    return proc.returncode, output


def check_pd_run(num_gpus: int) -> dict:
    if num_gpus < 2:
        return {"skipped": ONE_GPU_REASON}
    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "run.json"
        cmd = [sys.executable, "-m", "distpool", "run", *PD_ARGS, "--json", str(report_path)]
        status, output = _run_subprocess(cmd, PD_TIMEOUT_S)
        report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    figures = {"exit_status": status, **{name: report.get(name) for name in PD_FIELDS}}
    if status != 0:
        raise CheckFailed(f"distpool run exited {status}: {output[-1500:]}", figures)
    return figures


def check_tp_runs(num_gpus: int) -> dict:
    """The reference model served across TP sizes on NCCL: every request's tokens those of TP 1."""
    if num_gpus < 3:
        return {"skipped": "needs three GPUs: one per rank of a prefill TP 2 -> decode TP 1 run"}
    figures: dict = {}
    for prefill_tp, decode_tp in TP_SIZES:
        sizes = f"tp{prefill_tp}to{decode_tp}"
        with tempfile.TemporaryDirectory() as tmp:
            report_path = Path(tmp) / "run.json"
            tp = ["--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp)]
            cmd = [sys.executable, "-m", "distpool", "run", *TP_ARGS, *tp, "--json", str(report_path)]
            status, output = _run_subprocess(cmd, TP_TIMEOUT_S)
            report = json.loads(report_path.read_text()) if report_path.is_file() else {}
        figures |= {f"{sizes}_exit_status": status} | {f"{sizes}_{k}": report.get(k) for k in TP_FIELDS}
        if status != 0:
            raise CheckFailed(f"distpool run {' '.join(tp)} exited {status}: {output[-1500:]}", figures)
    return figures


def check_gpu2_tests(num_gpus: int) -> dict:
    if num_gpus < 2:
        return {"skipped": "needs two GPUs"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu2", "tests"]
    status, output = _run_subprocess(cmd, GPU2_TIMEOUT_S)
    last = output.strip().rsplit("\n", 1)[-1]  # "3 passed, 1 failed, 450 deselected in 9.1s"
    figures = {"exit_status": status} | {f"tests_{w}": 0 for w in ("passed", "failed", "error", "skipped")}
    figures |= {f"tests_{w}": int(n) for n, w in re.findall(r"(\d+) (passed|failed|error|skipped)", last)}
    if status != 0 or figures["tests_passed"] == 0:
        raise CheckFailed(f"pytest -m gpu2 exited {status}: {output[-1500:]}", figures)
    return figures


def run_check(check: Callable[[], dict]) -> dict:
    """Run one check: its figures with ok and wall_s, or why it failed; skipped checks carry no ok."""
    start = time.perf_counter()
    try:
        figures = check()
        outcome = figures if "skipped" in figures else {"ok": True, **figures}
    except CheckFailed as exc:
        outcome = {"ok": False, "error": str(exc), **exc.figures}
    except Exception as exc:  # a check that crashed must not stop the others
        outcome = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return {**outcome, "wall_s": round(time.perf_counter() - start, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=str(REPO / "out" / "gpu_check.json"), help="results file")
    path = Path(parser.parse_args(argv).json)
    path.parent.mkdir(parents=True, exist_ok=True)
    why = "no CUDA device visible" if torch.version.cuda else f"torch {torch.__version__} is a CPU-only build"
    if not torch.cuda.is_available():
        path.write_text(json.dumps({"gpus": 0, "skipped": why}, indent=2))
        print(f"gpu_check: no GPU ({why}); nothing to check. Wrote {path}")
        return 0
    num_gpus = torch.cuda.device_count()
    names = [torch.cuda.get_device_name(i) for i in range(num_gpus)]
    result = {"gpus": num_gpus, "gpu_names": names, "torch": torch.__version__, "cuda": torch.version.cuda}
    print(f"gpu_check: {num_gpus} GPU(s) {names}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    checks: dict[str, Callable[[], dict]] = {
        "pool_on_cuda": lambda: check_pool("cuda:0"),
        "reference_tokens_cuda_equal_cpu": lambda: check_reference_tokens("cuda:0"),
        "staged_gather_scatter": lambda: check_staged_gather_scatter("cuda:0"),
        "pd_run_synthetic_cuda": lambda: check_pd_run(num_gpus),
        "gpu2_tests": lambda: check_gpu2_tests(num_gpus),
        "tp_runs_reference_nccl": lambda: check_tp_runs(num_gpus),
    }
    for name, check in checks.items():
        outcome = result.setdefault("checks", {})[name] = run_check(check)
        status = "skipped" if "skipped" in outcome else ("ok" if outcome["ok"] else "FAILED")
        shown = {k: v for k, v in outcome.items() if k not in ("ok", "wall_s", "output_tail")}
        print(f"{name:<33} {status:<7} {outcome['wall_s']:6.1f} s  {json.dumps(shown)[:400]}", flush=True)
        path.write_text(json.dumps(result, indent=2))  # on disk as each check ends, in case of a kill
    failed = [name for name, outcome in result["checks"].items() if outcome.get("ok") is False]
    result |= {"ok": not failed, "wall_s": round(time.monotonic() - _START, 1)}
    path.write_text(json.dumps(result, indent=2))
    print(f"gpu_check: {'FAILED: ' + ', '.join(failed) if failed else 'ok'} in {result['wall_s']} s; {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
