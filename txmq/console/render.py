"""What the templates show, computed in Python: a message body as text, JSON or hex (cut
at a limit), times, sizes, and the geometry of the SVG line charts.

Nothing here makes HTML: the templates do, with Jinja2's autoescaping, so a body, key,
property or topic name holding markup is shown as text.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from txmq.observability.fmt import ms_time

__all__ = [
    "Body",
    "Chart",
    "Line",
    "chart",
    "human_bytes",
    "show_body",
    "show_ms",
    "show_number",
    "url_pieces",
]

BodyKind = Literal["empty", "json", "text", "hex"]
#: colours of a chart's lines, in order
COLOURS = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563")
_CONTROL = {c for c in range(32) if chr(c) not in "\t\n\r"} | {127}
#: where a URL may wrap: after its slashes and its ``@``, before its ``?`` and ``&``
_URL_BREAKS = re.compile(r"(?<=[/@])(?!/)|(?=[?&])")


@dataclass(frozen=True)
class Body:
    kind: BodyKind
    #: what the page shows (escaped by the template)
    text: str
    size: int
    truncated: bool


def _text(data: bytes) -> str | None:
    """``data`` as text if it is UTF-8 without control characters (a cut at the end of a
    character sequence is forgiven)."""
    for cut in range(4):
        try:
            text = data[: len(data) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
        if any(ord(ch) in _CONTROL for ch in text):
            return None
        return text
    return None


def _hex(data: bytes) -> str:
    lines = []
    for at in range(0, len(data), 16):
        chunk = data[at : at + 16]
        hexes = " ".join(f"{b:02x}" for b in chunk)
        shown = "".join(chr(b) if 32 <= b < 127 else "." for b in chunk)
        lines.append(f"{at:08x}  {hexes:<47}  {shown}")
    return "\n".join(lines)


def show_body(body: bytes, limit: int) -> Body:
    """How a page shows a body: pretty JSON, text, or a hex dump (a quarter of ``limit``
    bytes, its lines being four times as long), cut at the limit."""
    if not body:
        return Body("empty", "", 0, False)
    text = _text(body[:limit])
    if text is not None:
        truncated = len(body) > limit
        if not truncated:
            try:
                value = json.loads(text)
            except ValueError:
                pass
            else:
                if isinstance(value, (dict, list)):
                    pretty = json.dumps(value, indent=2, ensure_ascii=False)
                    return Body("json", pretty, len(body), False)
        return Body("text", text, len(body), truncated)
    cut = max(limit // 4, 16)
    return Body("hex", _hex(body[:cut]), len(body), len(body) > cut)


def show_ms(ms: int | None) -> str:
    return ms_time(ms) if ms else "-"


def show_number(n: float) -> str:
    """A chart's value as a page shows it: a whole number as such (a lag of 1234567 is
    ``1234567``, as in the tables, not ``1.23457e+06``), else with one decimal."""
    return str(int(n)) if float(n).is_integer() else f"{n:.1f}"


def url_pieces(url: str) -> list[str]:
    """``url`` cut where a line may wrap (after ``//`` and each ``/``, after ``@``, before
    ``?`` and ``&``): the template puts a ``<wbr>`` between the pieces, so that a long
    database URL wraps at its separators, never inside a host or a file name."""
    return [p for p in _URL_BREAKS.split(url) if p]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


# -- charts ------------------------------------------------------------------------------

WIDTH, HEIGHT, PAD_LEFT, PAD_BOTTOM, PAD_TOP = 640, 180, 48, 22, 8


@dataclass(frozen=True)
class Line:
    name: str
    colour: str
    #: SVG polyline points ("x,y x,y ...")
    points: str
    last: float


@dataclass(frozen=True)
class Chart:
    width: int
    height: int
    left: int
    bottom: int
    top: int
    lines: list[Line]
    #: the y axis' top value and the time span shown (seconds)
    y_max: float
    span_s: float
    #: labels under the x axis: oldest and newest sample time
    since: str
    until: str


def chart(
    series: Mapping[str, Iterable[tuple[float, float]]],
    now: float | None = None,
    *,
    first: Sequence[str] = (),
) -> Chart:
    """A line chart's geometry: each series (time, value) as a polyline over one time axis
    (the oldest to the newest sample) and one value axis from 0; the lines named in
    ``first`` in that order, then the others by name."""
    data = {name: list(points) for name, points in series.items()}
    data = {name: pts for name, pts in data.items() if pts}
    names = [n for n in first if n in data] + sorted(n for n in data if n not in first)
    times = [t for pts in data.values() for t, _ in pts]
    values = [v for pts in data.values() for _, v in pts]
    t1 = max(times) if times else (now or time.time())
    t0 = min(times) if times else t1
    span = max(t1 - t0, 1.0)
    y_max = _nice(max(values) if values else 0.0)
    plot_w = WIDTH - PAD_LEFT - 8
    plot_h = HEIGHT - PAD_BOTTOM - PAD_TOP
    lines = []
    for i, name in enumerate(names):
        pts = data[name]
        coords = " ".join(
            f"{PAD_LEFT + (t - t0) / span * plot_w:.1f},{PAD_TOP + plot_h - v / y_max * plot_h:.1f}"
            for t, v in pts
        )
        lines.append(Line(name, COLOURS[i % len(COLOURS)], coords, pts[-1][1]))
    return Chart(
        width=WIDTH,
        height=HEIGHT,
        left=PAD_LEFT,
        bottom=HEIGHT - PAD_BOTTOM,
        top=PAD_TOP,
        lines=lines,
        y_max=y_max,
        span_s=span if times else 0.0,
        since=time.strftime("%H:%M:%S", time.localtime(t0)),
        until=time.strftime("%H:%M:%S", time.localtime(t1)),
    )


def _nice(value: float) -> float:
    """A round number at least ``value`` (1 at least) for an axis' top."""
    if value <= 1:
        return 1.0
    step = 10 ** (len(str(int(value))) - 1)
    for m in (1, 2, 5, 10):
        if value <= m * step:
            return float(m * step)
    return float(10 * step)  # pragma: no cover
