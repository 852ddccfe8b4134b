"""The settings ``kvscope whatif`` compares: a grid of flag values or named settings.

A setting is a few ``key:value`` pairs over the twin's knobs. The pool is sized by exactly
one of ``blocks`` (null block included, as ``--num-gpu-blocks-override``), ``kv_tokens``
(``blocks = kv_tokens // block_size``) or ``kv_bytes`` (``blocks = kv_bytes //
(bytes_per_token * block_size)``). The last two size the pool as vLLM does from KV memory:
the null block comes out of the same memory, so comparing block sizes at one ``kv_tokens``
is fair. ``kv_bytes`` sizes the tiny Llama's full-attention pool; other layouts are sized
in ``blocks`` or ``kv_tokens`` (their groups share the pool, vLLM plans how).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kvscope.models.config import llama_config
from kvscope.twin.config import GROUP_KINDS, LAYOUTS, POLICIES, TwinConfig

CAPACITY_KEYS = ("blocks", "kv_tokens", "kv_bytes")
KEYS = ("block_size", *CAPACITY_KEYS, "max_seqs", "budget", "scheduled_tokens",
        "policy", "prefix_caching",
        "layout", "groups", "sliding_window", "async_scheduling", "spec_tokens", "watermark")
MAX_SETTINGS = 32
_BOOLS = {"on": True, "true": True, "yes": True, "1": True,
          "off": False, "false": False, "no": False, "0": False}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def tiny_model_bytes_per_token() -> int:
    """KV bytes one token takes in the tiny Llama: K and V, every layer, float32."""
    m = llama_config()
    return 2 * m["num_hidden_layers"] * m["num_key_value_heads"] * m["head_dim"] * 4


def parse_bytes(text: str) -> int:
    """``"12MiB"`` -> 12582912; decimal (kB, MB, GB) and binary (KiB, MiB, GiB) units."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match and _UNITS.get(match.group(2).lower())
    if not match or unit is None:
        raise ValueError(f"not a byte size: {text!r} (use e.g. 1536, 12MiB, 1.5GB)")
    return int(float(match.group(1)) * unit)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"must be a positive integer, got {text!r}")
    return value


def _scheduled(text: str) -> int | None:
    """``auto`` (vLLM's default: the budget, ``max_num_batched_tokens``) or a positive
    count, as ``--max-num-scheduled-tokens`` takes it."""
    return None if text == "auto" else _positive(text)


def _policy(text: str) -> str:
    if text not in POLICIES:
        raise ValueError(f"must be one of {', '.join(POLICIES)}, got {text!r}")
    return text


def _layout(text: str) -> str:
    if text not in LAYOUTS:
        raise ValueError(f"must be one of {', '.join(LAYOUTS)}, got {text!r}")
    return text


def parse_groups(text: str) -> tuple[str, ...]:
    """``"sliding*5+full"`` -> five ``sliding`` groups then one ``full``; ``""`` -> ()."""
    out: list[str] = []
    for part in filter(None, (p.strip() for p in text.split("+"))):
        kind, star, times = part.partition("*")
        n = _positive(times) if star else 1
        if kind.strip() not in GROUP_KINDS:
            raise ValueError(f"must be {', '.join(GROUP_KINDS)} groups joined by + (a "
                             f"run as kind*N), got {text!r}")
        out += [kind.strip()] * n
    return tuple(out)


def format_groups(groups: tuple[str, ...]) -> str:
    """What ``parse_groups`` reads back: runs of one kind as ``kind*N``."""
    runs = [(k, len(list(g))) for k, g in itertools.groupby(groups)]
    return "+".join(k if n == 1 else f"{k}*{n}" for k, n in runs)


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"must be a whole number, got {text!r}")
    return value


def _fraction(text: str) -> float:
    """``--watermark``'s range as vLLM's ``SchedulerConfig`` takes it: [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise ValueError(f"must be a fraction of the pool in [0, 1), got {text!r}")
    return value


def _bool(text: str) -> bool:
    if text.lower() not in _BOOLS:
        raise ValueError(f"must be on or off, got {text!r}")
    return _BOOLS[text.lower()]


PARSERS: dict[str, Callable[[str], Any]] = {
    "block_size": _positive, "blocks": _positive, "kv_tokens": _positive,
    "kv_bytes": parse_bytes, "max_seqs": _positive, "budget": _positive,
    "scheduled_tokens": _scheduled,
    "policy": _policy, "prefix_caching": _bool, "layout": _layout, "groups": parse_groups,
    "sliding_window": _positive, "async_scheduling": _bool, "spec_tokens": _count,
    "watermark": _fraction,
}


@dataclass(frozen=True)
class Setting:
    """One column of the comparison."""

    name: str
    config: TwinConfig
    capacity: str
    """How the pool was sized, as given: ``blocks:48``, ``kv_tokens:1536``, ..."""


def _config(raw: dict[str, str], base: TwinConfig, bytes_per_token: int,
            where: str, errors: list[str]) -> tuple[TwinConfig, str] | None:
    values: dict[str, Any] = {}
    for key, text in raw.items():
        try:
            values[key] = PARSERS[key](text)
        except ValueError as exc:
            errors.append(f"{where}: {key} {exc}")
    if len(values) != len(raw):
        return None
    cfg = replace(base, block_size=values["block_size"], max_num_seqs=values["max_seqs"],
                  max_num_batched_tokens=values["budget"],
                  max_num_scheduled_tokens=values["scheduled_tokens"], policy=values["policy"],
                  enable_prefix_caching=values["prefix_caching"], layout=values["layout"],
                  groups=values["groups"],
                  sliding_window=values["sliding_window"],
                  async_scheduling=values["async_scheduling"],
                  num_speculative_tokens=values["spec_tokens"],
                  watermark=values["watermark"])
    (key, amount), = ((k, values[k]) for k in CAPACITY_KEYS if k in values)
    if key == "kv_bytes" and cfg.layout != "full":
        errors.append(f"{where}: kv_bytes sizes a full-attention pool; give blocks or "
                      f"kv_tokens for layout {cfg.layout}")
        return None
    per_block = {"blocks": 0, "kv_tokens": 1, "kv_bytes": bytes_per_token}[key] * cfg.block_size
    blocks = amount // per_block if per_block else amount
    problems = replace(cfg, num_blocks=blocks).validate()
    capacity = f"{key}:{raw[key]}"
    sized = "" if key == "blocks" else f" ({capacity} -> {blocks} blocks of {cfg.block_size})"
    errors += [f"{where}{sized}: {p}" for p in problems]
    return (replace(cfg, num_blocks=blocks), capacity) if not problems else None


def _valid(key: str, values: list[str], errors: list[str]) -> list[str]:
    """The values of one axis flag that parse; the others reported once each."""
    good = []
    for text in values:
        try:
            PARSERS[key](text)
            good.append(text)
        except ValueError as exc:
            errors.append(f"--{key.replace('_', '-')}: {exc}")
    return good


def _split_pairs(spec: str, where: str, errors: list[str]) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition(":")
        key = key.strip().replace("-", "_")
        if not sep or not value.strip():
            errors.append(f"{where}: {part!r} is not key:value")
        elif key not in KEYS:
            errors.append(f"{where}: unknown key {key!r} (keys: {', '.join(KEYS)})")
        elif key in pairs:
            errors.append(f"{where}: {key} given twice")
        else:
            pairs[key] = value.strip()
    if sum(k in pairs for k in CAPACITY_KEYS) > 1:
        errors.append(f"{where}: give one of {', '.join(CAPACITY_KEYS)}, not several")
    return pairs


def build(axes: dict[str, list[str]], named: list[str], *, max_model_len: int,
          bytes_per_token: int, errors: list[str],
          model: dict[str, Any] | None = None) -> list[Setting]:
    """The settings to compare, appending every problem to ``errors``.

    ``axes`` maps each key to the values given for it (an empty list: the default).
    Without ``named`` settings their product is the grid; with them, each axis holds at
    most one value, which fills the keys a named setting leaves out. ``model``: the
    TwinConfig fields of the served model (``KvModel.twin_fields``), the tiny one's if None.
    """
    base = TwinConfig(max_model_len=max_model_len, **(model or {}))
    axes = {k: _valid(k, v, errors) for k, v in axes.items()}
    defaults = {"block_size": str(base.block_size), "max_seqs": str(base.max_num_seqs),
                "budget": str(base.max_num_batched_tokens),
                "scheduled_tokens": ("auto" if base.max_num_scheduled_tokens is None
                                     else str(base.max_num_scheduled_tokens)),
                "policy": base.policy,
                "prefix_caching": "on" if base.enable_prefix_caching else "off",
                "layout": base.layout, "groups": format_groups(base.groups),
                "sliding_window": str(base.sliding_window),
                "async_scheduling": "on" if base.async_scheduling else "off",
                "spec_tokens": str(base.num_speculative_tokens),
                "watermark": str(base.watermark)}
    given = [k for k in CAPACITY_KEYS if axes.get(k)]
    if len(given) > 1:
        errors.append("give one of --blocks, --kv-tokens, --kv-bytes; got "
                      + ", ".join("--" + k.replace("_", "-") for k in given))
        axes = {k: v for k, v in axes.items() if k not in given[1:]}  # check the rest
    if not given:
        defaults["blocks"] = str(base.num_blocks)
    grid = {k: axes.get(k) or [defaults[k]] for k in KEYS if axes.get(k) or k in defaults}
    columns = _named(grid, named, errors) if named else _product(grid)
    return _settings(columns, base, bytes_per_token, errors)


def _product(grid: dict[str, list[str]]) -> list[tuple[str, dict[str, str]]]:
    """Every combination, named by the keys that vary (in ``--setting`` syntax)."""
    varying = [k for k, v in grid.items() if len(v) > 1]
    columns = []
    for combo in itertools.product(*grid.values()):
        raw = dict(zip(grid, combo, strict=True))
        columns.append((",".join(f"{k}:{raw[k]}" for k in varying) or "base", raw))
    return columns


def _named(grid: dict[str, list[str]], named: list[str],
           errors: list[str]) -> list[tuple[str, dict[str, str]]]:
    """``[NAME=]key:value,...`` settings over the single-valued axis flags."""
    many = [k for k, v in grid.items() if len(v) > 1]
    if many:
        errors.append("--setting takes single-valued axis flags as its defaults; "
                      f"{', '.join(many)} has several values")
    columns = []
    for i, spec in enumerate(named, 1):
        name, sep, body = spec.partition("=")
        name = name.strip() if sep else spec.strip()
        pairs = _split_pairs(body if sep else spec, f"setting {name or i}", errors)
        sized = any(k in pairs for k in CAPACITY_KEYS)  # its own size replaces the flag's
        base = {k: v[0] for k, v in grid.items() if not (sized and k in CAPACITY_KEYS)}
        columns.append((name or f"setting{i}", base | pairs))
    return columns


def _settings(columns: list[tuple[str, dict[str, str]]], base: TwinConfig,
              bytes_per_token: int, errors: list[str]) -> list[Setting]:
    if len(columns) > MAX_SETTINGS:
        errors.append(f"{len(columns)} settings to compare; at most {MAX_SETTINGS}")
        return []
    names = [n for n, _ in columns]
    errors += [f"setting name {n!r} used twice" for n in sorted(set(names))
               if names.count(n) > 1]
    settings = []
    for name, raw in columns:
        if sum(k in raw for k in CAPACITY_KEYS) != 1:
            continue  # reported by _split_pairs or build
        made = _config(raw, base, bytes_per_token, f"setting {name}", errors)
        if made is not None:
            settings.append(Setting(name, *made))
    return settings
