"""`distpool` command line: `check` (classify and size), `presets`, `run` (PD serving of a workload, the
main job) and `serve` (PD serving behind an OpenAI-compatible endpoint).

Exit status 0 on success, 2 with the reason on stderr (no traceback) for refusals and bad input.
Everything is validated here, before Ray or any actor starts. Each command's flags are
`distpool.cli.flags`; what it does with them, its handler in `distpool.cli.commands`.
`bench serve`, a serving benchmark of any OpenAI-compatible endpoint, has both in `distpool.bench`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from distpool.bench import add_bench_parser, cmd_bench
from distpool.cli.commands import cmd_check, cmd_presets, cmd_run
from distpool.cli.errors import error_text
from distpool.cli.flags import add_check_parser, add_presets_parser, add_run_parser
from distpool.cli.serve_command import add_serve_arguments, cmd_serve
from distpool.serving.interrupt import INTERRUPTED_STATUS, exit_status_of


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distpool", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_check_parser(sub).set_defaults(handler=cmd_check)
    add_presets_parser(sub).set_defaults(handler=cmd_presets)
    add_bench_parser(sub).set_defaults(handler=cmd_bench)
    add_run_parser(sub).set_defaults(handler=cmd_run)
    serve = add_run_parser(sub, "serve", "serve an OpenAI-compatible endpoint over PD disaggregation on Ray")
    add_serve_arguments(serve)
    serve.set_defaults(handler=lambda ns: cmd_serve(ns, parser.parse_args(["serve"])))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.handler(ns)
    except ValueError as exc:  # refusals and bad input: the message is the whole story
        print(f"distpool: error: {error_text(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # before a run started (a run writes its own summary, then exits)
        status = exit_status_of(exc)  # 130 after Ctrl-C, 143 after SIGTERM (`Terminated`)
        print(f"distpool: {'interrupted' if status == INTERRUPTED_STATUS else 'terminated'}", file=sys.stderr)
        return status
