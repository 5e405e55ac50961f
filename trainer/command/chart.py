"""A scatter chart as a PNG: ``zerotrain-tune``'s time-vs-memory plot.

matplotlib draws it when it is importable; it is not a dependency, so otherwise the chart is
rasterised here and written with ``zlib`` and ``struct`` (a PNG is a signature, an IHDR chunk, the
zlib-compressed rows, each behind a filter byte, and IEND; every chunk carries a CRC-32): axes with
ticks and their values, one dot per point, the winner as a red ring. Either way the image is
``width`` x ``height`` pixels.
"""
from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass
from typing import Optional, Sequence

WHITE, BLACK, GREY, BLUE, RED = (255, 255, 255), (0, 0, 0), (200, 200, 200), (40, 90, 200), (220, 30, 30)
#: 3x5 digits for the tick values (rows top to bottom, 3 bits each)
_GLYPHS = {
    "0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7), "2": (7, 1, 7, 4, 7), "3": (7, 1, 7, 1, 7),
    "4": (5, 5, 7, 1, 1), "5": (7, 4, 7, 1, 7), "6": (7, 4, 7, 5, 7), "7": (7, 1, 1, 1, 1),
    "8": (7, 5, 7, 5, 7), "9": (7, 5, 7, 1, 7), ".": (0, 0, 0, 0, 2), "-": (0, 0, 7, 0, 0),
}


@dataclass(frozen=True)
class Point:
    x: float
    y: float
    label: str = ""
    winner: bool = False


def scatter_png(path: str, points: Sequence[Point], x_label: str, y_label: str, title: str = "",
                width: int = 640, height: int = 480, x_line: Optional[float] = None) -> str:
    """Write the chart; returns which renderer drew it ("matplotlib" or "builtin"). ``x_line``:
    a dashed vertical line (the memory cap)."""
    if width < 64 or height < 64:
        raise ValueError(f"width={width}, height={height}: the chart needs at least 64 x 64 pixels")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        write_png(path, _raster(points, width, height, x_line))
        return "builtin"
    _matplotlib(plt, path, points, x_label, y_label, title, width, height, x_line)
    return "matplotlib"


def _matplotlib(plt, path, points, x_label, y_label, title, width, height, x_line) -> None:
    fig, ax = plt.subplots(figsize=(width / 100, height / 100), dpi=100)
    ax.scatter([p.x for p in points], [p.y for p in points], color="tab:blue")
    for p in points:
        ax.annotate(p.label, (p.x, p.y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        if p.winner:
            ax.scatter([p.x], [p.y], s=200, facecolors="none", edgecolors="red", linewidths=2)
    if x_line is not None:
        ax.axvline(x_line, color="grey", linestyle="--")
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.set_title(title, fontsize=9)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round values spanning [lo, hi]."""
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(s * mag for s in (1, 2, 5, 10) if s * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def _span(values: Sequence[float]) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    pad = (hi - lo) * 0.1 or abs(hi) * 0.1 or 1.0
    return lo - pad, hi + pad


class _Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.w, self.h = width, height
        self.rows = [bytearray(WHITE * width) for _ in range(height)]

    def dot(self, x: int, y: int, color) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            self.rows[y][3 * x:3 * x + 3] = bytes(color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color, dash: int = 0) -> None:
        n = max(abs(x1 - x0), abs(y1 - y0), 1)
        for i in range(n + 1):
            if not dash or (i // dash) % 2 == 0:
                self.dot(round(x0 + (x1 - x0) * i / n), round(y0 + (y1 - y0) * i / n), color)

    def disc(self, cx: int, cy: int, r: int, color, ring: bool = False) -> None:
        for y in range(cy - r, cy + r + 1):
            for x in range(cx - r, cx + r + 1):
                d2 = (x - cx) ** 2 + (y - cy) ** 2
                if d2 <= r * r and (not ring or d2 >= (r - 2) ** 2):
                    self.dot(x, y, color)

    def text(self, x: int, y: int, s: str, color=BLACK, scale: int = 2) -> None:
        """``s`` (digits, '.', '-') with its top-left corner at (x, y)."""
        for k, ch in enumerate(s):
            for row, bits in enumerate(_GLYPHS.get(ch, (0,) * 5)):
                for col in range(3):
                    if bits >> (2 - col) & 1:
                        for dy in range(scale):
                            for dx in range(scale):
                                self.dot(x + (4 * k + col) * scale + dx, y + row * scale + dy, color)


def _fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def _raster(points: Sequence[Point], width: int, height: int, x_line: Optional[float]) -> list[bytearray]:
    """The chart's pixel rows: a plot area with a margin for the tick values."""
    c = _Canvas(width, height)
    left, right, top, bottom = 60, width - 15, 15, height - 35
    xs = [p.x for p in points] + ([x_line] if x_line is not None else [])
    ys = [p.y for p in points]
    (x0, x1), (y0, y1) = (_span(xs), _span(ys)) if points else ((0.0, 1.0), (0.0, 1.0))

    def px(x: float) -> int:
        return round(left + (x - x0) / (x1 - x0) * (right - left))

    def py(y: float) -> int:
        return round(bottom - (y - y0) / (y1 - y0) * (bottom - top))

    for t in _ticks(x0, x1):
        c.line(px(t), top, px(t), bottom, GREY)
        c.text(px(t) - 2 * 4 * len(_fmt(t)) // 2, bottom + 8, _fmt(t))
    for t in _ticks(y0, y1):
        c.line(left, py(t), right, py(t), GREY)
        c.text(left - 8 - 2 * 4 * len(_fmt(t)), py(t) - 5, _fmt(t))
    c.line(left, bottom, right, bottom, BLACK)
    c.line(left, top, left, bottom, BLACK)
    if x_line is not None:
        c.line(px(x_line), top, px(x_line), bottom, BLACK, dash=4)
    for p in points:
        c.disc(px(p.x), py(p.y), 4, BLUE)
    for p in points:
        if p.winner:
            c.disc(px(p.x), py(p.y), 10, RED, ring=True)
    return c.rows


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def write_png(path: str, rows: Sequence[bytes]) -> None:
    """8-bit RGB rows (each ``3 x width`` bytes) as a PNG file."""
    height, width = len(rows), len(rows[0]) // 3
    raw = b"".join(b"\x00" + bytes(r) for r in rows)  # filter type 0 (none) on every row
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit, truecolour, no interlace
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(raw, 9))
                + _chunk(b"IEND", b""))
