"""What the typed messages between the driver and the workers cost to cross a process boundary:
frozen dataclasses (what distpool uses) against `msgspec.Struct`s of the same fields, side by side.

Ray pickles what an actor call takes and returns, so the round trip that counts is
`pickle.loads(pickle.dumps(message))`; msgspec's own MessagePack encode and typed (validating)
decode is measured beside it, for dataclasses and Structs alike, as what a msgpack transport would
pay. Each message is a typical one: a prefill item with a 1024-token prompt, a 16-request batch of
prefill and of decode results (128 tokens each), a failure, and a decode worker's stats.

    .venv/bin/python scripts/bench_messages.py --json out/bench_messages.json

msgspec is optional (`pip install msgspec`, or the `bench` extra): without it only the dataclass
rows are measured. `--ray` adds one actor call per dataclass message, echoing it (a local cluster,
1 CPU), to set the serialization cost against what a call costs in all.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pickle
import random
import statistics
import sys
import time
import typing
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distpool.worker.messages import DecodeFailed, DecodeFinished, PrefillItem, PrefillSent  # noqa: E402
from distpool.worker.stats import DecodeStats  # noqa: E402
from transfer.wire.failure import FailureKind  # noqa: E402

PROMPT_TOKENS = 1024
NEW_TOKENS = 128
BATCH = 16
ROUNDS = 7  # the median round counts
CALLS_PER_ROUND = 2000
RAY_CALLS = 200
SEED = 0
PICKLE_PROTOCOL = 5  # what Ray's serializer uses


def typical_messages(rng: random.Random) -> dict[str, object]:
    """The messages of one request's life, at typical sizes (a batch where one crosses per batch)."""
    prompt = [rng.randrange(32000) for _ in range(PROMPT_TOKENS)]
    sent = {
        f"req-{i}": PrefillSent(
            transfer_bytes=51 << 20, transfer_s=0.012, source_runs=3, computed_tokens=1000
        )
        for i in range(BATCH)
    }
    finished = {
        f"req-{i}": DecodeFinished(
            tokens=[rng.randrange(32000) for _ in range(NEW_TOKENS)],
            decode_s=1.5,
            admit_s=0.002,
            destination_runs=2,
            prefix_hit_tokens=512,
            verified=True,
        )
        for i in range(BATCH)
    }
    zero = {f.name: 0 for f in dataclasses.fields(DecodeStats)}
    stats = DecodeStats(**(zero | {"name": "decode-0", "role": "decode", "node_id": "a" * 56, "steps": 4096}))
    return {
        "PrefillItem (1024 tokens)": PrefillItem(request_id="req-0", prompt=prompt, decode_worker="decode-0"),
        f"{BATCH} x PrefillSent": sent,
        f"{BATCH} x DecodeFinished (128 tokens)": finished,
        "DecodeFailed": DecodeFailed(kind=FailureKind.TIMEOUT, reason="x" * 80, retry=True),
        "DecodeStats": stats,
    }


def as_struct_types(msgspec) -> dict[type, type]:
    """A frozen `msgspec.Struct` with each message dataclass's fields and types."""
    structs = {}
    for cls in (PrefillItem, PrefillSent, DecodeFinished, DecodeFailed, DecodeStats):
        hints = typing.get_type_hints(cls)
        fields = [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]
        name = f"{cls.__name__}Struct"
        structs[cls] = msgspec.defstruct(name, fields, frozen=True, module=__name__)
        globals()[name] = structs[cls]  # pickle finds a class by its module and name
    return structs


def to_struct(message: object, structs: dict[type, type]) -> object:
    if isinstance(message, dict):
        return {key: to_struct(value, structs) for key, value in message.items()}
    cls = structs[type(message)]
    return cls(**{f.name: getattr(message, f.name) for f in dataclasses.fields(message)})


def decoded_type(message: object) -> object:
    """The type a validating decoder is given for `message` (a dict of results keeps its value type)."""
    if isinstance(message, dict):
        return dict[str, type(next(iter(message.values())))]
    return type(message)


def per_call_us(round_trip: Callable[[], object]) -> float:
    """Median over ROUNDS of the mean microseconds of one round trip."""
    rounds = []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        for _ in range(CALLS_PER_ROUND):
            round_trip()
        rounds.append((time.perf_counter() - started) / CALLS_PER_ROUND * 1e6)
    return statistics.median(rounds)


def pickled(message: object) -> tuple[Callable[[], object], int]:
    def trip() -> object:
        return pickle.loads(pickle.dumps(message, protocol=PICKLE_PROTOCOL))

    assert trip() == message
    return trip, len(pickle.dumps(message, protocol=PICKLE_PROTOCOL))


def msgpacked(msgspec, message: object) -> tuple[Callable[[], object], int]:
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(decoded_type(message))

    def trip() -> object:
        return decoder.decode(encoder.encode(message))

    assert trip() == message
    return trip, len(encoder.encode(message))


def ray_call_us(messages: dict[str, dict[str, object]]) -> dict[str, dict[str, float]]:
    """Median microseconds of one actor call that takes the message and returns it."""
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote
        class Echo:
            def echo(self, message):
                return message

        echo = Echo.remote()
        out: dict[str, dict[str, float]] = {}
        for name, variants in messages.items():
            for kind, message in variants.items():
                assert ray.get(echo.echo.remote(message)) == message  # warm, and equal on return
                samples = []
                for _ in range(RAY_CALLS):
                    started = time.perf_counter()
                    ray.get(echo.echo.remote(message))
                    samples.append((time.perf_counter() - started) * 1e6)
                out.setdefault(name, {})[kind] = statistics.median(samples)
        return out
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="write every figure")
    parser.add_argument("--ray", action="store_true", help="also time an echoing actor call per message")
    args = parser.parse_args(argv)
    try:
        import msgspec
    except ImportError:
        msgspec = None
        print("msgspec is not installed: only the dataclass rows are measured", flush=True)
    messages = typical_messages(random.Random(SEED))
    structs = as_struct_types(msgspec) if msgspec is not None else {}
    rows = []
    for name, message in messages.items():
        methods = {"dataclass pickle": pickled(message)}
        if msgspec is not None:
            as_struct = to_struct(message, structs)
            methods["Struct pickle"] = pickled(as_struct)
            methods["dataclass msgpack"] = msgpacked(msgspec, message)
            methods["Struct msgpack"] = msgpacked(msgspec, as_struct)
        figures = {
            kind: {"us": per_call_us(trip), "bytes": nbytes} for kind, (trip, nbytes) in methods.items()
        }
        base = figures["dataclass pickle"]["us"]
        for kind in figures:
            figures[kind]["vs_dataclass_pickle"] = figures[kind]["us"] / base
        rows.append({"message": name, "methods": figures})
    if args.ray:  # the dataclasses only: this script's Structs are built at run time, not importable
        calls = ray_call_us({name: {"dataclass": message} for name, message in messages.items()})
        for row in rows:
            row["ray_call_us"] = calls[row["message"]]
    kinds = list(rows[0]["methods"])
    print(f"\nround trip per message, us (bytes) - median of {ROUNDS} rounds of {CALLS_PER_ROUND}")
    print(f"{'message':<36}" + "".join(f"{kind:>22}" for kind in kinds))
    for row in rows:
        cells = (f"{m['us']:.2f} ({m['bytes']})" for m in row["methods"].values())
        print(f"{row['message']:<36}" + "".join(f"{cell:>22}" for cell in cells))
    if args.ray:
        print(f"\nan actor call echoing the message, us (median of {RAY_CALLS})")
        for row in rows:
            print(
                f"{row['message']:<36}" + "".join(f"{k} {v:>8.0f}   " for k, v in row["ray_call_us"].items())
            )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        versions = {"python": sys.version.split()[0], "msgspec": getattr(msgspec, "__version__", None)}
        Path(args.json).write_text(json.dumps({"versions": versions, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
