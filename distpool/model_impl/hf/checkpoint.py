"""A checkpoint folder checked before anything loads it: every safetensors header the load reads,
the sharded index, and the tensors' names and shapes against the model its config builds.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (per tensor its
`dtype`, `shape` and `data_offsets` [begin, end) into the data that follows) and the data. The
header is read here with its length bounded by the file's size first (a corrupt length of 2^40
is refused, never allocated), and every tensor's bytes must lie inside the file and match its
dtype and shape. Only headers are read, never the weights.

Which files a load reads is transformers' rule: `model.safetensors` when present, else the
shards `model.safetensors.index.json` names. The names a checkpoint stores are those
`save_pretrained` writes, which for some architectures differ from the modules' own (transformers
5 fuses MoE experts at load and splits them at save); a tensor may be stored under either.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from distpool.facts import Facts

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_INDEX_BYTES = 64 << 20  # an index names tensors and files: megabytes at most
# Bytes per element of the safetensors dtypes; a dtype not listed (sub-byte F4) skips the size check.
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip


# What is wrong with a checkpoint (`CheckpointError.kind`).
TRUNCATED = "truncated"  # the file ends before what its header says it holds
UNREADABLE = "unreadable"  # the operating system refused the read
NOT_SAFETENSORS = "not_safetensors"  # the header is not a JSON object
MALFORMED_ENTRY = "malformed_entry"  # a tensor's header entry lacks a dtype, shape or offsets
SIZE_MISMATCH = "size_mismatch"  # a tensor's bytes are not its dtype times its shape
NO_CHECKPOINT = "no_checkpoint"  # the folder holds neither a single file nor an index
SHARD_OUTSIDE = "shard_outside"  # the index names a shard outside the folder
SHARD_MISSING = "shard_missing"  # the index names a shard the folder does not hold
INDEX_INVALID = "index_invalid"  # the index is no index, or puts a tensor where it is not
SHAPE_MISMATCH = "shape_mismatch"  # a tensor stored in another shape than the config's model has
TENSOR_MISSING = "tensor_missing"  # a tensor of the config's model that no file stores
CONFIG_REJECTED = "config_rejected"  # transformers' validation rejects config.json


class CheckpointError(Facts, ValueError):
    """A checkpoint file that cannot be loaded: the file, `kind` (one of the names above) and what
    is wrong with it (`problem`)."""

    def __init__(self, path: Path, problem: str, kind: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path, self.problem, self.kind = path, problem, kind


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors header."""

    dtype: str
    shape: tuple[int, ...]
    begin: int  # data_offsets, from the end of the header
    end: int


def read_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors `path`'s safetensors header describes, each checked to lie inside the file;
    CheckpointError naming the file and what is wrong."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            if size < 8:
                raise CheckpointError(
                    path, f"{size} bytes, too short for a safetensors header (truncated)", kind=TRUNCATED
                )
            length = int.from_bytes(f.read(8), "little")
            if length > size - 8:
                raise CheckpointError(
                    path,
                    f"the header claims {length} bytes but the file holds {size} (truncated or corrupt)",
                    kind=TRUNCATED,
                )
            raw = f.read(length)
    except OSError as exc:
        raise CheckpointError(path, f"cannot be read ({exc.strerror or exc})", kind=UNREADABLE) from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise CheckpointError(
            path, "the safetensors header is not valid JSON (corrupt)", kind=NOT_SAFETENSORS
        ) from None
    if not isinstance(header, dict):
        raise CheckpointError(
            path, "the safetensors header is not a JSON object (corrupt)", kind=NOT_SAFETENSORS
        )
    data_bytes = size - 8 - length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _stored(path, name, entry, data_bytes)
    return tensors


def _stored(path: Path, name: str, entry: object, data_bytes: int) -> StoredTensor:
    try:
        dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
    except (TypeError, KeyError, ValueError):
        dtype, shape, begin, end = None, (), -1, -1
    if not isinstance(dtype, str) or not all(type(n) is int and n >= 0 for n in (*shape, begin, end)):
        raise CheckpointError(
            path, f"tensor {name!r} has a malformed header entry (corrupt)", kind=MALFORMED_ENTRY
        )
    if not begin <= end <= data_bytes:
        raise CheckpointError(
            path,
            f"tensor {name!r} ends at data byte {end} but the file holds {data_bytes} (truncated)",
            kind=TRUNCATED,
        )
    if dtype in DTYPE_BYTES and end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise CheckpointError(
            path,
            f"tensor {name!r} of {dtype} {list(shape)} takes {end - begin} bytes, not "
            f"{math.prod(shape) * DTYPE_BYTES[dtype]} (corrupt)",
            kind=SIZE_MISMATCH,
        )
    return StoredTensor(dtype=dtype, shape=shape, begin=begin, end=end)


def read_checkpoint(folder: Path) -> dict[str, tuple[Path, StoredTensor]]:
    """Every tensor the load of `folder` reads, by name, with the file it is in."""
    single, index = folder / SINGLE_FILE, folder / INDEX_FILE
    if single.is_file():
        return {name: (single, t) for name, t in read_header(single).items()}
    if not index.is_file():
        raise CheckpointError(
            folder,
            f"holds neither {SINGLE_FILE} nor {INDEX_FILE}, which transformers loads",
            kind=NO_CHECKPOINT,
        )
    weight_map = _weight_map(index)
    headers = {}
    for shard in sorted(set(weight_map.values())):
        path = folder / shard
        if os.path.dirname(os.path.normpath(shard)).startswith("..") or os.path.isabs(shard):
            raise CheckpointError(
                index, f"names shard {shard!r}, outside the checkpoint's folder", kind=SHARD_OUTSIDE
            )
        if not path.is_file():
            raise CheckpointError(index, f"names shard {shard}, which is not in {folder}", kind=SHARD_MISSING)
        headers[shard] = read_header(path)
    tensors = {}
    for name, shard in weight_map.items():
        if name not in headers[shard]:
            raise CheckpointError(
                index, f"puts tensor {name!r} in {shard}, which does not hold it", kind=INDEX_INVALID
            )
        tensors[name] = (folder / shard, headers[shard][name])
    return tensors


def _weight_map(index: Path) -> dict[str, str]:
    try:
        if index.stat().st_size > MAX_INDEX_BYTES:
            raise CheckpointError(
                index, f"is larger than {MAX_INDEX_BYTES >> 20} MiB: not an index", kind=INDEX_INVALID
            )
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError(index, f"cannot be read ({exc.strerror or exc})", kind=UNREADABLE) from None
    except (ValueError, RecursionError, TypeError, KeyError):
        raise CheckpointError(index, 'is not a JSON object with a "weight_map"', kind=INDEX_INVALID) from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(
            index, 'its "weight_map" must map tensor names to file names', kind=INDEX_INVALID
        )
    return weight_map


Shapes = dict[str, tuple[int, ...]]  # tensor name -> shape


def check_checkpoint(folder: Path, forms: Sequence[Shapes]) -> None:
    """Refuse (CheckpointError) a checkpoint in `folder` that the model cannot load: an unreadable
    header or index, a missing shard, a tensor of the model it does not store, or one stored in
    another shape. `forms`: the names and shapes the model's weights may be stored under
    (`transformers_internals.weight_forms`: those `save_pretrained` writes, the modules' own); the
    checkpoint must store every tensor of one of them. Tensors it stores beyond the model's are left
    to transformers (it ignores them)."""
    stored = read_checkpoint(folder)
    # The form the checkpoint is in: the one of which it stores the most tensors.
    form = max(forms, key=lambda names: len(names.keys() & stored.keys()))
    for name, shape in form.items():
        if name in stored and stored[name][1].shape != shape:
            path, tensor = stored[name]
            raise CheckpointError(
                path,
                f"tensor {name!r} is stored as {list(tensor.shape)}, but the model its config.json "
                f"describes has {list(shape)}: the weights are of another configuration",
                kind=SHAPE_MISMATCH,
            )
    if missing := sorted(form.keys() - stored.keys()):
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(
            folder,
            f"holds no tensor {missing[0]!r}{more} of the model its config.json describes",
            kind=TENSOR_MISSING,
        )
