"""The answer as text for a terminal or a ticket."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any


def clock(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%H:%M:%S.%f")[:-3]


def render(answer: dict[str, Any]) -> str:
    lines = [f"request {answer['request_id']}"]
    for a in answer["api_requests"]:
        lines.append(f"  API request {a['request_id']}: client {a['client_id'] or '-'}, "
                     f"user agent {a['user_agent'] or '-'}, {a['endpoint']} -> "
                     f"{a['http_status']} in {a['duration_s']:.3f} s (client side)")
    for r in answer["engine_requests"]:
        lines += [""] + engine_request(r)
    return "\n".join(lines)


def engine_request(r: dict[str, Any]) -> list[str]:
    t = r["trace"]
    out = [f"engine request {r['request_id']} on {r['server'] or '-'} engine {r['engine']} "
           f"({r['model']})"]
    if t:
        out.append(_trace_line(t))
    out.append(f"  verdict: {r['verdict']}")
    if r["lost"] is None:
        out.append("  where the time went: not known (the story is incomplete)")
        out += [f"    {why}" for why in r["incomplete"]]
    else:
        out.append("  where the time went:")
    for k in ("waiting", "preempted", "recomputing", "running", "total") if r["lost"] else ():
        span = r["lost"][k]
        note = "  (part of running)" if k == "recomputing" else ""
        out.append(f"    {k:<12} {span['seconds']:>10.3f} s {span['steps']:>7} steps{note}")
    if r.get("outside_engine_s") is not None:
        out.append(f"    {'outside':<12} {r['outside_engine_s']:>10.3f} s  (the API server's "
                   "time beyond the engine's: HTTP, detokenizing)")
    out.append("  timeline:")
    for e in r["timeline"]:
        out.append(f"    {clock(e['ts'])}  step {e['step']:>6}  {e['event']:<9} "
                   + _event_facts(e))
    for i, p in enumerate(r["preemptions"], 1):
        out += _preemption(i, p)
    if r["waiting"]:
        out += _waiting(r["waiting"])
    if not r["preemptions"] and r["lost"] is not None:
        out.append("  never preempted")
    if "counterfactual" in r:
        out += counterfactual(r["counterfactual"])
    return out


def _trace_line(t: dict[str, Any]) -> str:
    """The trace's sizes. Its ``required_blocks`` count every KV cache group at the whole
    sequence, which sliding-window and Mamba groups never hold: said as that, beside the
    most blocks it held at once (what it took)."""
    cap = t["max_gen_len"] if t["max_gen_len"] >= 0 else "? (its arrival was not seen)"
    held = t["allocated_blocks"] if t["allocated_blocks"] >= 0 else "?"
    return (f"  prompt {t['prompt_len']} tokens, output {t['output_len']} of "
            f"{cap}, {plural(t['required_blocks'], 'block')} at its full length "
            f"in all its KV cache groups ({held} held at most), "
            f"{t['finish_reason']}, client {t['client_id'] or '-'}")


def counterfactual(cf: dict[str, Any]) -> list[str]:
    out = [f"  counterfactual: the {cf['window']} requests of the window replayed on the twin"]
    if "settings" in cf:
        where = ("as the engine's probe reported them" if cf["settings"]["from"] == "engine"
                 else "as given")
        out.append(f"    server's settings ({where}): {cf['settings']['spec']}")
    if "fidelity" not in cf:
        return out + [f"    not run: {'; '.join(cf['errors'])}"]
    fid = cf["fidelity"]
    for name, f in fid["figures"].items():
        out.append(f"    {name:<20} server {f['recorded']}  twin {f['replayed']}  "
                   f"error {f['error']} (allowed {f['allowed']})")
    if not fid["trusted"]:
        return out + [f"    the fidelity gate FAILS ({', '.join(fid['failing'])}): the twin "
                      "does not reproduce this window, so no counterfactual is shown"]
    rec, srv = cf["recorded"], cf["server"]
    out.append(f"    this request: recorded {rec['preemptions']} preemptions, "
               f"{rec['latency_steps']} steps; twin, server's settings: "
               f"{srv['preemptions']}, {srv['latency_steps']} steps")
    for a in cf["alternatives"]:
        if a.get("refused"):
            out.append(f"    {a['setting']:<16} vLLM would refuse: {a['refused']}")
            continue
        out.append(f"    {a['setting']:<16} {a['preemptions']} preemptions, "
                   f"{a['latency_steps']} steps")
    return out


def _event_facts(e: dict[str, Any]) -> str:
    facts = []
    for k in ("blocks", "total_blocks", "free_blocks", "tokens"):
        if e[k] >= 0:
            facts.append(f"{k}={e[k]}")
    if e["reason"]:
        facts.append(f"reason={e['reason']}")
    if e["detail"]:
        facts.append(e["detail"])
    return " ".join(facts)


def _preemption(i: int, p: dict[str, Any]) -> list[str]:
    trig = p["trigger"]
    out = [f"  preemption {i} at step {p['step']} ({clock(p['ts'])}): {p['reason']}, "
           f"policy {p['policy'] or '?'}",
           f"    requester {p['requester'] or '-'} needed {_blocks(p['blocks_needed'])}; free "
           f"{p['free_blocks']}, evictable cached ones included ({_cached(p)}); it lost "
           f"{_blocks(p['victim_blocks'])} and {p['tokens_lost']} computed tokens",
           "    trigger: " + ("itself: it needed a block and was the one vLLM's policy picks"
                              if p["requester_is_victim"] else
                              f"{trig['event']} in that step, +{_blocks(trig['blocks'])}" if trig
                              else "no admission or growth of the requester recorded there"),
           "    resumed: " + (f"step {p['resumed']['step']}" if p["resumed"] else "never")]
    return out + _holders(p["holders"])


def _waiting(w: dict[str, Any]) -> list[str]:
    """While it waited: the decisions naming it, whether it could ever fit the pool (what
    was compared), the pool's holders."""
    fit = w["could_fit"]
    full, usable, required = (fit["full_attention_blocks"], fit["usable_blocks"],
                              fit["required_blocks"])
    if full >= 0 and usable >= 0:
        compared = (f"{full} blocks at its full length" if full == required else
                    f"{full} blocks of its full-attention groups at its full length")
        compared += f", of {usable} usable"
        if full != required:
            compared += (f"; {required} in all groups, where sliding-window and Mamba groups "
                         "hold fewer")
    elif fit["never_fits_decisions"]:
        compared = "the sidecar's never_fits decision names it"
    else:
        compared = f"as far as is known ({_unknown(fit)})"
    verdict = "could fit the pool" if fit["fits"] else "could NEVER fit the pool"
    n = w["admission_blocked"]
    named = f"{plural(n, 'admission_blocked decision')} name{'s' * (n == 1)} it"
    if w["admission_blocked_reasons"]:  # the limit vLLM's waiting loop met first, each time
        named += " (" + ", ".join(f"{r or 'unnamed'} {k}" for r, k in
                                  sorted(w["admission_blocked_reasons"].items())) + ")"
    line = f"  while it waited (step {w['step']}): {named}; it {verdict} "
    line += compared if compared.startswith("as far") else f"({compared})"
    return [line, *_holders(w["holders"])]


def _unknown(fit: dict[str, Any]) -> str:
    """What the store lacks to size a waiting request against its pool."""
    missing = []
    if fit["required_blocks"] < 0:
        missing.append("no trace of it to size it")
    elif fit["full_attention_blocks"] < 0:
        missing.append("no engine settings stored to tell its full-attention groups")
    if fit["usable_blocks"] < 0:
        missing.append("no pool size stored")
    return "; ".join(missing)


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' * (n != 1)}"


def _blocks(n: int) -> str:
    return plural(n, "block")


def _cached(p: dict[str, Any]) -> str:
    """The evictable cached blocks, dated: they come from a layout sample (one a second),
    not from the preemption's step; vLLM counts them among the free blocks."""
    if p["layout"] is None or p["cached_evictable_blocks"] < 0:
        return "no layout sample at or before it to count them"
    return (f"{p['cached_evictable_blocks']} cached in the layout sample of step "
            f"{p['layout']['step']}")


def _holders(h: dict[str, Any] | None) -> list[str]:
    """The requests' block tables summed: a block shared through the prefix cache is in
    several tables, so the sum can pass the pool's size (``holders.top_holders``)."""
    if not h:
        return []
    out = [f"    held as the step began: {_blocks(h['held_blocks'])} in {h['requests']} "
           "requests' block tables (a block shared through the prefix cache counts in each "
           "table); top:"]
    for label, key in (("request", "by_request"), ("client", "by_client"),
                       ("user agent", "by_user_agent")):
        out.append(f"      by {label}: " + ", ".join(f"{x['key']} {x['blocks']}"
                                                   for x in h[key]))
    return out


def worst(found: dict[str, Any]) -> str:
    rows = found["requests"]
    if not rows:
        return f"no ended request queued since {clock(found['since'])} UTC"
    lines = [f"{'lost s':>9} {'waiting s':>10} {'preempted s':>12} {'preemptions':>11}  "
             "request (server engine)"]
    for r in rows:
        lines.append(f"{r['lost_s']:>9.3f} {r['waiting_s']:>10.3f} {r['preempted_s']:>12.3f} "
                     f"{r['preemptions']:>11}  {r['request_id']} ({r['server'] or '-'} "
                     f"{r['engine']})")
    return "\n".join(lines + ["", f"details: {rows[0]['command']}"])
