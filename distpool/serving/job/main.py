"""The main job: serve a workload through PD on Ray, check parity, print and write the summary.

With no address it starts an embedded local Ray; inside a Ray job (RAY_ADDRESS is set by
`ray job submit`) or with an address it attaches to that cluster. `distpool.cli` parses the
command line and validates everything before calling `run`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable

import ray

from distpool.serving.deploy import PING_TIMEOUT_S, Deployment, DeploymentSpec
from distpool.serving.interrupt import INTERRUPTED_STATUS, catch_sigterm, exit_status_of, restore_sigterm
from distpool.serving.job.output import write_text
from distpool.serving.metrics import ray_init_options
from distpool.serving.outcome import Outcome, one_line
from distpool.serving.path import ServeOptions, Server
from distpool.serving.routing import ConditionalOptions
from distpool.serving.summary import (
    Parity,
    WorkerReading,
    check_parity,
    format_summary,
    link_summary,
    percentile,
    summarize,
)
from distpool.serving.workloads import MultiTurn, Request, TurnFeed


def worker_stats(
    deployment: Deployment, *, timeout_s: float = 30.0, lost: set[str] = frozenset()
) -> list[WorkerReading]:
    """Every worker's stats (each rank's, of a TP group), asked of all at once; a worker that cannot
    answer within `timeout_s` (`PING_TIMEOUT_S` for one known `lost`) is listed as dead or not
    answering, its figures unknown (None), not zero."""
    refs = {name: handle.stats.remote() for name, handle in deployment.rank_handles().items()}
    deadline, readings = time.monotonic() + timeout_s, []
    for name, ref in refs.items():
        was_lost = deployment.worker_of(name) in lost
        wait_s = PING_TIMEOUT_S if was_lost else max(deadline - time.monotonic(), 0.1)
        try:
            readings.append(WorkerReading(name=name, stats=ray.get(ref, timeout=wait_s)))
        except Exception as exc:  # dead, or stuck: the summary is written all the same
            state = "not answering" if isinstance(exc, ray.exceptions.GetTimeoutError) else "dead"
            readings.append(WorkerReading(name=name, state=state, error=one_line(exc)))
    return readings


def drop_prefix_caches(deployment: Deployment, readings: list[WorkerReading]) -> list[WorkerReading]:
    """Drop every live worker's prefix cache (each rank's); what a pool still holds then is a leak,
    counted in its reading's `*_used` (the larger of before and after). The readings, so completed."""
    handles = deployment.rank_handles()
    out = []
    for reading in readings:
        if reading.stats is not None and reading.name in handles:
            try:
                held = ray.get(handles[reading.name].drop_prefix_cache.remote(), timeout=30)
                reading = reading.after_drop(held)
            except Exception as exc:  # the summary is written all the same
                reading = reading.failed(one_line(exc))
        out.append(reading)
    return out


LINK_REPEATS = 5  # raw messages per channel; the median counts


def measure_links(deployment: Deployment, outcomes: list[Outcome], lost: set[str] = frozenset()) -> dict:
    """Each pair's raw link at the run's median envelope size, one pair at a time, after the run
    drained (nothing else competes for the cores or the link); none with a worker `lost`. A pair
    of TP groups is measured on its first channel (its ranks' channels are alike), at the median
    envelope's share of one channel."""
    done = [o for o in outcomes if o.tokens is not None and o.transfer_bytes]
    if not done:
        return link_summary([], {}, 0)
    nbytes = int(percentile([float(o.transfer_bytes) for o in done], 50))
    channel_bytes = nbytes // len(deployment.pairing.channels)
    seconds: dict[tuple[str, str], float] = {}
    ranks = deployment.rank_handles()
    for pair in sorted({o.pair for o in done if o.pair is not None and not set(o.pair) & lost}):
        prefill, decode = pair
        p_rank, d_rank = deployment.channel_ends(prefill, decode)[0]
        try:
            sent, received = ray.get(
                [
                    ranks[p_rank].measure_link.remote(d_rank, channel_bytes, LINK_REPEATS),
                    ranks[d_rank].measure_link.remote(p_rank, channel_bytes, LINK_REPEATS),
                ],
                timeout=120,
            )
        except Exception as exc:  # a channel that died since: reported without its link rate
            print(f"distpool: warning: link {prefill}->{decode} not measured: {one_line(exc)}", flush=True)
            continue
        seconds[pair] = received
    return link_summary(done, seconds, channel_bytes)


def serve_workload(server: Server, requests: list[Request] | MultiTurn, feed: TurnFeed | None) -> None:
    """Serve a list of requests, or a multi-turn workload turn by turn through `feed` (which keeps
    the prompts each turn was served with); the outcomes gather in `server.outcomes`."""
    if feed is None:
        asyncio.run(server.serve(requests))
    else:
        asyncio.run(server.serve(feed.first_turns(), feed.next_turn))


def start_ray(
    spec: DeploymentSpec, address: str | None, num_cpus: int | None, metrics_port: int | None
) -> None:
    if address:
        ray.init(address=address, log_to_driver=False)
        return
    ray.init(  # "local": a new cluster, even when another one runs on this machine
        address="local",
        num_cpus=num_cpus or spec.num_ranks + 1,  # a CPU per rank process, and the driver's
        include_dashboard=False,
        log_to_driver=False,
        **ray_init_options(metrics_port),
    )


INTERRUPTED_STATS_S = 5.0  # after Ctrl-C, how long the summary waits for a worker's figures


def run(
    spec: DeploymentSpec,
    requests: list[Request] | MultiTurn,
    *,
    address: str | None,
    num_cpus: int | None = None,
    faults: dict[str, float] | None = None,
    overlap_reservation: bool = True,
    conditional: ConditionalOptions | None = None,
    seed: int = 0,
    parity_sample: int = 4,
    json_path: str | None = None,
    outputs_path: str | None = None,
    detokenize: Callable[[list[int]], str] | None = None,
    metrics_port: int | None = None,
) -> int:
    """Serve `requests` (or a multi-turn workload); returns the exit status (`exit_status`). The
    summary is always printed and written, also when workers died, and after Ctrl-C or SIGTERM (of
    the requests that ended by then: no link measurement, no parity check, leaks unknown);
    `outputs_path` gets one JSON line per completed request (`outputs_text`, with its text where
    `detokenize` is given)."""
    where = address or "an embedded local Ray cluster"
    model_impl, dtype = spec.worker.model_impl, spec.worker.dtype
    what = {
        "synthetic": "synthetic cache, every envelope byte-verified",
        "reference": "reference model",
        "transformers": f"transformers runner ({spec.worker.hf and spec.worker.hf.path})",
    }[model_impl] + f", {dtype}"
    served = requests.describe() if isinstance(requests, MultiTurn) else f"{len(requests)} requests"
    worker = spec.worker
    tp = f" (TP {worker.prefill_tp}:{worker.decode_tp})" if worker.prefill_tp * worker.decode_tp > 1 else ""
    shape = (
        f"colocated: {spec.num_decode} workers, each prefilling its own requests"
        if spec.colocated
        else f"{spec.num_prefill}P{spec.num_decode}D{tp}"
    )
    print(f"distpool: {shape} on {where}; {served}; {what}", flush=True)
    if metrics_port is not None and not ray.is_initialized() and not address:
        print(f"distpool: Prometheus metrics at http://127.0.0.1:{metrics_port}/metrics", flush=True)
    owns_ray = not ray.is_initialized()
    feed = TurnFeed(requests) if isinstance(requests, MultiTurn) else None
    deployment = server = None
    started, wall_s, drained = time.monotonic(), 0.0, False
    interrupted: KeyboardInterrupt | None = None  # Ctrl-C, or SIGTERM (`Terminated`)
    link, stats, parity = link_summary([], {}, 0), [], Parity()
    sigterm_before = catch_sigterm()  # SIGTERM ends the run as Ctrl-C does (interrupt.py)
    try:
        try:
            if owns_ray:
                start_ray(spec, address, num_cpus, metrics_port)
                catch_sigterm()  # ray.init put its own in place: an exit without the summary
            deployment = Deployment.start(spec)
            started = time.monotonic()
            options = ServeOptions(
                faults=faults or {},
                seed=seed,
                overlap_reservation=overlap_reservation,
                conditional=conditional or ConditionalOptions(),
            )
            server = Server(deployment, options)
            serve_workload(server, requests, feed)
            wall_s = time.monotonic() - started
            outcomes = sorted(server.outcomes, key=lambda o: o.request_id)
            link = measure_links(deployment, outcomes, server.router.dead)
            stats = drop_prefix_caches(deployment, worker_stats(deployment, lost=server.router.dead))
            drained = True
            parity = parity_of(spec, feed.latest_turns_first() if feed else requests, outcomes, parity_sample)
        except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (`Terminated`)
            interrupted, wall_s = exc, time.monotonic() - started
            how = "interrupted" if exit_status_of(exc) == INTERRUPTED_STATUS else "terminated (SIGTERM)"
            print(f"distpool: {how}: the summary covers the requests that ended", flush=True)
            try:
                if deployment is not None and not stats:
                    stats = worker_stats(deployment, timeout_s=INTERRUPTED_STATS_S)
            except KeyboardInterrupt:  # twice: the summary goes without the workers' figures
                pass
        outcomes = sorted(server.outcomes, key=lambda o: o.request_id) if server is not None else []
        total = server.total if server is not None and server.total else initial_count(requests)
        outputs = outputs_text(feed.served if feed is not None else requests, outcomes, detokenize)
        report = summarize(
            outcomes,
            retried=server.retried if server is not None else 0,
            worker_stats=stats,
            parity=parity,
            wall_s=wall_s,
            workers_lost=len(server.recovery.lost) if server is not None else 0,
            workers_restarted=len(server.recovery.restarted) if server is not None else 0,
            lost_why=server.recovery.why if server is not None else None,
            model_impl=model_impl,
            dtype=dtype,
            tp=(worker.prefill_tp, worker.decode_tp),
            workers=(spec.num_prefill, spec.num_decode),
            link=link,
            multi_turn=feed.summary() if feed is not None else None,
            # Memory held by requests still in flight is no leak: before the drain, leaks go unread.
            unchecked=dict.fromkeys([s.name for s in stats] or ["every worker"], "interrupted")
            if interrupted is not None and not drained
            else None,
            interrupted=interrupted is not None,
            unfinished=max(total - len(outcomes), 0) if interrupted is not None else 0,
        )
    finally:
        if deployment is not None:
            deployment.shutdown()
        if owns_ray:
            ray.shutdown()
        restore_sigterm(sigterm_before)
    print(format_summary(report), flush=True)
    for flag, path, text in (
        ("--json", json_path, json.dumps(report, indent=2)),
        ("--outputs", outputs_path, outputs),
    ):
        if not path:
            continue
        try:
            write_text(path, text)
        except OSError as exc:  # checked before the run (output.py); the disk may have filled since
            print(f"distpool: error: {flag} {path} not written: {exc.strerror or exc}", file=sys.stderr)
            return 1
    status = exit_status(report)
    if status == INTERRUPTED_STATUS and interrupted is not None:
        return exit_status_of(interrupted)  # 143 after SIGTERM
    return status


def initial_count(requests: list[Request] | MultiTurn) -> int:
    """Requests a run starts with: the list, or a multi-turn workload's first turns."""
    return len(requests.conversations) if isinstance(requests, MultiTurn) else len(requests)


def parity_of(spec: DeploymentSpec, realized: list[Request], outcomes: list[Outcome], sample: int) -> Parity:
    """`check_parity` (multi-turn: `realized` holds the prompts each turn was served with, later turns
    first), or no figures with a warning when it cannot run: the run's own figures stand without it."""
    try:
        return check_parity(spec, realized, outcomes, sample)
    except Exception as exc:
        print(f"distpool: warning: parity check not run: {one_line(exc)}", flush=True)
        return Parity()


def outputs_text(
    served: list[Request], outcomes: list[Outcome], detokenize: Callable[[list[int]], str] | None = None
) -> str:
    """`--outputs`: one JSON line per completed request, in the order served: its id, the prompt
    exactly as served (a multi-turn turn's whole prompt) and the generated tokens only, why it ended
    (`finish_reason`: stop, with `stop_token_id`, or length), the sampling seed it was served with,
    and with a tokenizer (`detokenize`) the generated tokens' text."""
    done = {o.request_id: o for o in outcomes if o.tokens is not None}
    lines = []
    for r in served:
        if (o := done.get(r.request_id)) is not None and o.tokens is not None:  # (done: tokens only)
            line = {"id": r.request_id, "prompt_ids": r.prompt, "output_ids": o.tokens}
            if o.finish is not None:
                line["finish_reason"] = o.finish.reason
                if o.finish.stop_token is not None:
                    line["stop_token_id"] = o.finish.stop_token
            if o.seed is not None:
                line["seed"] = o.seed
            if detokenize is not None:
                line["text"] = detokenize(o.tokens)
            lines.append(json.dumps(line))
    return "".join(f"{line}\n" for line in lines)


def exit_status(report: dict) -> int:
    """0: every request completed, parity held, every envelope verified (synthetic cache), nothing
    leaked and no worker was lost; 1: a request failed (or a multi-turn turn was skipped after one),
    a token differed, an envelope was corrupt or memory leaked; 3: everything completed, but a
    worker died on the way (or could not be read at the end: its leaks are unknown); 130: the run
    was interrupted (Ctrl-C; `run` makes it 143 for SIGTERM) before every request ended."""
    if report["interrupted"]:
        return INTERRUPTED_STATUS
    skipped = (report.get("multi_turn") or {}).get("turns_skipped", 0)
    healthy = report["failed"] == 0 and skipped == 0 and report["parity_mismatches"] == 0
    healthy = healthy and report["corrupt_envelopes"] == 0
    if report["model_impl"] == "synthetic":
        healthy = healthy and report["verified_envelopes"] >= report["completed"]
    # Leaks: the totals, or (when some worker could not be read) what the workers that were read hold.
    held = [report["leaked_pages"], report["leaked_slots"]]
    if None in held:
        held = [s[field] or 0 for s in report["workers"] for field in ("pages_used", "slots_used")]
    if not healthy or any(held):
        return 1
    return 3 if report["workers_lost"] or report["leaks_unchecked"] else 0
