"""`distpool bench serve`: a client-side serving benchmark of any OpenAI-compatible endpoint (requests
arriving at rates, streamed, timed at the client; vLLM's figures and names), and the comparison of
distpool deployments it launches. HTTP only: of the server side it imports only the seeded workload
generators."""

from distpool.bench.command import cmd_bench
from distpool.bench.flags import add_bench_parser

__all__ = ["add_bench_parser", "cmd_bench"]
