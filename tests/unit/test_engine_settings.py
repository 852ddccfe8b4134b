"""A recorded engine's settings rebuilt for the twin (``kvscope.whatif.engine_settings``):
the spec ``kvscope whatif --baseline`` takes, and a refusal with the reason wherever the
twin would be answering for another engine."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvscope.state.hub import Hub
from kvscope.state.requests import engine_config
from kvscope.twin.config import TwinConfig
from kvscope.whatif.engine_settings import NotReplayable, from_config
from kvscope.whatif.settings import format_groups, parse_groups
from kvscope_probe import wire
from tests.unit.test_hub import keyframe
from tests.unit.test_wire import frame, hello

FULL = "FullAttentionSpec"
SLIDING = "SlidingWindowSpec"


def row(**over: Any) -> dict[str, Any]:
    """An engine_configs row of a 6,250-block Llama-like server (one full group)."""
    base: dict[str, Any] = {
        "num_blocks": 6250, "block_size": 16, "kv_group_kinds": [FULL],
        "kv_group_block_sizes": [16], "kv_group_windows": [0], "max_num_batched_tokens": 8192,
        "max_num_seqs": 256, "max_model_len": 32768, "policy": "fcfs", "prefix_caching": True,
        "async_scheduling": True, "spec_tokens": 0}
    return base | over


def test_a_32k_context_server_is_rebuilt_as_it_ran() -> None:
    got = from_config(row())
    assert got.spec == ("blocks:6250,block_size:16,max_seqs:256,budget:8192,policy:fcfs,"
                        "prefix_caching:on,layout:full,async_scheduling:on,spec_tokens:0")
    assert got.max_model_len == 32768
    assert got.config() == TwinConfig(
        block_size=16, num_blocks=6250, max_num_seqs=256, max_num_batched_tokens=8192,
        max_model_len=32768, policy="fcfs", enable_prefix_caching=True, layout="full",
        async_scheduling=True, num_speculative_tokens=0, max_position_embeddings=32768)


def test_a_step_budget_below_the_batch_is_carried_and_checked_as_vllm_does() -> None:
    """The hello's token_budget is vLLM's max_num_scheduled_tokens: carried as the
    ``scheduled_tokens`` key where it differs from max_num_batched_tokens, left out
    (vLLM's default) where it does not; SchedulerConfig's bound (at least 1) checked."""
    got = from_config(row(token_budget=6144))
    assert "budget:8192,scheduled_tokens:6144,policy" in got.spec
    assert got.config().max_num_scheduled_tokens == 6144
    same = from_config(row(token_budget=8192))
    assert "scheduled_tokens" not in same.spec
    assert same.config().max_num_scheduled_tokens is None
    (error,) = TwinConfig(max_num_scheduled_tokens=0).validate()
    assert error == "max_num_scheduled_tokens must be at least 1, got 0."


def test_sliding_window_groups_carry_their_window() -> None:
    got = from_config(row(kv_group_kinds=[SLIDING, SLIDING, FULL],
                          kv_group_block_sizes=[16, 16, 16], kv_group_windows=[512, 512, 0],
                          max_model_len=2048, async_scheduling=False, spec_tokens=2,
                          policy="priority", prefix_caching=False))
    cfg = got.config()
    assert (cfg.layout, cfg.sliding_window, cfg.num_speculative_tokens, cfg.policy,
            cfg.enable_prefix_caching, cfg.async_scheduling) == (
        "full+sliding", 512, 2, "priority", False, False)
    assert cfg.max_position_embeddings == 4096  # the twin's own bound where it is larger


def test_a_gemma_3s_six_groups_are_kept_group_for_group() -> None:
    got = from_config(row(kv_group_kinds=[SLIDING] * 5 + [FULL], kv_group_block_sizes=[16] * 6,
                          kv_group_windows=[1024] * 5 + [0], max_model_len=8192))
    assert "layout:full+sliding,groups:sliding*5+full,sliding_window:1024," in got.spec
    cfg = got.config()
    assert cfg.groups == ("sliding",) * 5 + ("full",) and cfg.sliding_window == 1024


@pytest.mark.parametrize(("over", "why"), [
    ({"kv_group_kinds": ["MLAAttentionSpec"]}, "include MLAAttentionSpec: the twin builds"),
    ({"kv_group_kinds": [SLIDING, SLIDING, FULL, FULL], "kv_group_block_sizes": [16] * 4,
      "kv_group_windows": [512, 512, 0, 0]}, "not a grouping vLLM's planner makes"),
    ({"kv_group_kinds": [FULL, FULL], "kv_group_block_sizes": [16, 16],
      "kv_group_windows": [0, 0]}, "not a grouping vLLM's planner makes"),
    ({"kv_group_kinds": ["MambaSpec", FULL], "kv_group_block_sizes": [528, 16],
      "kv_group_windows": [0, 0]}, "block sizes [16, 528], the pool 16"),
    ({"kv_group_kinds": [SLIDING, SLIDING, FULL], "kv_group_block_sizes": [16, 16, 16],
      "kv_group_windows": [512, 4096, 0]}, "windows [512, 4096]"),
    ({"max_model_len": 0}, "did not report max_model_len"),
])
def test_what_the_twin_cannot_build_is_refused_with_why(over: dict[str, Any],
                                                         why: str) -> None:
    with pytest.raises(NotReplayable) as info:
        from_config(row(**over))
    assert why in str(info.value)


def test_a_hello_from_a_probe_before_the_settings_is_refused_not_guessed() -> None:
    tag, body = wire.encode(frame([hello(max_model_len=1024, async_scheduling=True,
                                         spec_tokens=2), keyframe()]))
    raw = msgspec.msgpack.decode(body)  # records: the Frame's 6th field, the tag first
    fields = wire.Hello.__struct_fields__
    raw[5][0] = raw[5][0][:1 + fields.index("max_model_len")]  # as an older probe sends it
    hub = Hub()
    assert hub.accept([tag, msgspec.msgpack.encode(raw)])
    row = engine_config(hub.engines["0"])
    assert (row.max_model_len, row.async_scheduling, row.spec_tokens) == (0, False, 0)
    assert row.kv_group_windows == [0]
    with pytest.raises(NotReplayable, match="did not report max_model_len"):
        from_config({f: getattr(row, f) for f in row.__slots__})


def test_groups_are_checked_against_the_layout_and_read_back_as_written() -> None:
    assert parse_groups("sliding*5+full") == ("sliding",) * 5 + ("full",)
    assert format_groups(("mamba", "mamba", "full")) == "mamba*2+full"
    assert parse_groups("") == ()
    with pytest.raises(ValueError, match="full, sliding, mamba groups joined by"):
        parse_groups("sliding+mla")
    (error,) = TwinConfig(layout="full", groups=("sliding", "full")).validate()
    assert error == "groups must be full groups for layout full, got sliding+full."


def test_an_engines_settings_are_written_again_within_the_stores_retention() -> None:
    """The row was written once per probe session, stamped with its hello: after
    --clickhouse-ttl-days of uptime the store dropped it, and every later trace of that
    engine fell out of tail_waste_by_prompt_len and explain --counterfactual ("no stored
    configuration"). It is written again each CONFIG_EVERY_S of engine time, stamped
    with the step that wrote it."""
    from kvscope.rows import EngineConfig
    from kvscope.state.requests import CONFIG_EVERY_S, RequestTracker
    from tests.unit.test_hub import feed
    from tests.unit.test_wire import step

    hub = Hub()
    rows: list[object] = []
    hub.listeners.append(RequestTracker(rows.append).on_event)
    t0 = 1_800_000_000.0
    kf = wire.Keyframe(hello=hello(ts=t0), states=bytes([3] + [0] * 7), tables={}, tokens={})
    feed(hub, [hello(ts=t0), kf], 0)
    feed(hub, [step(ts=t0 + s) for s in (1.0, CONFIG_EVERY_S - 1, CONFIG_EVERY_S + 2,
                                         2 * CONFIG_EVERY_S + 2.5)], 2)
    got = [r for r in rows if isinstance(r, EngineConfig)]
    assert [r.ts for r in got] == [t0, t0 + CONFIG_EVERY_S + 2, t0 + 2 * CONFIG_EVERY_S + 2.5]
    assert len({(r.session, r.num_blocks, tuple(r.kv_group_kinds)) for r in got}) == 1
