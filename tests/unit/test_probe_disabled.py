"""The features a probe does not record travel in its hello and the sidecar exports them:
one ``kvscope_probe_feature_disabled`` series each, none when everything matches. A hello
from a probe before the field decodes as nothing disabled."""

from __future__ import annotations

import msgspec

from kvscope.state.hub import Hub
from kvscope_probe import wire
from tests.unit.test_hub import feed, keyframe
from tests.unit.test_metrics import L, registry_for
from tests.unit.test_wire import frame, hello

OFF = {"uncache": "BlockPool.evict_blocks parameter 1 is ids, not block_ids",
       "kv_holding": "Scheduler has no kv_holding_waiting"}


def test_the_hello_carries_what_is_off() -> None:
    parts = wire.encode(frame([hello(disabled=OFF)]))
    assert wire.decode(parts).records[0].disabled == OFF  # type: ignore[union-attr]


def test_a_hello_from_an_older_probe_decodes_as_nothing_off() -> None:
    tag, body = wire.encode(frame([hello()]))
    raw = msgspec.msgpack.decode(body)  # records: the Frame's 6th field
    fields = wire.Hello.__struct_fields__  # the Hello as a probe without ``disabled``
    raw[5][0] = raw[5][0][:1 + fields.index("disabled")]  # (and what came after it) encodes it
    old = wire.decode([tag, msgspec.msgpack.encode(raw)]).records[0]
    assert isinstance(old, wire.Hello) and old.disabled == {} and old == hello()


def test_the_sidecar_exports_one_series_per_disabled_feature() -> None:
    hub = Hub()
    assert feed(hub, [hello(disabled=OFF), keyframe()], 0)
    v = registry_for(hub).get_sample_value
    assert v("kvscope_probe_feature_disabled", {**L, "feature": "uncache"}) == 1
    assert v("kvscope_probe_feature_disabled", {**L, "feature": "kv_holding"}) == 1
    assert v("kvscope_probe_feature_disabled", {**L, "feature": "need"}) is None


def test_nothing_off_exports_no_series() -> None:
    hub = Hub()
    assert feed(hub, [hello(), keyframe()], 0)
    samples = [s for m in registry_for(hub).collect() for s in m.samples
               if s.name == "kvscope_probe_feature_disabled"]
    assert samples == []
