"""The HTTP front end's overhead: one seeded workload served two ways in one Ray cluster, by the
engine in-process (`PdEngine.generate`, what the ingress calls) and through `distpool serve`'s Ray
Serve application (Serve's HTTP proxy, the FastAPI ingress, the engine deployment) with a streaming
HTTP client, at 1 client and at 16 concurrent clients. Both deployments run side by side and the two
ways take turns (each round, each concurrency: in-process, then HTTP), so load from elsewhere falls
on both; the rounds' timings are pooled.

Per concurrency it reports TTFT p50 / p90 as the engine's caller sees it (direct) and as an HTTP
client sees it (the first streamed token; the first body byte too), their difference, the per-token
time of each ((last token - first token) / tokens after the first), and the overhead per request
(end-to-end time to the last token, p50 over HTTP minus p50 direct; the means' difference in JSON).

    python scripts/bench_frontend.py --quick --json out/bench_frontend.json
    python scripts/bench_frontend.py --model DIR --model-impl transformers --dtype float32

Flags the script does not know are `distpool serve`'s (model, workers, memory, `--seed`, ...);
default: the bundled reference model, 1P1D. Prompts are token ids, every request greedy with
`ignore_eos` and the same `max_tokens`, so each makes exactly that many tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FULL = {"requests": 32, "prompt_len": 64, "max_tokens": 32, "repeats": 3}
QUICK = {"requests": 16, "prompt_len": 16, "max_tokens": 8, "repeats": 1}


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--quick", action="store_true", help="a small budget (16 requests, 8 tokens)")
    parser.add_argument("--clients", default="1,16", help="concurrent clients, comma-separated (1,16)")
    parser.add_argument("--requests", type=int, default=None, help="requests per concurrency (32)")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per request (64)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens each request makes (32)")
    parser.add_argument("--repeats", type=int, default=None, help="rounds of both ways, pooled (3)")
    parser.add_argument("--json", default=None, metavar="PATH")
    args, serve_flags = parser.parse_known_args(argv)
    budget = QUICK if args.quick else FULL
    for key, value in budget.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.clients = [int(c) for c in args.clients.split(",")]
    except ValueError:
        raise ValueError(f"--clients must be comma-separated counts; got {args.clients!r}") from None
    if min(args.clients) < 1:
        raise ValueError(f"--clients must be 1 or more each; got {args.clients}")
    if args.requests < max(args.clients):
        raise ValueError(
            f"--requests must be at least the most clients ({max(args.clients)}); got {args.requests}"
        )
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1; got {args.repeats}")
    if args.prompt_len < 1 or args.max_tokens < 2:
        raise ValueError(
            "--prompt-len must be >= 1 and --max-tokens >= 2 (a per-token time needs two tokens)"
        )
    return args, serve_flags


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_namespace(serve_flags: list[str]):
    """`distpool serve`'s flags, parsed as the command parses them (on a free port unless given)."""
    from distpool.cli import build_parser

    if not any(f == "--port" or f.startswith("--port=") for f in serve_flags):
        serve_flags = [*serve_flags, "--port", str(free_port())]
    parser = build_parser()
    return parser.parse_args(["serve", *serve_flags]), parser.parse_args(["serve"])


def make_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


@dataclass
class Timing:
    """One request, in seconds from its start: first body byte (HTTP), first token, last token."""

    first_token: float
    last_token: float
    tokens: int
    first_tokens: int  # tokens that came with the first
    first_byte: float | None = None

    @property
    def per_token(self) -> float | None:
        """None when every token came with the first (a slow reader gets merged chunks)."""
        after = self.tokens - self.first_tokens
        return (self.last_token - self.first_token) / after if after else None


@dataclass
class Tally:
    """A request's tokens as they come: when the first and the last came, and how many."""

    first_at: float | None = None
    first_n: int = 0
    last_at: float = 0.0
    tokens: int = 0

    def add(self, start: float, n: int) -> None:
        if n:
            self.last_at = time.perf_counter() - start
        if n and self.first_at is None:
            self.first_at, self.first_n = self.last_at, n
        self.tokens += n

    def timing(self, max_tokens: int, first_byte: float | None = None) -> Timing:
        if self.tokens != max_tokens or self.first_at is None:
            raise RuntimeError(f"a request made {self.tokens} tokens, not max_tokens={max_tokens}")
        return Timing(self.first_at, self.last_at, self.tokens, self.first_n, first_byte)


async def direct_request(engine, rid: str, prompt: list[int], max_tokens: int) -> Timing:
    from distpool.api.engine import GenerationArgs

    args = GenerationArgs(max_tokens=max_tokens, ignore_eos=True)
    tally, start = Tally(), time.perf_counter()
    async for event in engine.generate(rid, tuple(prompt), args):
        tally.add(start, len(event.token_ids))
    return tally.timing(max_tokens)


async def http_request(client, name: str, prompt: list[int], max_tokens: int) -> Timing:
    body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    body |= {"temperature": 0, "stream": True, "return_token_ids": True}
    tally, start, first_byte, buffer = Tally(), time.perf_counter(), None, b""
    async with client.stream("POST", "/v1/completions", json=body) as answer:
        if answer.status_code != 200:
            raise RuntimeError(f"HTTP {answer.status_code}: {(await answer.aread())[:300]!r}")
        async for raw in answer.aiter_raw():
            first_byte = first_byte if first_byte is not None else time.perf_counter() - start
            buffer += raw
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                data = event.removeprefix(b"data: ")
                if data == b"[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                tally.add(start, sum(len(c.get("token_ids") or []) for c in chunk["choices"]))
    return tally.timing(max_tokens, first_byte)


async def at_concurrency(one, prompts: list[list[int]], clients: int) -> tuple[list[Timing], float]:
    """Every prompt through `one(index, prompt)`, `clients` at a time (client i takes prompts i,
    i + clients, ...); the timings and the wall time."""

    async def client(i: int) -> list[Timing]:
        return [await one(j, prompts[j]) for j in range(i, len(prompts), clients)]

    start = time.perf_counter()
    done = await asyncio.gather(*(client(i) for i in range(clients)))
    return [t for timings in done for t in timings], time.perf_counter() - start


def figures(timings: list[Timing], wall_s: float) -> dict:
    from distpool.serving.summary.report import percentile

    def ms(values: list[float]) -> dict:
        return {"p50": percentile(values, 50) * 1e3, "p90": percentile(values, 90) * 1e3}

    out = {
        "ttft_ms": ms([t.first_token for t in timings]),
        "per_token_ms": ms([t.per_token for t in timings if t.per_token is not None]),
        "e2e_ms": {
            **ms([t.last_token for t in timings]),
            "mean": sum(t.last_token for t in timings) / len(timings) * 1e3,
        },
        "tokens_per_s": sum(t.tokens for t in timings) / wall_s,
    }
    if timings[0].first_byte is not None:
        out["first_byte_ms"] = ms([t.first_byte for t in timings])
    return out


async def measure(engine, base: str, name: str, args, prompts) -> dict:
    """Each round, each concurrency: the prompts in-process, then over HTTP (both ways interleave,
    so load that comes and goes falls on both); the timings of every round pooled."""
    import httpx

    limits = httpx.Limits(max_connections=max(args.clients) + 4)
    timings = {(way, c): [] for way in ("direct", "http") for c in args.clients}
    walls = dict.fromkeys(timings, 0.0)
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as client:
        await direct_request(engine, "warm", prompts[0], args.max_tokens)
        await http_request(client, name, prompts[0], args.max_tokens)
        for round_ in range(args.repeats):
            for c in args.clients:
                tag = f"r{round_}c{c}"
                ways = {
                    "direct": lambda j, p, t=tag: direct_request(engine, f"{t}-{j}", p, args.max_tokens),
                    "http": lambda j, p: http_request(client, name, p, args.max_tokens),
                }
                for way, one in ways.items():
                    done, wall = await at_concurrency(one, prompts, c)
                    timings[way, c] += done
                    walls[way, c] += wall
    return {key: figures(timings[key], walls[key]) for key in timings}


def serve_and_measure(app, setup, ns, name: str, args, prompts) -> tuple[dict, dict]:
    """The engine in-process and `distpool serve`'s application (started and drained as
    `serve_app.serve_until_signal` does) side by side in one cluster; their figures and drain summaries."""
    from ray import serve

    from distpool.api.pd_engine import PdEngine
    from distpool.api.serve_app import APP_NAME, ENGINE_NAME, READY_TIMEOUT_S, wait_until_answering

    serve.start(http_options={"host": ns.host, "port": ns.port})
    try:
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        direct = PdEngine(setup)
        try:
            base = f"http://{ns.host}:{ns.port}"
            wait_until_answering(f"{base}/health", READY_TIMEOUT_S, threading.Event())

            async def run() -> tuple[dict, dict]:
                try:
                    return await measure(direct, base, name, args, prompts), await direct.drain(30.0)
                finally:
                    await direct.stop_workers()

            figures_by, direct_summary = asyncio.run(run())
        except BaseException:
            direct.deployment.shutdown()
            raise
        engine = serve.get_deployment_handle(ENGINE_NAME, app_name=APP_NAME)
        http_summary = engine.drain.remote(30.0).result(timeout_s=90)
        engine.stop_workers.remote().result(timeout_s=60)
        return figures_by, {"direct": direct_summary, "http": http_summary}
    finally:
        serve.shutdown()


def comparison(direct: dict, http: dict) -> dict:
    return {
        "ttft_p50_diff_ms": http["ttft_ms"]["p50"] - direct["ttft_ms"]["p50"],
        "ttft_p90_diff_ms": http["ttft_ms"]["p90"] - direct["ttft_ms"]["p90"],
        "per_token_p50_diff_ms": http["per_token_ms"]["p50"] - direct["per_token_ms"]["p50"],
        "overhead_ms_per_request": http["e2e_ms"]["p50"] - direct["e2e_ms"]["p50"],
        "e2e_mean_diff_ms": http["e2e_ms"]["mean"] - direct["e2e_ms"]["mean"],
    }


def print_table(rows: list[dict]) -> None:
    head = "clients|TTFT p50 direct/HTTP (diff)|TTFT p90 direct/HTTP (diff)|1st byte p50|"
    head = (head + "per-token p50 direct/HTTP|overhead/req").split("|")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        d, h, c = r["direct"], r["http"], r["compare"]
        cells = (
            str(r["clients"]),
            f"{d['ttft_ms']['p50']:.1f} / {h['ttft_ms']['p50']:.1f} ({c['ttft_p50_diff_ms']:+.1f}) ms",
            f"{d['ttft_ms']['p90']:.1f} / {h['ttft_ms']['p90']:.1f} ({c['ttft_p90_diff_ms']:+.1f}) ms",
            f"{h['first_byte_ms']['p50']:.1f} ms",
            f"{d['per_token_ms']['p50']:.2f} / {h['per_token_ms']['p50']:.2f} ms",
            f"{c['overhead_ms_per_request']:+.1f} ms",
        )
        print("| " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    try:
        args, serve_flags = parse_args(argv)  # before the imports: a bad count answers at once
        from distpool.cli.serve_command import build, engine_setup

        ns, defaults = serve_namespace(serve_flags)
        app, plan, name, _ = build(ns, defaults)
        if plan.address:
            raise ValueError("--address: this script measures on an embedded cluster of its own")
        context = plan.spec.worker.pool_args.context_len
        if args.prompt_len + args.max_tokens > context:
            raise ValueError(
                f"--prompt-len {args.prompt_len} + --max-tokens {args.max_tokens} exceed the context "
                f"({context})"
            )
    except ValueError as exc:
        print(f"bench_frontend.py: error: {exc}", file=sys.stderr)
        return 2
    import ray

    from distpool.serving.job.main import start_ray

    prompts = make_prompts(args.requests, args.prompt_len, plan.spec.worker.spec.vocab_size, ns.seed)
    # Two deployments at once (in-process and Serve's), each rank an actor of one CPU, and the driver.
    start_ray(plan.spec, None, max(ns.num_cpus or 0, 2 * plan.spec.num_ranks + 1), ns.metrics_port)
    try:
        by, summaries = serve_and_measure(app, engine_setup(ns, plan, name), ns, name, args, prompts)
    finally:
        ray.shutdown()
    rows = [
        {
            "clients": c,
            "requests": args.requests * args.repeats,
            "direct": by["direct", c],
            "http": by["http", c],
            "compare": comparison(by["direct", c], by["http", c]),
        }
        for c in args.clients
    ]
    print(
        f"{name}: {args.requests} requests x {args.repeats} rounds per row, {args.prompt_len}-token prompts, "
        f"{args.max_tokens} tokens each; load average {os.getloadavg()[0]:.1f}"
    )
    print_table(rows)
    from distpool.api.serve_app import summary_line

    print(f"in-process {summary_line(summaries['direct'])}\nServe's    {summary_line(summaries['http'])}")
    report = {
        "model": name,
        "serve_flags": serve_flags,
        "workload": {
            "requests": args.requests,
            "repeats": args.repeats,
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "seed": ns.seed,
        },
        "load_average": os.getloadavg(),
        "rows": rows,
        "summaries": summaries,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    leaked = [s for s in summaries.values() if s["leaked_pages"] or s["leaked_slots"]]
    return 1 if leaked else 0


if __name__ == "__main__":
    sys.exit(main())
