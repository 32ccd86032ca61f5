"""The benches' figures, SVG written by hand (no plotting library to install): a document, panels with a y axis and
its grid, a legend; and the two charts drawn on them, lines over a log x axis (bench/cluster_sim.py) and bars with
whiskers (bench/churn.py)."""

from __future__ import annotations

import math
from html import escape

TOP, BOTTOM, LEFT = 50, 45, 70  # a panel's margins: title and subtitle above, x labels below, y labels left


class Panel:
    """A plot area of a document: x from `left` to `right`, values 0..ymax from the document's bottom margin up."""

    def __init__(self, left: float, right: float, height: float, ymax: float, label: str = "", top: float = TOP):
        self.left, self.right, self.height, self.ymax, self.label, self.top = left, right, height, ymax, label, top

    def y(self, v: float) -> float:
        return self.height - BOTTOM - (self.height - self.top - BOTTOM) * v / self.ymax

    def axes(self) -> list[str]:
        """Its axes, 5 grid lines labelled with their values, and its label above it."""
        base = self.height - BOTTOM
        out = [
            f'<line x1="{self.left}" y1="{base}" x2="{self.right}" y2="{base}" stroke="black"/>',
            f'<line x1="{self.left}" y1="{self.top}" x2="{self.left}" y2="{base}" stroke="black"/>',
        ]
        if self.label:
            out.append(f'<text x="{self.left}" y="{self.top - 12}" fill="#333">{escape(self.label)}</text>')
        for i in range(5):
            v = self.ymax * i / 4
            text = f"{v:.2f}" if self.ymax <= 2 else f"{v:,.0f}"
            out.append(
                f'<line x1="{self.left}" y1="{self.y(v):.1f}" x2="{self.right}" y2="{self.y(v):.1f}" stroke="#ddd"/>'
            )
            out.append(f'<text x="{self.left - 6}" y="{self.y(v) + 4:.1f}" text-anchor="end">{text}</text>')
        return out

    def whisker(self, x: float, lo: float, hi: float, colour: str, cap: float = 0.0) -> list[str]:
        """A vertical line from lo to hi at x, with caps `cap` wide."""
        out = [f'<line x1="{x:.1f}" y1="{self.y(lo):.1f}" x2="{x:.1f}" y2="{self.y(hi):.1f}" stroke="{colour}"/>']
        if cap:
            for v in (lo, hi):
                out.append(
                    f'<line x1="{x - cap / 2:.1f}" y1="{self.y(v):.1f}" x2="{x + cap / 2:.1f}" y2="{self.y(v):.1f}"'
                    f' stroke="{colour}"/>'
                )
        return out


def document(width: int, height: int, title: str, subtitle: str, body: list[str]) -> str:
    """The SVG: a white page, its title and subtitle, then `body`."""
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{LEFT}" y="20" font-size="14">{escape(title)}</text>',
        f'<text x="{LEFT}" y="37" fill="#555">{escape(subtitle)}</text>',
        *body,
        "</svg>",
    ]
    return "\n".join(out) + "\n"


def legend_entry(x: float, k: int, colour: str, label: str) -> list[str]:
    """The k-th line of a legend at x, below the top margin."""
    y = TOP + 10 + 18 * k
    return [
        f'<line x1="{x}" y1="{y}" x2="{x + 20}" y2="{y}" stroke="{colour}" stroke-width="2"/>',
        f'<text x="{x + 25}" y="{y + 4}">{escape(label)}</text>',
    ]


def log_lines(
    title: str, subtitle: str, xs: list[float], xlabel: str, ymax: float, lines: list, colours: dict[str, str]
) -> str:
    """Lines over a log x axis: `lines` of (name, dash, [(x, middle, low, high), ...]), a dot at the middle and a bar
    from low to high; a solid line's name goes in the legend."""
    width, height, right = 560, 340, 110
    panel = Panel(LEFT, width - right, height, ymax)
    lo, hi = math.log10(min(xs)), math.log10(max(xs))

    def x(n):
        return LEFT + (width - LEFT - right) * ((math.log10(n) - lo) / (hi - lo) if hi > lo else 0.5)

    body = panel.axes()
    body += [f'<text x="{x(n):.1f}" y="{height - BOTTOM + 18}" text-anchor="middle">{n:,}</text>' for n in xs]
    body.append(f'<text x="{(LEFT + width - right) / 2}" y="{height - 8}" text-anchor="middle">{escape(xlabel)}</text>')
    solid = 0
    for name, dash, pts in lines:
        c = colours[name]
        style = f' stroke-dasharray="{dash}"' if dash else ""
        path = " ".join(f"{x(n):.1f},{panel.y(m):.1f}" for n, m, _, _ in pts)
        body.append(f'<polyline points="{path}" fill="none" stroke="{c}" stroke-width="2"{style}/>')
        for n, m, a, b in pts:
            body += panel.whisker(x(n), a, b, c)
            body.append(f'<circle cx="{x(n):.1f}" cy="{panel.y(m):.1f}" r="3" fill="{c}"/>')
        if not dash:
            body += legend_entry(width - right + 10, solid, c, name)
            solid += 1
    return document(width, height, title, subtitle, body)


def bar_panels(title: str, subtitle: str, panels: list[tuple[str, float, list[dict]]], colours: dict[str, str]) -> str:
    """Panels side by side, each (label, ymax, bars). A bar is a dict: `name` (its colour's key, written under it),
    `value` (the bar, written above it), `low` and `high` (its whisker), `under` (a second line under the name),
    `missing` (what stands in for the bar when value is None)."""
    panel_w, gap, height = 300, 50, 385
    width = LEFT + len(panels) * (panel_w + gap)
    body = []
    for i, (label, ymax, bars) in enumerate(panels):
        left = LEFT + i * (panel_w + gap)
        panel = Panel(left, left + panel_w, height, ymax, label, top=TOP + 30)  # room for its label
        body += panel.axes()
        slot = panel_w / max(1, len(bars))
        for k, bar in enumerate(bars):
            mid, base = left + slot * (k + 0.5), height - BOTTOM
            for dy, text, size in ((16, bar["name"], 11), (30, bar.get("under", ""), 10)):
                body.append(
                    f'<text x="{mid:.1f}" y="{base + dy}" text-anchor="middle" font-size="{size}">{escape(text)}</text>'
                )
            value = bar["value"]
            if value is None:
                at = f'x="{mid:.1f}" y="{panel.y(0) - 6:.1f}" text-anchor="middle" font-size="10"'
                body.append(f"<text {at}>{escape(bar.get('missing', ''))}</text>")
                continue
            top = panel.y(value)
            body.append(
                f'<rect x="{mid - slot * 0.3:.1f}" y="{top:.1f}" width="{slot * 0.6:.1f}" '
                f'height="{panel.y(0) - top:.1f}" fill="{colours[bar["name"]]}" fill-opacity="0.75"/>'
            )
            body += panel.whisker(mid, bar["low"], bar["high"], "black", cap=slot * 0.2)
            text = f"{value:.2f}" if ymax <= 2 else f"{value:,.1f}"
            body.append(f'<text x="{mid:.1f}" y="{panel.y(bar["high"]) - 4:.1f}" text-anchor="middle">{text}</text>')
    return document(width, height, title, subtitle, body)
