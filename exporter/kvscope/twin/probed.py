"""A twin with kvscope's probe attached and a sidecar Hub fed in the same process.

The one harness behind the twin tests, ``kvscope whatif`` and the benchmarks: vLLM's
real scheduler records through the real probe (hooks, recorder, encoder) into the real
sidecar code, with no socket in between. Frames are encoded and decoded exactly as the
receiver would see them.
"""

from __future__ import annotations

from typing import Any

from kvscope.state.engine import EngineState
from kvscope.state.hub import Hub
from kvscope.twin.config import TwinConfig
from kvscope_probe import plugin, wire
from kvscope_probe.recorder import Recorder
from kvscope_probe.sender import take_batch


class ProbedTwin:
    """``Twin`` + ``Recorder`` bound by hand + ``Hub``; call ``drain()`` after steps.

    ``keyframe_interval_s`` defaults to an hour: only the first keyframe is sent, so
    every later step is checked on op replay alone.
    """

    def __init__(self, cfg: TwinConfig, *, seed: int = 0, ring_size: int = 1 << 20,
                 keyframe_interval_s: float = 3600.0, hub: Hub | None = None) -> None:
        from kvscope.twin.engine import Twin

        if not plugin.enable(None):
            raise RuntimeError("the kvscope probe cannot attach to this vLLM")
        self.twin = Twin(cfg, seed=seed)
        self.scheduler = self.twin.scheduler
        self.rec = Recorder(self.scheduler, ring_size=ring_size,
                            keyframe_interval_s=keyframe_interval_s)
        plugin.bind(self.scheduler, self.rec)
        self.rec.push(self.rec.hello)
        self.hub = hub if hub is not None else Hub()

    @property
    def engine(self) -> str:
        return self.rec.hello.engine

    @property
    def state(self) -> EngineState:
        """The sidecar's view of this engine (after the first drain)."""
        return self.hub.engines[self.engine]

    def drain(self) -> None:
        """Everything the probe recorded so far, through the wire, into the hub."""
        rec = self.rec
        while rec.ring:
            frame = take_batch(rec)
            if not self.hub.accept(wire.encode(frame)):
                raise RuntimeError(f"the hub refused a frame of engine {frame.engine!r}")

    def run(self, requests: Any, **kwargs: Any) -> Any:
        """``Twin.run`` with the ring drained after every step (``on_step`` still called)."""
        on_step = kwargs.pop("on_step", None)

        def after(index: int, out: Any) -> None:
            self.drain()
            if on_step is not None:
                on_step(index, out)

        result = self.twin.run(requests, on_step=after, **kwargs)
        self.drain()
        return result
