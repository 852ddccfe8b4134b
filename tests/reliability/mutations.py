"""Mutations of real probe frames for the wire fuzz test (test_fuzz_wire.py): truncation,
bit flips, inserted and deleted bytes, wrong types, huge and negative numbers, NaN, huge
lists and strings, unknown versions and tags, wrong part counts, out-of-range block IDs,
foreign identities, duplicated, dropped and reordered records.

Each mutation of the encoded body returns the frame's parts; each mutation of the decoded
object changes it in place. Both take what they need of ``rng`` in a fixed order, so a
seed gives the same frames every run.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable
from typing import Any

import msgspec

from kvscope_probe import wire

_raw = msgspec.msgpack.Encoder()

WEIRD: list[Any] = [None, True, False, 0, -1, 1, 2**31, -(2**31), 2**63 - 1, -(2**63),
                    2**64 - 1, 0.0, -0.0, math.nan, math.inf, -math.inf, 1e308, "", "x" * 5000,
                    "\u0000\u202e\U0010ffff", b"\xff\xfe", [], {},
                    [[[[[]]]]], {"": None}, [1, "a", None]]


def leaves(obj: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            out += leaves(v, (*path, i))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out += leaves(v, (*path, k))
    return out


def set_at(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    parent = obj
    for k in path[:-1]:
        parent = parent[k]
    parent[path[-1]] = value
    return obj


def get_at(obj: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        obj = obj[k]
    return obj


def block_id_paths(obj: Any) -> list[tuple[Any, ...]]:
    """Paths of integers inside the ops of steps and the block tables (block IDs)."""
    return [p for p in leaves(obj) if isinstance(get_at(obj, p), int) and len(p) >= 5]


def truncate(rng: random.Random, tag: bytes, body: bytes) -> list[bytes]:
    return [tag, body[: rng.randrange(len(body) + 1)]]


def bitflip(rng: random.Random, tag: bytes, body: bytes) -> list[bytes]:
    b = bytearray(body)
    for _ in range(rng.randint(1, 8)):
        i = rng.randrange(len(b))
        b[i] ^= 1 << rng.randrange(8)
    return [tag, bytes(b)]


def splice(rng: random.Random, tag: bytes, body: bytes) -> list[bytes]:
    i = rng.randrange(len(body) + 1)
    junk = rng.randbytes(rng.randint(1, 16)) if rng.random() < 0.5 else b""
    return [tag, body[:i] + junk + body[i + rng.randint(0, 16):]]


def wrong_version(rng: random.Random, tag: bytes, body: bytes) -> list[bytes]:
    newer = b"kvscope/%d" % (wire.WIRE_VERSION + 1)
    return [rng.choice([b"kvscope/0", newer, b"kvscope/1 ", b"kvscope/", b"KVSCOPE/1",
                        b"", rng.randbytes(9)]), body]


def wrong_parts(rng: random.Random, tag: bytes, body: bytes) -> list[bytes]:
    return rng.choice([[tag], [tag, body, body], [], [body, tag], [tag, b""]])


def wrong_types(rng: random.Random, obj: Any, num_blocks: int) -> None:
    paths = leaves(obj)
    for _ in range(rng.randint(1, 3)):
        set_at(obj, rng.choice(paths[1:]), copy.deepcopy(rng.choice(WEIRD)))
        paths = leaves(obj)


def odd_number(rng: random.Random, obj: Any, num_blocks: int) -> None:
    ints = [p for p in leaves(obj) if isinstance(get_at(obj, p), (int, float))
            and not isinstance(get_at(obj, p), bool)]
    if ints:
        set_at(obj, rng.choice(ints), rng.choice(
            [0, -1, -(2**40), 2**40, 2**63 - 1, -(2**63), 2**64 - 1, math.nan, math.inf,
             num_blocks, num_blocks + 1, rng.randint(-(10**6), 10**6)]))


def bad_block_ids(rng: random.Random, obj: Any, num_blocks: int) -> None:
    ids = block_id_paths(obj)
    for p in rng.sample(ids, min(len(ids), rng.randint(1, 3))):
        set_at(obj, p, rng.choice([0, -1, num_blocks, num_blocks + 7, 2**31 - 1, 2**62,
                                   -(2**63)]))


def huge_list(rng: random.Random, obj: Any, num_blocks: int) -> None:
    lists = [p for p in leaves(obj) if isinstance(get_at(obj, p), list) and p
             and all(not isinstance(v, (list, dict)) for v in get_at(obj, p))]
    if lists:
        p = rng.choice(lists)
        cur = get_at(obj, p)
        set_at(obj, p, (cur or [1]) * (200_000 // max(1, len(cur or [1]))))


def huge_string(rng: random.Random, obj: Any, num_blocks: int) -> None:
    strs = [p for p in leaves(obj) if isinstance(get_at(obj, p), str)]
    if strs:
        set_at(obj, rng.choice(strs), "\u00e9" * 1_000_000)


def wrong_identity(rng: random.Random, obj: Any, num_blocks: int) -> None:
    field = rng.choice([0, 1, 2, 3, 4])  # engine, session, first_seq, dropped, faults
    obj[field] = rng.choice([str(rng.randrange(4)), "api:x", "", "s" * 300,
                             rng.randrange(-5, 10**6), 2**63 - 1, -1])


def reorder_records(rng: random.Random, obj: Any, num_blocks: int) -> None:
    recs = obj[5] if isinstance(obj, list) and len(obj) > 5 else None
    if isinstance(recs, list) and recs:
        op = rng.choice(["dup", "drop", "shuffle", "foreign"])
        if op == "dup":
            recs.extend(rng.choices(recs, k=rng.randint(1, 50)))
        elif op == "drop":
            del recs[rng.randrange(len(recs))]
        elif op == "shuffle":
            rng.shuffle(recs)
        else:
            recs.append(["client_start", "kvs" + "0" * 32, 1.0, "chat", "", "", "", "",
                         "", 0, -1])


ON_BYTES: dict[str, Callable[[random.Random, bytes, bytes], list[bytes]]] = {
    "truncate": truncate, "bitflip": bitflip, "splice": splice, "version": wrong_version,
    "parts": wrong_parts}
ON_OBJECT: dict[str, Callable[[random.Random, Any, int], None]] = {
    "type": wrong_types, "number": odd_number, "block_id": bad_block_ids,
    "huge_list": huge_list, "huge_string": huge_string, "identity": wrong_identity,
    "records": reorder_records}
WEIGHTS = {"truncate": 10, "bitflip": 14, "splice": 6, "type": 18, "number": 10,
           "block_id": 10, "huge_list": 2, "huge_string": 2, "version": 6, "parts": 3,
           "identity": 8, "records": 6, "valid": 5}
"""How often each mutation is drawn; ``valid`` sends the real frame unchanged."""


def mutate(rng: random.Random, base: list[bytes], num_blocks: int) -> tuple[str, list[bytes]]:
    tag, body = base
    kind = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
    if kind in ON_BYTES:
        return kind, ON_BYTES[kind](rng, tag, body)
    obj = msgspec.msgpack.decode(body)
    if kind == "valid":
        return kind, base
    ON_OBJECT[kind](rng, obj, num_blocks)
    return kind, [tag, _raw.encode(obj)]
