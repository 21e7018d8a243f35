"""Decoding a request body, bounded by its size: a small body must not decode into a huge tree.

A JSON value costs a Python object of 30-200 bytes however few bytes it takes
in the body (``[]`` is 2 bytes and a 64-byte list), so a body within the
size limit can still decode to many times its size.  Before decoding a large
body the edge estimates what its objects will cost, at C speed over the bytes
(:func:`estimated_decoded_bytes`), and refuses (400) a body over
``DECODE_COST_FACTOR`` times its size (plus ``DECODE_COST_SLACK``).
"""

from __future__ import annotations

import msgspec

from iopd.edge.openai.incoming.jsonschema import JSONObject
from iopd.errors import InvalidRequest

__all__ = [
    "DECODE_CHECK_FROM_BYTES",
    "DECODE_COST_FACTOR",
    "DECODE_COST_SLACK",
    "estimated_decoded_bytes",
    "parse_json_object",
]

_decode = msgspec.json.Decoder().decode

#: Bodies up to this size are decoded without an estimate (at worst ~30x:
#: 2 MiB of objects).
DECODE_CHECK_FROM_BYTES = 64 * 1024
#: A body may decode to at most this many times its size, plus the slack.
DECODE_COST_FACTOR = 10
DECODE_COST_SLACK = 1024 * 1024

# Bytes of one decoded object, measured with tracemalloc on msgspec 0.19 /
# CPython 3.11 (8 MiB bodies of one repeated item): a list 64, a small dict
# ~190 (a dict entry ~48 more as it grows), a str 49 + its characters, an int
# or float 32-36, a reference to any of them 8.  Small ints, true, false,
# null, "" and one-character strings are shared objects: only the reference.
_LIST_BYTES = 72
_DICT_BYTES = 160
_ENTRY_BYTES = 48
_STR_BYTES = 56
_SCALAR_BYTES = 36
_REF_BYTES = 8
_NOT_STRUCTURAL = bytes(i for i in range(256) if i not in b'[{,:"')


def estimated_decoded_bytes(body: bytes) -> int:
    """An upper estimate of the memory the decoded ``body`` takes, in linear time.

    Everything runs at C speed over the bytes (no Python step per value, so
    a body of millions of tiny values costs no more than a long string):
    escape pairs are removed, every byte but ``[ { , : "`` is deleted, and the
    string literals are taken out of that skeleton so that only the structure
    outside strings is counted.  Counts: lists (``[``), dicts (``{``), entries
    (``:``), strings, and values (``,``); each is priced at the measured cost
    of its object (see above).  Characters cost 1 byte each in an ASCII body,
    4 otherwise (one emoji makes CPython store its whole string at 4 bytes a
    character).  For valid JSON the estimate is above the real figure in every
    shape measured; for invalid JSON it is meaningless, and decoding refuses
    the body anyway.
    """
    per_char = 1 if body.isascii() and b"\\u" not in body else 4
    skeleton = body
    if b"\\" in skeleton:  # (outside strings a backslash is invalid JSON anyway)
        skeleton = skeleton.replace(b"\\\\", b"").replace(b'\\"', b"")
    skeleton = skeleton.translate(None, _NOT_STRUCTURAL)
    # A string whose content holds no structural byte is now `""`; two strings
    # are never adjacent in JSON (a `,` or `:` separates them).
    size = len(skeleton)
    skeleton = skeleton.replace(b'""', b"")
    strings = (size - len(skeleton)) // 2
    quotes = skeleton.count(b'"')
    if quotes > len(body) // 32:
        strings += quotes // 2  # too many to split cheaply: count their content as structure
    elif quotes:
        parts = skeleton.split(b'"')
        strings += len(parts) // 2
        skeleton = b"".join(parts[::2])
    lists, dicts = skeleton.count(b"["), skeleton.count(b"{")
    values, entries = skeleton.count(b","), skeleton.count(b":")
    # Values other than strings and containers: at most one per `,` or `:`
    # (plus the last), minus the strings.
    scalars = max(0, values + entries + 1 - strings)
    return (
        per_char * len(body)
        + _STR_BYTES * strings
        + _LIST_BYTES * lists
        + _DICT_BYTES * dicts
        + _ENTRY_BYTES * entries
        + _REF_BYTES * (values + lists + dicts)
        + _SCALAR_BYTES * scalars
    )


def _check_decode_cost(body: bytes) -> None:
    """Refuse (400) a body whose decoded objects would cost too much memory."""
    cap = DECODE_COST_FACTOR * len(body) + DECODE_COST_SLACK
    estimate = estimated_decoded_bytes(body)
    if estimate > cap:
        raise InvalidRequest(
            f"request body is too costly to decode: its {len(body)} bytes of JSON would "
            f"become about {estimate // 1_048_576} MiB of objects, over the "
            f"{cap // 1_048_576} MiB allowed for a body of this size "
            f"({DECODE_COST_FACTOR}x its size + 1 MiB); send fewer, larger values"
        )


def parse_json_object(body: bytes) -> JSONObject:
    """Decode a request body that must be one JSON object (else 400).

    A body over ``DECODE_CHECK_FROM_BYTES`` is first priced by
    :func:`estimated_decoded_bytes` and refused (400) over the cap.
    """
    if not body or body.isspace():
        raise InvalidRequest("request body is empty; expected a JSON object")
    if len(body) > DECODE_CHECK_FROM_BYTES:
        _check_decode_cost(body)
    try:
        value = _decode(body)
    except (ValueError, msgspec.DecodeError):  # incl. UnicodeDecodeError
        raise InvalidRequest("request body is not valid JSON (or not valid UTF-8)") from None
    except RecursionError:  # absurdly deep nesting, e.g. [[[[...]]]]
        raise InvalidRequest("request body is nested too deeply") from None
    if not isinstance(value, dict):
        raise InvalidRequest("request body must be a JSON object")
    return value
