"""The blocks-needed hook keeps vLLM's signature and records what each call returned."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvscope_probe.needhook import _source, need_hook


class Coord:
    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   apply_admission_cap: bool = False, prefill_end: int = 0,
                                   *, extra: int = 5) -> int:
        self.seen = (request_id, num_tokens, apply_admission_cap, prefill_end, extra)
        return num_tokens + prefill_end + extra


class Loose:
    def get_num_blocks_to_allocate(self, *args: Any, **kwargs: Any) -> int:
        return len(args) + len(kwargs)


def test_the_hook_has_vllms_signature_and_passes_every_argument_through() -> None:
    coord, rec = Coord(), SimpleNamespace(need=None)
    hook = need_hook(Coord.get_num_blocks_to_allocate, coord, rec)
    assert _source(Coord.get_num_blocks_to_allocate) is not None  # the generated kind
    assert hook(request_id="a", num_tokens=3) == 8
    assert coord.seen == ("a", 3, False, 0, 5) and rec.need == ("a", 8)
    assert hook("b", 2, True, prefill_end=4, extra=1) == 7
    assert coord.seen == ("b", 2, True, 4, 1) and rec.need == ("b", 7)


def test_a_signature_it_cannot_copy_gets_the_generic_hook() -> None:
    coord, rec = Loose(), SimpleNamespace(need=None)
    assert _source(Loose.get_num_blocks_to_allocate) is None
    hook = need_hook(Loose.get_num_blocks_to_allocate, coord, rec)
    # Positionally, which argument is the request is not known: no guess (args[0] was
    # an IndexError when vLLM passed keywords only to a method with another first name).
    assert hook("r", 1, x=2) == 3 and rec.need is None
    assert hook(request_id="s") == 1 and rec.need == ("s", 1)
