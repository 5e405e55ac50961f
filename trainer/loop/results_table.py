"""The table ``validate``/``test`` print with ``verbose=True``, laid out as Lightning's: one row per
metric (nested dicts as ``outer:inner``, the ``/dataloader_idx_<i>`` suffix dropped, rows sorted by
name), one column per dataloader, columns of a common width (the longest name or header, at least
25, at most half the terminal) and as many dataloaders per table as fit the terminal beside the
names. Drawn with Rich when it is installed, else as centred text between rules (``-`` where the
output's encoding has no box-drawing character); a name longer than half the terminal wraps."""
from __future__ import annotations

import shutil
import sys
from typing import Any, Iterator

_SUFFIX = "/dataloader_idx_"


def _paths(metrics: dict, prefix: tuple = ()) -> Iterator[tuple]:
    for key, value in metrics.items():
        if isinstance(value, dict):
            yield from _paths(value, (*prefix, key))
        else:
            yield (*prefix, key)


def _cell(metrics: dict, path: tuple) -> str:
    value: Any = metrics
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return " "
        value = value[key]
    if hasattr(value, "numel") and hasattr(value, "tolist"):  # a tensor: its number, or its nested list
        value = value.item() if value.numel() == 1 else value.tolist()
    return f"{value}"


def print_results(results: list[dict], stage: str, rich: bool = False) -> None:
    """Print ``results`` (one dict of metrics per dataloader) of ``stage`` as a table; nothing when
    no loader logged anything."""
    results = [{str(k).split(_SUFFIX)[0]: v for k, v in r.items()} for r in results]
    paths = sorted({p for r in results for p in _paths(r)}, key=lambda p: ":".join(map(str, p)))
    if not paths:
        return
    names = [":".join(map(str, p)) for p in paths]
    headers = [f"DataLoader {i}" for i in range(len(results))]
    term = shutil.get_terminal_size(fallback=(120, 30)).columns or 120
    width = int(min(max(max(map(len, names)), max(map(len, headers)), 25), term / 2))
    per_table = int((term - width) / width)
    cells = [[_cell(r, p) for r in results] for p in paths]
    title = f"{stage} Metric".capitalize()
    for start in range(0, len(headers), per_table):
        columns = [title, *headers[start:start + per_table]]
        rows = [[name, *row[start:start + per_table]] for name, row in zip(names, cells)]
        if rich:
            _rich_table(columns, rows, width)
        else:
            _text_table(columns, rows, width, term)


def _rich_table(columns: list[str], rows: list[list[str]], width: int) -> None:
    from rich import get_console
    from rich.table import Column, Table

    cols = [Column(c, justify="center", style="cyan" if i == 0 else "magenta", width=width)
            for i, c in enumerate(columns)]
    table = Table(*cols)
    for row in rows:
        table.add_row(*row)
    get_console().print(table)


def _text_table(columns: list[str], rows: list[list[str]], width: int, term: int) -> None:
    line = (f"{{:^{width}}}" * len(columns)).format
    try:
        rule = "─" if sys.stdout.encoding is None or "─".encode(sys.stdout.encoding) else "-"
    except UnicodeEncodeError:
        rule = "-"
    half = int(term / 2)
    out = [rule * term, line(*columns).rstrip(), rule * term]
    for name, *values in rows:
        wrapped = len(name) > half
        while len(name) > half:  # a long name wraps: its values on each full piece, the rest blank
            out.append(line(name[:half], *values).rstrip())
            name = name[half:]
        out.append(line(name, *([" "] * len(values) if wrapped else values)).rstrip())
    out.append(rule * term)
    print("\n".join(out))
