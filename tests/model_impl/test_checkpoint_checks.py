"""A bad checkpoint is refused before Ray starts, one line naming the file and what is wrong, exit 2
(issue 34: each of these failed in every worker after Ray had started, with a traceback, exit 1)."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest

from distpool.model_impl.hf.checkpoint import (
    INDEX_INVALID,
    MALFORMED_ENTRY,
    NO_CHECKPOINT,
    NOT_SAFETENSORS,
    SHARD_OUTSIDE,
    SIZE_MISMATCH,
    TRUNCATED,
    CheckpointError,
    read_checkpoint,
    read_header,
)
from tests.test_run_validation import no_ray, run_refused  # noqa: F401 (a fixture)

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def header_length(data: bytes) -> int:
    return int.from_bytes(data[:8], "little")


def sharded(folder: Path) -> None:
    """`folder`'s model.safetensors named by an index as two shards, of which only the first exists."""
    data = (folder / "model.safetensors").read_bytes()
    names = [n for n in json.loads(data[8 : 8 + header_length(data)]) if n != "__metadata__"]
    (folder / "model.safetensors").rename(folder / SHARDS[0])
    weight_map = {name: SHARDS[i % 2] for i, name in enumerate(names)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def edit_config(folder: Path, **fields) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))


def rewrite(folder: Path, change) -> None:
    weights = folder / "model.safetensors"
    weights.write_bytes(change(weights.read_bytes()))


def corrupt_header(data: bytes) -> bytes:
    return data[:10] + b"\xff" * 10 + data[20:]


BREAKAGES = {
    "truncated data": (lambda f: rewrite(f, lambda d: d[: len(d) // 2]), "model.safetensors", "(truncated)"),
    "truncated header": (
        lambda f: rewrite(f, lambda d: d[:100]),
        "model.safetensors",
        "but the file holds 100",
    ),
    "corrupted header": (lambda f: rewrite(f, corrupt_header), "model.safetensors", "not valid JSON"),
    "header length 2^40": (
        lambda f: rewrite(f, lambda d: (1 << 40).to_bytes(8, "little") + d[8:]),
        "model.safetensors",
        "the header claims 1099511627776 bytes",
    ),
    "missing shard": (sharded, "model.safetensors.index.json", f"names shard {SHARDS[1]}, which is not in"),
    "shapes of another config": (
        lambda f: edit_config(f, intermediate_size=40),
        "model.safetensors",
        "is stored as [48, 32], but the model its config.json describes has [40, 32]",
    ),
    "config transformers rejects": (
        lambda f: edit_config(f, mamba_n_heads=3),
        "config.json",
        "transformers rejects it: Class validation error for validator 'validate_architecture'",
    ),
}


@pytest.mark.usefixtures("no_ray")
@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_a_bad_checkpoint_is_refused_before_ray_naming_the_file(capsys, tmp_path, hf_checkpoints, breakage):
    folder = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoints["bamba"], folder)
    break_it, file, expected = BREAKAGES[breakage]
    break_it(folder)
    err = run_refused(capsys, "--model", str(folder), "--prompts", str(prompts(tmp_path)))
    assert err.startswith(f"distpool: error: {folder / file}: ") and expected in err, err
    assert "Fix:" in err


def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt_ids": [1, 2, 3]}\n')
    return path


def test_every_architectures_saved_checkpoint_passes_and_a_sharded_one_is_read_whole(
    hf_checkpoints, tmp_path
):
    """The checks pass every tiny checkpoint (MoE experts saved apart, prefixes renamed) as
    transformers loads it, and read a sharded checkpoint's tensors from the shards its index names."""
    from distpool.model_impl.hf.checkpoint import check_checkpoint
    from distpool.model_impl.hf.loader import empty_model
    from distpool.model_impl.hf.source import HFSource
    from distpool.model_impl.hf.transformers_internals import weight_forms

    for folder in hf_checkpoints.values():
        model = empty_model(HFSource(path=str(folder), load_format="safetensors", dtype="float32"))
        check_checkpoint(folder, weight_forms(model))  # raises for any difference
    whole = read_header(hf_checkpoints["bamba"] / "model.safetensors")
    folder = tmp_path / "sharded"
    shutil.copytree(hf_checkpoints["bamba"], folder)
    sharded(folder)
    shutil.copy(folder / SHARDS[0], folder / SHARDS[1])  # both shards now hold every tensor
    tensors = read_checkpoint(folder)
    assert {name: t for name, (_, t) in tensors.items()} == whole
    assert {path.name for path, _ in tensors.values()} == set(SHARDS)


def test_an_index_may_not_name_a_shard_outside_the_folder(tmp_path, hf_checkpoints):
    folder = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoints["bamba"], folder)
    (folder / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    index = {"weight_map": {"lm_head.weight": "../elsewhere.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as refused:
        read_checkpoint(folder)
    assert (refused.value.kind, refused.value.path) == (
        SHARD_OUTSIDE,
        folder / "model.safetensors.index.json",
    )


def safetensors_bytes(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


@pytest.mark.parametrize(
    "header, data, expected",
    [
        ({"w": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, MALFORMED_ENTRY),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, -8]}}, b"\0" * 8, MALFORMED_ENTRY),
        ({"w": {"dtype": 7, "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, MALFORMED_ENTRY),
        ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, SIZE_MISMATCH),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, TRUNCATED),
        (["w"], b"", NOT_SAFETENSORS),
    ],
)
def test_a_header_entry_that_does_not_fit_the_file_is_refused(tmp_path, header, data, expected):
    path = tmp_path / "model.safetensors"
    path.write_bytes(safetensors_bytes(header, data))
    with pytest.raises(CheckpointError) as refused:
        read_header(path)
    assert (refused.value.kind, refused.value.path) == (expected, path)


@pytest.mark.parametrize(
    "index",
    [
        "{not json",
        '{"metadata": {}}',
        '{"weight_map": {"w": 3}}',
    ],
)
def test_an_index_that_is_not_one_is_refused(tmp_path, index):
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError) as refused:
        read_checkpoint(tmp_path)
    assert refused.value.kind == INDEX_INVALID
    (tmp_path / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError) as refused:
        read_checkpoint(tmp_path)
    assert (refused.value.kind, refused.value.path) == (NO_CHECKPOINT, tmp_path)


def test_a_checkpoint_refusal_pickles_with_its_facts(tmp_path):
    refusal = CheckpointError(tmp_path / "model.safetensors", "the header is cut", kind=TRUNCATED)
    back = pickle.loads(pickle.dumps(refusal))
    assert (type(back), back.path, back.problem, back.kind) == (
        CheckpointError,
        refusal.path,
        refusal.problem,
        TRUNCATED,
    )
    assert str(back) == str(refusal)
