"""`distpool run` and `check` refuse bad input before Ray starts: exit 2, one line, the flag named."""

from __future__ import annotations

import json
import os
import socket
import tempfile
from unittest import mock

import pytest
import torch

from distpool.cli import main
from distpool.serving.job import preflight
from tests.factories import FIXTURES


def run_refused(capsys, *args: str) -> str:
    """Run `distpool run ARGS`, which must be refused; returns stderr."""
    # Refused before Ray starts: the function that would start it is never reached.
    with mock.patch("distpool.serving.job.run", side_effect=AssertionError("Ray would start")):
        assert main(["run", *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    return err


def test_an_unknown_device_is_refused(capsys):
    assert "--device must be one of auto, cpu, cuda" in run_refused(capsys, "--device", "bogus")


def test_cuda_without_a_gpu_is_refused(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no CUDA device is visible" in run_refused(capsys, "--device", "cuda")


def test_a_budget_beyond_this_machine_is_refused_by_run_but_planned_by_check(capsys, monkeypatch):
    monkeypatch.setattr(preflight, "_available_host_bytes", lambda: 24 << 30)
    assert "this machine has 24.0 GiB available" in run_refused(capsys, "--memory-gib", "100")
    assert main(["check", str(FIXTURES / "llama3.json"), "--memory-gib", "80"]) == 0


def test_an_address_where_nothing_listens_is_refused_at_once(capsys):
    assert "no Ray cluster answers there" in run_refused(capsys, "--address", "127.0.0.1:1")


@pytest.mark.parametrize(
    "variable, value, expected",
    [
        ("DISTPOOL_CHUNK_MIB", "0", "DISTPOOL_CHUNK_MIB must be 1 to 1024"),
        ("DISTPOOL_CHUNK_MIB", "4096", "DISTPOOL_CHUNK_MIB must be 1 to 1024"),
        ("DISTPOOL_CHUNK_MIB", "lots", "DISTPOOL_CHUNK_MIB='lots' is not an integer"),
        ("DISTPOOL_TRANSFER_TIMEOUT_S", "-1", "DISTPOOL_TRANSFER_TIMEOUT_S: the transfer timeout"),
        ("DISTPOOL_TRANSFER_TIMEOUT_S", "nan", "DISTPOOL_TRANSFER_TIMEOUT_S: the transfer timeout"),
    ],
)
def test_bad_environment_values_are_refused_naming_the_variable(
    capsys, monkeypatch, variable, value, expected
):
    monkeypatch.setenv(variable, value)
    assert expected in run_refused(capsys)


@pytest.mark.parametrize("value", ["0", "0.0001", "-3", "nan", "4000"])
def test_transfer_timeouts_outside_a_tenth_of_a_second_to_an_hour_are_refused(capsys, value):
    assert "--transfer-timeout: the transfer timeout must be 0.1 to 3600" in run_refused(
        capsys, "--transfer-timeout", value
    )


def test_a_deeply_nested_config_or_prompts_file_is_refused(capsys, tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    config = tmp_path / "config.json"
    config.write_text(deep)
    assert "nests too deeply" in run_refused(capsys, "--model", str(config))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(deep + "\n")
    assert "nests too deeply" in run_refused(capsys, "--prompts", str(prompts))


def test_a_prompts_file_that_is_not_utf8_is_named(capsys, tmp_path):
    prompts = tmp_path / "latin1.jsonl"
    prompts.write_bytes(b'{"prompt": "caf\xe9"}\n')
    assert f"prompts file {prompts} is not UTF-8" in run_refused(capsys, "--prompts", str(prompts))


@pytest.mark.parametrize("rid", ["", "x" * 300, True, None])
def test_a_prompt_id_no_envelope_can_carry_is_refused(capsys, tmp_path, rid):
    prompts = tmp_path / "ids.jsonl"
    prompts.write_text(json.dumps({"id": rid, "prompt_ids": [1, 2, 3]}) + "\n")
    assert "id must be a string" in run_refused(capsys, "--prompts", str(prompts))


def test_attention_heads_must_group_over_kv_heads(capsys, tmp_path):
    config = json.loads((FIXTURES / "llama3.json").read_text())
    config["num_key_value_heads"] = 5  # 32 heads do not split into 5 groups
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["check", str(path)]) == 2
    assert "must be a multiple of the KV heads (5)" in capsys.readouterr().err


def test_an_attention_free_model_reports_capacity_without_a_context_limit(capsys):
    assert main(["check", str(FIXTURES / "mamba2.json"), "--memory-gib", "4"]) == 0
    out = capsys.readouterr().out
    assert "requests of any length (state only, no KV)" in out and "at full context" not in out


def test_the_default_budget_fits_the_model_and_this_machine(monkeypatch):
    from distpool.memory.sizing import GIB, PoolArgs, size_pools
    from distpool.model.hf_config import spec_from_hf
    from distpool.model.presets import resolve_model

    monkeypatch.setattr(preflight, "_available_host_bytes", lambda: 24 << 30)
    spec = spec_from_hf(resolve_model("nemotron-h-8b"))
    args = PoolArgs(enable_unified_memory=True, context_len=4096)  # what run resolves for hybrid Mamba
    assert preflight.default_budget_bytes(spec, args, "reference", 2) == 256 << 20
    budget = preflight.default_budget_bytes(spec, args, "synthetic", 2)
    assert budget % (256 << 20) == 0 and budget <= 0.4 * 24 * GIB / 2
    assert size_pools(spec, args, budget).requests_at_full_context >= 4  # room for a small batch
    monkeypatch.setattr(preflight, "_available_host_bytes", lambda: 2 << 30)  # a small machine: capped
    assert preflight.default_budget_bytes(spec, args, "synthetic", 2) == 256 << 20


# ---- issue 20: inputs overwritten, hangs before Ray, paths, devices, conflicting flags ----------
@pytest.fixture
def no_ray(monkeypatch):
    """Every refusal here happens before Ray starts: starting it fails the test."""
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started for input that must be refused before it")

    monkeypatch.setattr(ray, "init", refuse)


def prompts_file(tmp_path, *lines: str):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(line + "\n" for line in lines) or '{"prompt_ids": [1, 2, 3]}\n')
    return path


def test_json_may_not_overwrite_the_prompts_or_the_model_config(capsys, tmp_path, no_ray):
    prompts = prompts_file(tmp_path)
    before = prompts.read_text()
    err = run_refused(capsys, "--prompts", str(prompts), "--json", str(prompts))
    assert "--json" in err and "the file --prompts reads" in err
    other_spelling = tmp_path / "sub" / ".." / "p.jsonl"
    (tmp_path / "sub").mkdir()
    assert "--prompts reads" in run_refused(capsys, "--prompts", str(prompts), "--json", str(other_spelling))
    config = tmp_path / "cfg.json"
    config.write_text((FIXTURES / "nemotron_h.json").read_text())
    assert "the file --model reads" in run_refused(capsys, "--model", str(config), "--json", str(config))
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "config.json").write_text(config.read_text())  # --model DIR reads DIR/config.json
    err = run_refused(
        capsys, "--model", str(tmp_path / "dir"), "--json", str(tmp_path / "dir" / "config.json")
    )
    assert "--model reads" in err
    assert prompts.read_text() == before


@pytest.mark.parametrize(
    "where, expected",
    [
        ("a folder", "is a folder"),
        ("under a file", "is a file, not a folder"),
        ("a socket", "neither a regular file nor a character device or pipe"),
        ("/proc/self/x.json", "under /dev, /proc and /sys only an existing device or pipe"),
    ],
)
def test_a_json_path_that_cannot_be_written_is_refused_before_the_run(
    capsys, tmp_path, no_ray, where, expected
):
    regular = tmp_path / "notes.txt"
    regular.write_text("x")
    path = {"a folder": str(tmp_path), "under a file": str(regular / "out" / "run.json")}.get(where, where)
    with tempfile.TemporaryDirectory() as short, socket.socket(socket.AF_UNIX) as sock:
        if where == "a socket":  # a short folder: a socket's path has a length limit
            path = os.path.join(short, "s")
            sock.bind(path)
        assert expected in run_refused(capsys, "--json", path)


def test_a_json_path_in_folders_yet_to_be_made_is_accepted_and_written_whole(tmp_path):
    from distpool.serving.job.output import check_output_path, write_json

    path = tmp_path / "out" / "deeper" / "run.json"
    assert check_output_path(str(path), "--json", {}) == path
    assert not (tmp_path / "out").exists()  # nothing is made until the run writes
    write_json(path, {"completed": 3})
    assert json.loads(path.read_text()) == {"completed": 3}
    assert [p.name for p in path.parent.iterdir()] == ["run.json"]  # no partial file left behind


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--num-cpus", "1"], "--num-cpus 1: each of the 2 workers takes one CPU"),
        (["--num-cpus", "-1"], "--num-cpus -1: each of the 2 workers"),
        (["--prefill", "2", "--decode", "2", "--num-cpus", "3"], "each of the 4 workers"),
        (["--spread"], "--spread puts each of the 2 workers on its own node"),
        (["--address", "127.0.0.1:-5"], "--address 127.0.0.1:-5: not an address Ray can attach to"),
        (["--address", "127.0.0.1:70000"], "not an address Ray can attach to"),
        (["--address", "somewhere"], "not an address Ray can attach to"),
        (["--address", "127.0.0.1:1", "--num-cpus", "4"], "--num-cpus sizes the embedded cluster"),
    ],
)
def test_cluster_flags_that_would_hang_or_wait_are_refused_before_ray(capsys, no_ray, args, expected):
    assert expected in run_refused(capsys, *args)


def test_a_bad_ray_address_variable_is_named_as_itself(capsys, monkeypatch, no_ray):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:-5")
    assert run_refused(capsys).startswith("distpool: error: RAY_ADDRESS 127.0.0.1:-5: not an address")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    assert "RAY_ADDRESS 127.0.0.1:1: no Ray cluster answers there" in run_refused(capsys)


@pytest.mark.parametrize("device", ["cpu:0", "cpu:1", "cuda:x", "auto:0", "cuda:"])
def test_a_device_index_a_pool_cannot_use_is_refused(capsys, no_ray, device):
    assert f"a CPU has no index); got {device!r}" in run_refused(capsys, "--device", device)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--workload", "multi-turn"], "--workload shapes generated requests, but --prompts reads them"),
        (["--workload", "long"], "--workload shapes generated requests"),
        (["--workload", "multi-turn", "--turns", "3"], "--workload shapes generated requests"),
        (["--turns", "3"], "--turns shapes generated requests"),
        (["--requests", "8"], "--requests shapes generated requests"),
        (["--max-prompt-len", "8"], "--max-prompt-len shapes generated requests"),
    ],
)
def test_generation_flags_beside_a_prompts_file_are_refused(capsys, tmp_path, no_ray, args, expected):
    assert expected in run_refused(capsys, "--prompts", str(prompts_file(tmp_path)), *args)


def test_contradicting_or_inapplicable_flags_are_refused(capsys, no_ray):
    assert "contradict" in run_refused(capsys, "--enable-unified-memory", "--disable-unified-memory")
    err = run_refused(capsys, "--workload", "short", "--min-prompt-len", "8")
    assert "--min-prompt-len bounds the mixed workload's prompts; --workload short" in err


@pytest.mark.parametrize(
    "line, expected",
    [
        ('{"prompt": "\\ud800"}', "prompt is not valid text (a lone surrogate at character 0)"),
        ('{"prompt_ids": [1], "id": "a\\udfffb"}', "id is not valid text"),
        ('{"prompt_ids": [' + "9" * 5000 + "]}", "invalid JSON (Exceeds the limit"),
    ],
)
def test_prompts_file_errors_name_the_file_and_line(capsys, tmp_path, no_ray, line, expected):
    path = prompts_file(tmp_path, '{"prompt_ids": [1, 2]}', line)
    err = run_refused(capsys, "--prompts", str(path))
    assert f"{path}:2: {expected}" in err


@pytest.mark.parametrize(
    "args", [["--requests", "100000000"], ["--requests", "100000000", "--workload", "multi-turn"]]
)
def test_a_workload_too_large_to_hold_is_refused_before_a_prompt_is_drawn(capsys, no_ray, args):
    err = run_refused(capsys, *args)
    assert "--requests 100000000 of about" in err and "Fix: --requests" in err


def test_the_memory_check_counts_what_a_run_takes_beside_the_pools(capsys, monkeypatch, no_ray):
    """nemotron-h-56b at 2 GiB per worker took about 10.8 GB in all (parity pool, link measurement,
    the cache's patterns, Ray): 8 GiB available passed a check that counted the two pools only."""
    monkeypatch.setattr(preflight, "_available_host_bytes", lambda: 8 << 30)
    err = run_refused(capsys, "--model", "nemotron-h-56b", "--memory-gib", "2")
    assert "takes 11.8 GiB in all: 1 prefill x 4.40 + 1 decode x 4.40" in err
    assert "driver 2.25 (parity pool, model, process), Ray 0.75" in err


def test_run_memory_adds_staging_per_peer_the_link_message_the_model_and_the_processes():
    from distpool.memory.arena import SLIDE_STAGING_BYTES
    from distpool.memory.sizing import PoolArgs, size_pools
    from distpool.model.hf_config import spec_from_hf
    from distpool.model.presets import resolve_model
    from distpool.serving.job.run_memory import PROCESS_BYTES, RAY_BYTES, RunMemory
    from distpool.serving.summary.parity import parity_pool_sizes
    from distpool.worker.config import WorkerConfig
    from transfer import TransferOptions

    spec = spec_from_hf(resolve_model("nemotron-h-8b"))
    args = PoolArgs(enable_unified_memory=True, context_len=1024)
    worker = WorkerConfig(
        spec=spec,
        pool_args=args,
        budget_bytes=3 << 30,
        model_impl="synthetic",
        transfer=TransferOptions(chunk_bytes=16 << 20),
    )
    memory = RunMemory.of(worker, num_prefill=2, num_decode=3)
    envelope = spec.slot_bytes + 1024 * (16 << 10)  # slot + 1024 tokens of 16 KiB: no padding here
    assert size_pools(spec, worker.for_role("decode"), 1 << 40).request_bytes_at_full_context == envelope
    model = spec.slot_bytes + spec.full_kv_bytes_per_token  # the synthetic cache's base patterns
    worker_part = (3 << 30) + envelope + model + SLIDE_STAGING_BYTES + PROCESS_BYTES
    assert memory.prefill_bytes == worker_part + 3 * 3 * (16 << 20)  # 3 staging chunks per decode peer
    assert memory.decode_bytes == worker_part + 2 * 3 * (16 << 20)
    parity = parity_pool_sizes(worker, 1024).budget_bytes
    assert parity == envelope and memory.driver_bytes == parity + model + PROCESS_BYTES
    assert (
        memory.total_bytes
        == 2 * memory.prefill_bytes + 3 * memory.decode_bytes + memory.driver_bytes + RAY_BYTES
    )
    # Colocated: no channel, so no staging and no link message; the pools and the rest are the same.
    colocated = RunMemory.of(worker, num_prefill=0, num_decode=3)
    assert colocated.decode_bytes == worker_part - envelope
    assert colocated.total_bytes == 3 * colocated.decode_bytes + memory.driver_bytes + RAY_BYTES


BAMBA = str(FIXTURES / "bamba.json")


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--decode-tp", "3"], "--decode-tp 3: tensor parallelism of 3 ranks cannot shard BambaForCausalLM"),
        (
            ["--prefill-tp", "3", "--model-impl", "reference"],
            "--prefill-tp 3: tensor parallelism of 3 ranks cannot shard NemotronHForCausalLM",
        ),
        (["--prefill-tp", "2", "--decode-tp", "2", "--spread"], "--spread is for TP 1"),
    ],
)
def test_tp_sizes_a_run_cannot_serve_are_refused_before_ray(capsys, no_ray, args, expected):
    if "reference" not in args:  # else the default model: the reference model's own config
        args = [*args, "--model", BAMBA, "--model-impl", "synthetic"]
    assert expected in run_refused(capsys, *args)


def test_every_rank_counts_in_the_memory_check_and_the_embedded_clusters_cpus(capsys, monkeypatch, no_ray):
    """--memory-gib is per rank: 2 prefill ranks and 2 decode ranks are 4 pools, 4 CPUs."""
    monkeypatch.setattr(preflight, "_available_host_bytes", lambda: 8 << 30)
    tp = ["--model", BAMBA, "--model-impl", "synthetic", "--prefill-tp", "2", "--decode-tp", "2"]
    assert "for each of 4 workers" in run_refused(capsys, *tp, "--memory-gib", "2")
    assert "each of the 4 workers takes one CPU" in run_refused(capsys, *tp, "--num-cpus", "3")


# ---- issue 34: inputs that were ignored without a word -----------------------------------------
@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["--conditional-disagg", "--no-prefix-cache"],
            "--conditional-disagg prefills a later turn from the state its decode worker kept, and with "
            "--no-prefix-cache no state is kept",
        ),
        (
            ["--no-conditional-disagg", "--local-prefill-max-tokens", "100"],
            "--local-prefill-max-tokens tunes conditional disaggregation, which --no-conditional-disagg "
            "turns off",
        ),
        (
            ["--no-conditional-disagg", "--local-prefill-chunk", "64"],
            "--local-prefill-chunk tunes conditional disaggregation, which --no-conditional-disagg",
        ),
        (
            ["--no-prefix-cache", "--local-prefill-max-tokens", "100"],
            "--local-prefill-max-tokens tunes conditional disaggregation, which --no-prefix-cache turns off",
        ),
    ],
)
def test_conditional_disaggregation_flags_that_would_do_nothing_are_refused(capsys, no_ray, args, expected):
    assert expected in run_refused(capsys, *args)


def test_without_the_prefix_cache_conditional_disaggregation_is_off_unless_asked(monkeypatch):
    """--no-prefix-cache alone runs (the default turns conditional disaggregation off with it)."""
    seen = {}

    def run(spec, *args, **kwargs):
        seen["spec"] = spec
        return 0

    monkeypatch.setattr("distpool.serving.job.run", run)
    assert main(["run", "--no-prefix-cache", "--requests", "2"]) == 0
    assert seen["spec"].worker.local_prefill is False
    assert main(["run", "--requests", "2", "--local-prefill-chunk", "64"]) == 0
    assert seen["spec"].worker.local_prefill is True


def test_a_prompts_line_with_both_prompt_ids_and_prompt_is_refused(capsys, tmp_path, no_ray):
    path = prompts_file(tmp_path, '{"prompt_ids": [1, 2]}', '{"prompt_ids": [1, 2], "prompt": "the cat"}')
    err = run_refused(capsys, "--prompts", str(path))
    assert f'{path}:2: give "prompt_ids" or "prompt", not both' in err


def test_a_prompt_longer_than_the_context_names_its_line(capsys, tmp_path, no_ray):
    path = prompts_file(tmp_path, '{"prompt_ids": [1, 2]}', '{"prompt_ids": [1, 2, 3], "max_new_tokens": 14}')
    err = run_refused(capsys, "--prompts", str(path), "--context-len", "16", "--max-new-tokens", "4")
    assert f"{path}:2: 3 prompt tokens and 14 new tokens are longer than --context-len 16" in err


def test_tp_with_the_transformers_runner_is_refused_as_such(capsys, no_ray, hf_checkpoints):
    """Regression: refused with a message about shard rules for the model's state tensors."""
    for tp in (["--prefill-tp", "2"], ["--decode-tp", "2"]):
        err = run_refused(capsys, "--model", str(hf_checkpoints["bamba"]), *tp)
        assert "the transformers runner has no TP" in err and "use --model-impl synthetic or reference" in err
        assert "shard" not in err


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--conditional-disagg"], "--conditional-disagg steers prefill workers or the transfers"),
        (["--no-conditional-disagg"], "--no-conditional-disagg steers prefill workers"),
        (["--local-prefill-max-tokens", "64"], "--local-prefill-max-tokens steers prefill workers"),
        (["--reserve-first"], "--reserve-first steers prefill workers"),
        (["--fault-rate", "0.1"], "--fault-rate steers prefill workers"),
        (["--prefill-tp", "2"], "--prefill-tp 2 sizes prefill workers, and --prefill 0 starts none"),
        (["--decode-tp", "2"], "--decode-tp 2 with --prefill 0: a decode worker of TP > 1 prefills nothing"),
        (
            ["--model", str(FIXTURES / "llama3.json"), "--model-impl", "synthetic"],
            "keeps no recurrent state beside KV pages",
        ),
        (["--decode", "0"], "need at least 1 decode worker"),
    ],
)
def test_a_colocated_run_refuses_what_it_has_no_prefill_worker_or_recurrent_state_for(
    capsys, no_ray, args, expected
):
    err = run_refused(capsys, "--prefill", "0", *args)
    assert expected in err and "Fix:" in err
