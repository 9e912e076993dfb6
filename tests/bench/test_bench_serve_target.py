"""`make bench-serve` is the README's one benchmark command: what it would run is a valid `bench serve`
comparison of PD and colocated serving, on the bundled Bamba-style benchmark model. Read with `make -n`
(nothing runs, nothing launches)."""

import shlex
import shutil
import subprocess
from pathlib import Path

from distpool.bench.command import deployments_from
from distpool.cli import build_parser
from distpool.model.hf_config import spec_from_hf
from distpool.model_impl.reference.configs import BENCH_BAMBA_CONFIG

ROOT = Path(__file__).resolve().parents[2]


def bench_serve_argv() -> list[str]:
    """The arguments `make bench-serve` passes to `distpool bench serve`."""
    assert shutil.which("make") is not None, "the README's set-up runs through make: install it"
    # VENV points at a folder that cannot exist, so `make -n` prints setup's commands without running them
    printed = subprocess.run(
        ["make", "-n", "--no-print-directory", "bench-serve", "VENV=/nonexistent-venv"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = [line for line in printed.replace("\\\n", " ").splitlines() if "-m distpool bench serve" in line]
    assert len(lines) == 1, printed
    argv = shlex.split(lines[0])
    return argv[argv.index("distpool") + 1 :]


def test_make_bench_serve_compares_pd_with_colocated_on_the_benchmark_model():
    ns = build_parser().parse_args(bench_serve_argv())
    deployments = deployments_from(ns)
    assert list(deployments) == ["pd", "colocated"]
    served = {name: build_parser().parse_args(["serve", *flags]) for name, flags in deployments.items()}
    assert (served["pd"].prefill, served["pd"].decode) == (1, 1)
    assert (served["colocated"].prefill, served["colocated"].decode) == (0, 2)
    for flags in served.values():
        assert (ROOT / flags.model).resolve() == BENCH_BAMBA_CONFIG
        assert (flags.model_impl, flags.load_format) == ("transformers", "dummy")
    assert len(ns.request_rate) >= 3 and ns.goodput and ns.seed is not None
    assert (ns.json, ns.plot) == ("out/bench_serve.json", "out/bench_serve.png")


def test_the_benchmark_model_is_a_bamba_hybrid_of_the_size_the_readme_states():
    spec = spec_from_hf(BENCH_BAMBA_CONFIG)
    assert spec.architectures == ("BambaForCausalLM",)
    assert (spec.num_mamba_layers, spec.num_full_attention_layers) == (6, 2)
    readme = (ROOT / "README.md").read_text()
    assert "69.0 M parameters" in readme and "8 layers (6 Mamba2, 2 attention)" in readme
