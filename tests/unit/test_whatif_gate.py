"""The fidelity gate's arithmetic: figures from replay records, the error, what passes."""

from __future__ import annotations

from pathlib import Path

from kvscope.whatif.recorded import FIGURES, Fidelity, Figures, figures, has_outcomes


def rec(arrival: int, admitted: int | None, preempts: int, redo: int,
        free: int | None) -> dict[str, object]:
    return {"prompt_len": 10, "output_len": 5, "arrival_step": arrival,
            "admitted_step": admitted, "preempt_count": preempts,
            "recomputed_tokens": redo, "min_free_blocks": free}


def test_figures_of_records() -> None:
    records = [rec(0, 0, 0, 0, 9), rec(0, 3, 2, 40, 2), rec(5, 5, 1, 7, None),
               rec(6, None, 0, 0, None)]
    assert figures(records, 47) == Figures(preemptions=3, preempted_requests=2,
                                           recomputed_tokens=47, peak_used_blocks=45,
                                           waited_requests=1)
    assert figures([rec(0, 0, 0, 0, None)], 47).peak_used_blocks is None
    assert has_outcomes(records) and not has_outcomes([{"prompt_len": 3}])
    assert not has_outcomes([])


def test_gate_allows_ten_percent_and_at_least_one() -> None:
    server = Figures(30, 25, 1701, 47, 4)
    f = Fidelity("server", server, Figures(33, 26, 1531, 46, 5))
    assert [f.error(n) for n in FIGURES] == [3, 1, -170, -1, 1]
    assert [f.allowed(n) for n in FIGURES] == [3, 2, 170, 4, 1]
    assert f.trusted and f.failing() == []
    worse = Fidelity("server", server, Figures(34, 25, 1701, 47, 6))
    assert worse.failing() == ["preemptions", "waited_requests"] and not worse.trusted
    unknown = Fidelity("server", Figures(0, 0, 0, None, 0), Figures(0, 0, 0, 12, 0))
    assert unknown.error("peak_used_blocks") is None
    assert unknown.failing() == ["peak_used_blocks"]
    doc = worse.as_dict()
    assert doc["figures"]["preemptions"] == {"recorded": 30, "replayed": 34, "error": 4,
                                             "allowed": 3}
    assert doc["trusted"] is False


def test_safe_table_shows_the_band_and_warns_of_a_full_pool() -> None:
    from kvscope.twin.config import TwinConfig
    from kvscope.whatif.concurrency import TRIALS, Answer, Trial
    from kvscope.whatif.safe import render
    from kvscope.whatif.settings import Setting

    def trials(c: int, preempting: int, peak: int) -> list[Trial]:
        return [Trial(c, None if i == 0 else i, int(i < preempting), False, c, peak)
                for i in range(TRIALS)]

    # Safe for any timing at 1 (the two largest peaks, 30 + 20, overflow 47 blocks), no
    # trial preempts up to 2, every trial does from 3, the first wave alone from 4.
    answer = Answer(1, 2, 3, 4, 32, trials(1, 0, 20) + trials(2, 0, 47) + trials(3, TRIALS, 47)
                    + trials(4, TRIALS, 47), peaks=(30, 20, 10, 5))
    out = render("table", "w", [(Setting("base", TwinConfig(), "blocks:48"), answer)])
    lines = out.splitlines()
    shown = [x.split()[-1] for x in lines if x.startswith("concurrency ")]
    assert shown == [f"0/{TRIALS}", f"0/{TRIALS}", f"{TRIALS}/{TRIALS}"]  # the band: 1 to 3
    assert lines[-1].startswith("note: base: at the trials' answer a trial filled the pool")
    rows = {label: next(x for x in lines if x.startswith(label)).split()[-1] for label in (
        "safe concurrency (any client timing)", "its largest requests at their peak",
        "no preemption in any trial up to", "peak used blocks there (worst trial)",
        "first requests alone overflow from")}
    assert list(rows.values()) == ["1", "30/47", "2", "47/47", "4"]


def test_replay_notes_the_prefix_hits_it_cannot_rebuild(tmp_path: Path) -> None:
    from kvscope.whatif.replay import load

    path = tmp_path / "traffic.jsonl"
    path.write_text('{"prompt_len": 300, "output_len": 5, "cached_tokens": 256}\n'
                    '{"prompt_len": 30, "output_len": 5, "cached_tokens": 0}\n'
                    '{"prompt_len": 290, "output_len": 5, "cached_tokens": 128}\n')
    notes = load(path, seed=0, step_ms=20.0, max_model_len=1024).notes
    assert any(n.endswith("; 2 recorded requests had prefix-cache hits, where the replay "
                          "may part from the server") for n in notes)
