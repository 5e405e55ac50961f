"""The pure half of ``long_context.py`` (issue 45): where the next probe goes, and the tables.

``fit_line`` / ``predict_longest``: peak RSS per rank as a straight line in the sequence length,
through the two longest lengths that fit, and where it crosses the cap. ``next_length``: the next
length to probe, from that line, at most twice the longest pass before any failure (below ~3k
tokens the 118M GPT's peak is the optimizer step's, so a line through short lengths is flat),
then inside the bracket (longest pass, shortest failure), in its middle half, so that each probe
shrinks it by a quarter at least. ``render`` and ``add_summary_row``: the markdown for bench/RESULTS.md.
"""
from __future__ import annotations

from typing import Callable

GiB = 1 << 30
#: mode -> sequence_parallel, on 2 ranks
MODES = {"dp2": 1, "sp2": 2}


def fit_line(points: dict[int, int]) -> tuple[float, float]:
    """``(a, b)`` of ``peak = a + b * length`` through the two longest of ``points`` (length -> peak bytes)."""
    (l1, p1), (l2, p2) = sorted(points.items())[-2:]
    b = (p2 - p1) / (l2 - l1)
    return p2 - b * l2, b


def predict_longest(a: float, b: float, cap: int, grain: int, max_len: int) -> int:
    """The longest multiple of ``grain`` (at most ``max_len``) whose predicted peak is within ``cap``."""
    if b <= 0:
        return max_len
    return min(max_len, int((cap - a) / b) // grain * grain)


def next_length(passed: dict[int, int], failed: set[int], cap: int, grain: int, max_len: int) -> int | None:
    """The next length to probe (a multiple of ``grain``), or None when the longest pass and the
    shortest failure are ``grain`` apart (or the pass is ``max_len``). ``passed``: length -> peak
    bytes (two at least); ``failed``: lengths that did not fit."""
    lo = max(passed)
    hi = min(failed) if failed else None
    top = (hi - 1) // grain * grain if hi is not None else max_len // grain * grain
    if top <= lo:
        return None
    guess = predict_longest(*fit_line(passed), cap, grain, max_len)
    if hi is None:  # short lengths may peak at the optimizer step, not in the activations: no more than double
        guess = min(guess, 2 * lo)
    low, high = lo + grain, top
    if hi is not None:  # a bracket: shrink it by a quarter at least
        span = hi - lo
        low = max(low, -(-(lo + span // 4) // grain) * grain)
        high = max(low, min(high, (hi - span // 4) // grain * grain))
    return min(max(guess, low), high)


def search(mode: str, probe: Callable[[int], dict], calib: list[int], cap: int, grain: int, max_len: int,
           max_probes: int, budget_s: float = float("inf")) -> dict:
    """One mode's search: ``probe(length)`` -> {length, ok, peak, wall_s, ...} for each ``calib``
    length, then for up to ``max_probes`` lengths from ``next_length``, none started once the probes
    took ``budget_s`` (``stopped``: the bracket may then be wider than ``grain``). Its table row:
    every probe, the longest that fit (``best``), the shortest that did not, the line's prediction."""
    probes = [probe(n) for n in calib]
    passed = {p["length"]: p["peak"] for p in probes if p["ok"]}
    failed = {p["length"] for p in probes if not p["ok"]}
    row = {"mode": mode, "probes": probes, "predicted": None, "slope": None, "stopped": False}
    if len(passed) == len(calib):  # else the calibration did not fit: no line
        a, b = fit_line(passed)
        row.update(predicted=predict_longest(a, b, cap, grain, max_len), slope=b)
        for _ in range(max_probes):
            n = next_length(passed, failed, cap, grain, max_len)
            if n is None:
                break
            if sum(p["wall_s"] for p in probes) >= budget_s:
                row["stopped"] = True
                break
            probes.append(probe(n))
            if probes[-1]["ok"]:
                passed[n] = probes[-1]["peak"]
            else:
                failed.add(n)
    best = max((p for p in probes if p["ok"]), key=lambda p: p["length"], default=None)
    row.update(best=best, first_fail=min(failed) if failed else None)
    return row


def render(rows: list[dict], cap: int) -> str:
    lines = ["| mode | longest seq (tokens) | first failing | peak RSS/rank at it | step s at it | "
             "predicted (per-token model) | model slope KiB/token | probes |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b, name = r["best"], "dp=2 (no sp)" if MODES[r["mode"]] == 1 else "dp=1 x sp=2 (Ulysses)"
        at = f"{b['length']} | {r['first_fail'] or '-'} | {b['peak'] / GiB:.2f} GiB | {b['step_s']:.1f}" if b else \
            f"none | {r['first_fail'] or '-'} | - | -"
        slope = f"{r['slope'] / 1024:.0f}" if r["slope"] else "-"
        stop = " (time budget spent)" if r["stopped"] else ""
        lines.append(f"| {name} | {at} | {r['predicted'] or '-'} | {slope} | {len(r['probes'])}{stop} |")
    lines += ["", "Every probe (calibration first, then the search), cap "
              f"{cap / GiB:.2f} GiB per rank:", "", "| mode | length | fits | peak RSS/rank | step s | wall s | why not |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {p['mode']} | {p['length']} | {'yes' if p['ok'] else 'no'} | {p['peak'] / GiB:.2f} GiB | "
              f"{p['step_s']:.1f} | {p['wall_s']:.0f} | {p['why'] or ''} |" for r in rows for p in r["probes"]]
    return "\n".join(lines) + "\n"


def summary_row(rows: list[dict], what: str, when: str, section: str) -> str:
    """The row for RESULTS.md's summary table: each mode's longest length and its peak RSS."""
    fig = "; ".join(f"{r['mode']}: {r['best']['length'] if r['best'] else 'none'} tokens "
                    f"(first failing {r['first_fail'] or '-'})" for r in rows)
    rss = "; ".join(f"{r['mode']} {r['best']['peak'] / GiB:.2f} GiB" for r in rows if r["best"])
    return f"| {what} | {fig} | - | {rss or '-'} | no target stated | {when} | \"{section}\" |"


def add_summary_row(text: str, row: str) -> str:
    """``text`` (RESULTS.md) with ``row`` in its summary table: in place of the row of the same
    first cell, else after the table's last row."""
    lines = text.split("\n")
    key = row.split("|")[1].strip()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| what |"))
    end = start
    while end + 1 < len(lines) and lines[end + 1].startswith("|"):
        end += 1
    same = [i for i in range(start, end + 1) if lines[i].split("|")[1].strip() == key]
    if same:
        lines[same[0]] = row
    else:
        lines.insert(end + 1, row)
    return "\n".join(lines)
