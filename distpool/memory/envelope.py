"""The request envelope: the one description of pool memory that crosses a process boundary.

An `Envelope` names everything one request owns in a pool (its physical page ids in token order and
its state slot) plus the layout fingerprint the ids are meaningful under. It travels as msgpack:

    [ENVELOPE_VERSION, request_id, fingerprint, page_ids, slot_id, num_tokens, num_bytes, held_pages]

a positional array so that a missing, extra or reordered field is a length or type error, never a
silently defaulted value. A destination envelope may hold its first `held_pages` pages already
(a prefix the decode worker had cached): a transfer moves only the rest and the slot.
`Envelope.decode` trusts nothing: every type, length and range is checked, and anything malformed
raises `EnvelopeError` (a `ValueError`). Never pickle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgpack

ENVELOPE_VERSION = 2
_NUM_FIELDS = 8

# Bounds a decoder applies unless told otherwise. A page id or byte count past 2**62 cannot index
# any arena; a million pages is ~16M tokens at page_size 16, far past any context length.
MAX_PAGES = 1 << 20
MAX_ID = (1 << 62) - 1
MAX_REQUEST_ID_CHARS = 256
MAX_FINGERPRINT_CHARS = 128


class EnvelopeError(ValueError):
    """An envelope that is malformed: wrong type, out-of-range value, or undecodable bytes."""


def _check_int(name: str, value: object, *, max_value: int = MAX_ID) -> int:
    # bool is an int subclass; an envelope with `True` as a page id is garbage, not page 1.
    if type(value) is not int:
        raise EnvelopeError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value <= max_value:
        raise EnvelopeError(f"{name} must be in [0, {max_value}], got {value}")
    return value


def _check_str(name: str, value: object, *, max_chars: int) -> str:
    if type(value) is not str:
        raise EnvelopeError(f"{name} must be a str, got {type(value).__name__}")
    if not 0 < len(value) <= max_chars:
        raise EnvelopeError(f"{name} must have 1 to {max_chars} characters, got {len(value)}")
    return value


def _check_page_ids(page_ids: object, *, max_pages: int, max_id: int) -> tuple[int, ...]:
    if isinstance(page_ids, (str, bytes, bytearray)) or not isinstance(page_ids, Sequence):
        raise EnvelopeError(f"page_ids must be a sequence of ints, got {type(page_ids).__name__}")
    if len(page_ids) > max_pages:
        raise EnvelopeError(f"page_ids has {len(page_ids)} entries; at most {max_pages} allowed")
    ids = tuple(page_ids)
    if not all(type(i) is int for i in ids):
        bad = next(i for i in ids if type(i) is not int)
        raise EnvelopeError(f"page_ids must hold ints, found {type(bad).__name__}")
    if ids and (min(ids) < 0 or max(ids) > max_id):
        raise EnvelopeError(f"page ids must be in [0, {max_id}], got min {min(ids)} max {max(ids)}")
    if len(set(ids)) != len(ids):
        raise EnvelopeError("page_ids holds a duplicate: one physical page cannot back two positions")
    return ids


@dataclass(frozen=True)
class Envelope:
    """Everything one request owns in a pool, by physical id.

    `page_ids` are physical page ids in token order (any sequence of ints is accepted and stored as a
    tuple); `slot_id` is the physical state slot, or None for a model without recurrent state;
    `num_bytes` is the total size of the envelope's byte ranges in the arena; `held_pages`: how many
    of its first pages the destination holds already (shared, read only), so no transfer writes them.
    """

    request_id: str
    fingerprint: str
    page_ids: tuple[int, ...]
    slot_id: int | None
    num_tokens: int
    num_bytes: int
    held_pages: int = 0

    def __post_init__(self) -> None:
        _check_str("request_id", self.request_id, max_chars=MAX_REQUEST_ID_CHARS)
        _check_str("fingerprint", self.fingerprint, max_chars=MAX_FINGERPRINT_CHARS)
        ids = _check_page_ids(self.page_ids, max_pages=MAX_PAGES, max_id=MAX_ID)
        object.__setattr__(self, "page_ids", ids)  # normalise lists / tensors' tolist() to a tuple
        if self.slot_id is not None:
            _check_int("slot_id", self.slot_id)
        _check_int("num_tokens", self.num_tokens)
        _check_int("num_bytes", self.num_bytes)
        _check_int("held_pages", self.held_pages, max_value=len(ids))

    @property
    def num_pages(self) -> int:
        return len(self.page_ids)

    def encode(self) -> bytes:
        """The versioned msgpack encoding; `Envelope.decode(e.encode()) == e`."""
        fields = [
            ENVELOPE_VERSION,
            self.request_id,
            self.fingerprint,
            list(self.page_ids),
            self.slot_id,
            self.num_tokens,
            self.num_bytes,
            self.held_pages,
        ]
        return msgpack.packb(fields, use_bin_type=True)

    @classmethod
    def decode(
        cls,
        data: bytes | bytearray | memoryview,
        *,
        max_pages: int = MAX_PAGES,
        max_id: int = MAX_ID,
        max_encoded_bytes: int | None = None,
    ) -> Envelope:
        """Decode and validate an encoded envelope; raise `EnvelopeError` for anything malformed.

        `max_pages` and `max_id` bound the page count and every id / count; `max_encoded_bytes`
        (default: what `max_pages` ids could need) refuses oversized input before parsing it.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise EnvelopeError(f"an encoded envelope is bytes, got {type(data).__name__}")
        # Worst case per page id is 9 bytes (uint64); the fixed fields fit in 1 KiB.
        limit = max_encoded_bytes if max_encoded_bytes is not None else 9 * max_pages + 1024
        if len(data) > limit:
            raise EnvelopeError(f"encoded envelope has {len(data)} bytes; at most {limit} allowed")
        try:
            fields = msgpack.unpackb(
                bytes(data),
                raw=False,
                use_list=True,
                strict_map_key=True,
                ext_hook=_refuse_ext,
                max_str_len=max(MAX_REQUEST_ID_CHARS, MAX_FINGERPRINT_CHARS) * 4,
                max_bin_len=0,
                max_array_len=max(max_pages, _NUM_FIELDS),
                max_map_len=0,
                max_ext_len=0,
            )
        except EnvelopeError:
            raise
        except Exception as exc:  # msgpack raises many types (ExtraData, ValueError, UnicodeError...)
            raise EnvelopeError(f"undecodable envelope: {type(exc).__name__}: {exc}") from None
        if type(fields) is not list or len(fields) != _NUM_FIELDS:
            shape = f"{len(fields)} fields" if type(fields) is list else type(fields).__name__
            raise EnvelopeError(f"an envelope is a list of {_NUM_FIELDS} fields, got {shape}")
        version, request_id, fingerprint, page_ids, slot_id, num_tokens, num_bytes, held_pages = fields
        if type(version) is not int or version != ENVELOPE_VERSION:
            raise EnvelopeError(
                f"envelope version {version!r} is not supported (expected {ENVELOPE_VERSION})"
            )
        if type(page_ids) is not list:
            raise EnvelopeError(f"page_ids must be a list, got {type(page_ids).__name__}")
        ids = _check_page_ids(page_ids, max_pages=max_pages, max_id=max_id)
        if slot_id is not None:
            _check_int("slot_id", slot_id, max_value=max_id)
        _check_int("num_tokens", num_tokens, max_value=max_id)
        _check_int("num_bytes", num_bytes, max_value=max_id)
        _check_int("held_pages", held_pages, max_value=len(ids))
        return cls(
            request_id=_check_str("request_id", request_id, max_chars=MAX_REQUEST_ID_CHARS),
            fingerprint=_check_str("fingerprint", fingerprint, max_chars=MAX_FINGERPRINT_CHARS),
            page_ids=ids,
            slot_id=slot_id,
            num_tokens=num_tokens,
            num_bytes=num_bytes,
            held_pages=held_pages,
        )


def _refuse_ext(code: int, data: bytes) -> object:
    raise EnvelopeError(f"msgpack extension type {code} is not allowed in an envelope")
