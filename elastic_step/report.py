"""The training report: one self-contained HTML page drawn from summary.json.

Charts are inline SVG drawn here (no script, no fonts, no network fetches), so the page renders
the same in the KFP UI's sandboxed iframe, in the Argo UI, from a bucket, or offline. Every time
chart shares one time axis (seconds since the step started), so a worker loss marked in one chart
lines up with the loss, throughput and worker count around it in the others.

The page must render for whatever summary a job leaves behind, a failed one included: every
field is optional and anything that is not a finite number is skipped.
"""

from __future__ import annotations

import html
import math

from elastic_step.util.atomic import atomic_write_text

W, PAD_L, PAD_R, PAD_B, PLOT_H = 720, 58, 18, 34, 150
LABEL_ROW, LABEL_ROWS, CHAR_W = 12, 3, 5.6
LOST, JOINED, FAILED = "#d62728", "#2ca02c", "#8b0000"
STRAGGLER = "#ff7f0e"  # a straggler: its work handed over to an idle worker (ps), or left out of the ring
LOSS, EVAL, RATE, ALIVE = "#1f77b4", "#9467bd", "#ff7f0e", "#3b6ea5"
EVAL_COLOURS = [EVAL, "#8c564b", "#e377c2", "#17becf"]
CHART_IDS = ("chart-loss", "chart-eval", "chart-throughput", "chart-workers", "chart-goodput", "chart-ledger")


# Goodput: training that counted, then each cause of the time that did not (master/observe/goodput.py CAUSES)
GOODPUT_PARTS = (
    ("training", "training that counted", JOINED),
    ("startup", "start-up", "#c8c8c8"),
    ("waiting", "waiting for workers", "#bcbd22"),
    ("rewind", "trained again after a loss", LOST),
    ("checkpoint", "checkpoint holds", "#17becf"),
    ("restore", "restores", "#8b0000"),
    ("evaluation", "evaluation", EVAL),
    ("finishing", "saving the model", "#7f7f7f"),
)


# ---------------------------------------------------------------- tolerant access
def esc(v) -> str:
    return html.escape(str(v), quote=True)


def num(v) -> float | None:
    """A finite number, or None (bools, strings, NaN, inf and missing values are not plotted)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def _dict(d, key: str) -> dict:
    v = d.get(key) if isinstance(d, dict) else None
    return v if isinstance(v, dict) else {}


def _rows(d, key: str) -> list[dict]:
    v = d.get(key) if isinstance(d, dict) else None
    return [x for x in v if isinstance(x, dict)] if isinstance(v, list) else []


def _int(v) -> int:
    n = num(v)
    return int(n) if n is not None else 0


# ---------------------------------------------------------------- axes
def nice_ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    """Round tick values covering [lo, hi] with about n intervals."""
    span = (hi - lo) / n
    if not (hi > lo and math.isfinite(span) and span > 0):  # empty, overflowing or underflowing range
        return [lo]
    step = 10 ** math.floor(math.log10(span))
    for m in (1, 2, 2.5, 5, 10):
        if (hi - lo) / (step * m) <= n:
            step *= m
            break
    k0 = math.ceil(lo / step - 1e-9)
    count = int(hi / step + 1e-9) - k0 + 1
    return [float(f"{(k0 + i) * step:.12g}") for i in range(max(count, 1))]


def _nice_max(v: float) -> float:
    if v <= 0:
        return 1.0
    ticks = nice_ticks(0.0, v)
    step = ticks[1] - ticks[0] if len(ticks) > 1 else v
    return math.ceil(v / step - 1e-9) * step


def fmt(v: float) -> str:
    a = abs(v)
    if a >= 10_000:
        return f"{v / 1000:.0f}k"
    if a >= 1000:
        return f"{v / 1000:.3g}k"
    if a >= 100 or v == int(v):
        return f"{v:.0f}"
    return f"{v:.3g}"


def _time_unit(t_end: float) -> tuple[str, float]:
    if t_end > 3 * 3600:
        return "hours", 3600.0
    if t_end > 600:
        return "minutes", 60.0
    return "seconds", 1.0


class TimeAxis:
    """The x axis every time chart shares, and the rows of marker labels above each plot."""

    def __init__(self, t_end: float, markers: list[tuple[float, str, str]]):
        self.t_end = t_end if t_end > 0 else 1.0
        self.unit, self.div = _time_unit(self.t_end)
        self.labels = self._layout(markers)
        rows = 1 + max((row for *_, row in self.labels), default=-1)
        self.top = 10 + rows * LABEL_ROW

    def x(self, t: float) -> float:
        return PAD_L + min(max(t, 0.0), self.t_end) / self.t_end * (W - PAD_L - PAD_R)

    def _layout(self, markers):
        """Each label beside its line (flipped left near the right edge), on the first row where it
        overlaps no other label; past LABEL_ROWS rows, on the row that frees up first."""
        ends: list[float] = []
        out = []
        for t, colour, label in sorted(markers, key=lambda m: m[0]):
            px, width = self.x(t), len(label) * CHAR_W + 4
            if px + 3 + width > W - PAD_R:
                left, right, anchor, tx = px - 3 - width, px - 3, "end", px - 3
            else:
                left, right, anchor, tx = px + 3, px + 3 + width, "start", px + 3
            row = next((i for i, end in enumerate(ends) if end < left), None)
            if row is None and len(ends) < LABEL_ROWS:
                ends.append(right)
                row = len(ends) - 1
            elif row is None:
                row = min(range(len(ends)), key=ends.__getitem__)
            ends[row] = max(ends[row], right)
            out.append((t, colour, label, tx, anchor, row))
        return out


# ---------------------------------------------------------------- time charts
def time_chart(
    chart_id: str,
    title: str,
    axis: TimeAxis,
    series: list[tuple[str, str, list[tuple[float, float]]]],
    y_label: str,
    *,
    step: bool = False,
    hlines: list[tuple[float, str, str]] = (),
    dots: list[tuple[float, float, str, str]] = (),
    startup: float | None = None,
    y_max: float | None = None,
    legend: bool = False,
    points: bool = False,
) -> str:
    """An SVG chart over the shared time axis: series (name, colour, [(t, y)]), horizontal reference
    lines (y, colour, label), labelled dots (t, y, colour, label), the start-up band and the markers;
    `points` draws each sample as a dot too (sparse series such as one evaluation per epoch)."""
    top = axis.top
    height = top + PLOT_H + PAD_B
    values = [v for _, _, pts in series for _, v in pts] + [h[0] for h in hlines] + [d[1] for d in dots]
    caption = f"<figcaption>{esc(title)}{_legend(series) if legend else ''}</figcaption>"
    out = [
        f'<figure>{caption}<svg id="{chart_id}" class="chart" viewBox="0 0 {W} {height}" role="img" '
        f'aria-label="{esc(title)}" xmlns="http://www.w3.org/2000/svg">'
    ]
    y_lo = min([0.0] + values)
    y_hi = y_max if y_max is not None and values and max(values) <= y_max else _nice_max(max(values, default=0.0))
    if y_lo < 0:
        y_lo = -_nice_max(-y_lo)

    def y(v: float) -> float:
        return top + PLOT_H - (v - y_lo) / ((y_hi - y_lo) or 1.0) * PLOT_H

    out += _time_axes(axis, y, y_lo, y_hi, y_label, startup)
    out += _reference_lines(hlines, y)
    out += _event_markers(axis)
    out += _series_lines(series, axis.x, y, step=step, points=points)
    out += _labelled_dots(dots, axis.x, y)
    if not values:
        out.append(
            f'<text x="{(PAD_L + W - PAD_R) / 2}" y="{top + PLOT_H / 2}" text-anchor="middle" '
            f'class="nodata">no data</text>'
        )
    out.append("</svg></figure>")
    return "".join(out)


def _time_axes(axis: TimeAxis, y, y_lo: float, y_hi: float, y_label: str, startup: float | None) -> list[str]:
    """A time chart's frame: the start-up band, the value grid and its ticks, the time axis and both labels."""
    top, x = axis.top, axis.x
    bottom = top + PLOT_H
    height = bottom + PAD_B
    out = []
    if startup and startup > 0:
        out.append(
            f'<rect x="{PAD_L}" y="{top}" width="{x(startup) - PAD_L:.1f}" height="{PLOT_H}" '
            f'class="startup"><title>start-up: parameter servers and workers starting</title></rect>'
            f'<text x="{(PAD_L + x(startup)) / 2:.1f}" y="{bottom - 6}" text-anchor="middle" '
            f'class="tick">start-up</text>'
        )
    for tv in nice_ticks(y_lo, y_hi):
        out.append(
            f'<line x1="{PAD_L}" x2="{W - PAD_R}" y1="{y(tv):.1f}" y2="{y(tv):.1f}" class="grid"/>'
            f'<text x="{PAD_L - 6}" y="{y(tv) + 4:.1f}" text-anchor="end" class="tick">{fmt(tv)}</text>'
        )
    out.append(f'<line x1="{PAD_L}" x2="{W - PAD_R}" y1="{bottom}" y2="{bottom}" class="axis"/>')
    for tv in nice_ticks(0.0, axis.t_end / axis.div, 8):
        px = x(tv * axis.div)
        out.append(
            f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{bottom}" y2="{bottom + 4}" class="axis"/>'
            f'<text x="{px:.1f}" y="{bottom + 16}" text-anchor="middle" class="tick">{fmt(tv)}</text>'
        )
    out.append(
        f'<text x="{W - PAD_R}" y="{height - 3}" text-anchor="end" class="tick">'
        f"{axis.unit} since the step started</text>"
        f'<text x="6" y="{top - 6}" class="tick">{esc(y_label)}</text>'
    )
    return out


def _reference_lines(hlines, y) -> list[str]:
    """Dashed horizontal lines (y, colour, label): a figure the series is read against."""
    return [
        f'<line x1="{PAD_L}" x2="{W - PAD_R}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="{colour}" '
        f'stroke-dasharray="6 4" class="ref"/><text x="{PAD_L + 4}" y="{y(v) - 4:.1f}" '
        f'class="reflabel" fill="{colour}">{esc(label)}</text>'
        for v, colour, label in hlines
    ]


def _event_markers(axis: TimeAxis) -> list[str]:
    """The markers (see `markers`): a dashed vertical line each, labelled in the row the axis gave it."""
    x, bottom = axis.x, axis.top + PLOT_H
    out = []
    for t, colour, label, tx, anchor, row in axis.labels:
        ly = 10 + row * LABEL_ROW
        out.append(
            f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{ly - 8}" y2="{bottom}" stroke="{colour}" '
            f'stroke-dasharray="4 3" class="marker"><title>{esc(label)}</title></line>'
            f'<text x="{tx:.1f}" y="{ly}" text-anchor="{anchor}" class="mlabel" fill="{colour}">'
            f"{esc(label)}</text>"
        )
    return out


def _series_lines(series, x, y, *, step: bool, points: bool) -> list[str]:
    """Each series (name, colour, [(t, y)]) as a line (`step`: held until the next sample), and as dots when
    `points` (or when it has a single sample, which makes no line)."""
    out = []
    for name, colour, pts in series:
        coords = []
        for i, (t, v) in enumerate(pts):
            if step and i:
                coords.append(f"{x(t):.1f},{y(pts[i - 1][1]):.1f}")
            coords.append(f"{x(t):.1f},{y(v):.1f}")
        if len(pts) > 1:
            out.append(
                f'<polyline points="{" ".join(coords)}" fill="none" stroke="{colour}" stroke-width="2" '
                f'stroke-linejoin="round" class="series" data-name="{esc(name)}"/>'
            )
        if (points and len(pts) <= 200) or len(pts) == 1:  # a single point has no line at all
            out.extend(
                f'<circle cx="{x(t):.1f}" cy="{y(v):.1f}" r="2.5" fill="{colour}" class="point">'
                f"<title>{esc(name)} {v:.4g} at {t:.1f} s</title></circle>"
                for t, v in pts
            )
    return out


def _labelled_dots(dots, x, y) -> list[str]:
    """Labelled dots (t, y, colour, label), such as the final evaluation's figures at the end of the axis."""
    out = []
    for t, v, colour, label in dots:
        anchor, dx = ("end", -8) if x(t) > W - PAD_R - 150 else ("start", 8)
        out.append(
            f'<circle cx="{x(t):.1f}" cy="{y(v):.1f}" r="5" fill="#fff" stroke="{colour}" stroke-width="2.5" '
            f'class="final"><title>{esc(label)}</title></circle>'
            f'<text x="{x(t) + dx:.1f}" y="{y(v) + 19:.1f}" text-anchor="{anchor}" class="dotlabel" '
            f'fill="{colour}">{esc(label)}</text>'
        )
    return out


def _legend(series) -> str:
    return "".join(f' <span class="key"><i style="background:{c}"></i>{esc(n)}</span>' for n, c, _ in series)


# ---------------------------------------------------------------- what happened when
def markers(summary: dict) -> list[tuple[float, str, str]]:
    """A red line where an instance was lost, declared hung or ended early (labelled with the master's decision),
    a green one where a relaunched instance registered again, an orange one where a straggler's work was handed
    over to an idle worker (ps) or it was left out of the ring (allreduce), a dark red one where the job failed."""
    events = sorted((e for e in _rows(summary, "events") if num(e.get("t")) is not None), key=lambda e: num(e["t"]))
    out: list[tuple[float, str, str]] = []
    relaunched: set[str] = set()
    ended: dict[str, tuple[float, str]] = {}  # instance -> (t, what) of its last loss or exit
    chaos: dict[str, float] = {}
    hung: dict[str, tuple[float, str]] = {}  # instance -> (t, what) of the master declaring it hung
    for e in events:
        kind, inst, detail, t = e.get("kind"), str(e.get("instance") or ""), str(e.get("detail") or ""), num(e["t"])
        if kind == "chaos":
            chaos[inst] = t
        elif kind == "hung":
            chaos.pop(inst, None)  # its end is the master's stop, not the chaos
            bound = num(e.get("bound_s"))
            hung[inst] = (t, "declared hung" + (f" (bound {bound:g} s)" if bound is not None else ""))
        elif kind == "fence_refused" and inst in hung:  # it came back, fenced: what it sent was refused
            hung[inst] = (hung[inst][0], hung[inst][1] + ", came back fenced")
        elif kind in ("lost", "exited"):
            if inst in hung:
                ended[inst] = hung.pop(inst)
                continue
            killed = inst in chaos and t - chaos.pop(inst) < 5.0
            what = "lost" if kind == "lost" else f"exited ({detail})" if detail else "exited"
            ended[inst] = (t, what + (" (chaos kill)" if killed else ""))
        elif kind == "decision":
            action = detail.split(":", 1)[0]
            at, what = ended.pop(inst, (t, "ended"))
            if action == "relaunch":
                out.append((at, LOST, f"{inst} {what}, relaunched"))
                relaunched.add(inst)
            elif action == "fail":
                out.append((at, FAILED, f"{inst} {what}: job failed"))
        elif kind == "straggler" and e.get("step_s") is not None:  # allreduce: left out of the ring
            step_s, others = num(e.get("step_s")), num(e.get("others_step_s"))
            what = f" ({step_s:g} against {others:g} s a step)" if others is not None else ""
            out.append((t, STRAGGLER, f"{inst} straggler{what}: {e.get('action') or 'left out of the ring'}"))
        elif kind == "straggler":
            pace, idle = num(e.get("holder_records_per_s")), num(e.get("idle_records_per_s"))
            what = f" ({pace:g} against {idle:g} records/s)" if pace is not None and idle is not None else ""
            out.append((t, STRAGGLER, f"{inst} straggler{what}: {_int(e.get('records'))} records re-leased"))
        elif kind == "registered" and inst in relaunched:
            relaunched.discard(inst)
            out.append((t, JOINED, f"{inst} rejoined"))
        elif kind == "failure" and not any(m[1] == FAILED for m in out):
            out.append((t, FAILED, f"job failed ({detail.split(':', 1)[0]})" if detail else "job failed"))
    return out


def _series(rows: list[dict], key: str) -> list[tuple[float, float]]:
    pts = []
    for r in rows:
        t, v = num(r.get("t")), num(r.get(key))
        if t is not None and v is not None:
            pts.append((t, v))
    return pts


def throughput_series(samples: list[dict]) -> list[tuple[float, float]]:
    """Records committed per second between consecutive samples (the `records_per_s` of a sample is the
    terminal's smoothed rate, which lags behind changes; it is used only when records are missing)."""
    pts, prev = [], None
    for s in samples:
        t, r = num(s.get("t")), num(s.get("records"))
        if t is None:
            continue
        if r is None:
            v = num(s.get("records_per_s"))
            if v is not None:
                pts.append((t, v))
            continue
        if prev is not None and t > prev[0]:
            pts.append((t, max(0.0, (r - prev[1]) / (t - prev[0]))))
        prev = (t, r)
    return pts


def eval_names(summary: dict) -> list[str]:
    final = _dict(summary, "eval")
    skip = {"loss", "records", "t", "epoch"}
    names = [k for k, v in final.items() if k not in skip and num(v) is not None]
    if not names:
        names = sorted(
            {k for r in _rows(summary, "eval_history") for k, v in r.items() if k not in skip and num(v) is not None}
        )
    return names or ["loss"]


def _startup(summary: dict) -> float | None:
    for e in _rows(summary, "events"):
        if e.get("kind") == "training_started":
            return num(e.get("t"))
    return None


def _t_end(summary: dict) -> float:
    ts = [
        num(r.get("t"))
        for key in ("timeseries", "workers_alive", "eval_history", "events")
        for r in _rows(summary, key)
    ]
    return max([t for t in ts if t is not None], default=0.0)


# ---------------------------------------------------------------- sections
def _cards(summary: dict) -> str:
    """The headline figures: (label, value, small print)."""
    ev, w = _dict(summary, "eval"), _dict(summary, "workers")
    epochs = _rows(_dict(summary, "ledger"), "epochs")
    n_eval = _int(ev.get("records"))
    cards = [
        (f"eval {k}", f"{num(v):.4f}", f"on {n_eval:,} held-out records" if n_eval else "")
        for k, v in ev.items()
        if k != "records" and num(v) is not None
    ]
    rate = num(summary.get("throughput_records_per_s"))
    cards.append(("throughput", f"{rate:,.0f} rec/s" if rate else "–", "first to last commit"))
    train_s, start_s = num(summary.get("training_seconds")), num(summary.get("startup_seconds"))
    if train_s is not None:
        started = rate and start_s  # start-up ends at the first commit
        cards.append(("training time", f"{train_s:.1f} s", f"after {start_s:.1f} s start-up" if started else ""))
    cards.append(
        (
            "workers",
            f"{_int(w.get('lost'))} lost · {_int(w.get('relaunched'))} relaunched",
            f"{_int(w.get('started'))} started, at most {_int(w.get('max_alive'))} at once",
        )
    )
    if epochs:
        states = [epoch_state(r, _finished(summary)) for r in epochs]
        exact = states.count("exact")
        value = "NOT exact" if "NOT exact" in states else "incomplete" if "incomplete" in states else "exact"
        cards.append(
            (
                "data ledger",
                value,
                f"{exact} of {len(epochs)} epochs complete, no record applied twice"
                if "incomplete" in states and "NOT exact" not in states
                else f"{exact} of {len(epochs)} epochs committed exactly once",
            )
        )
    audit = _dict(summary, "audit")
    if audit.get("verdict"):
        cards.append(
            (
                "exactly-once audit",
                str(audit["verdict"]),
                "from what the model's state holds, not the ledger"
                if audit["verdict"] != "unavailable"
                else str(audit.get("reason", "")),
            )
        )
    stop = _dict(summary, "early_stop")
    if stop:  # which epoch's weights the model holds, and why training ended
        best = stop.get("best_epoch")
        cards.append(
            ("early stopping", f"epoch {best + 1}'s weights" if isinstance(best, int) else "-", stop["reason"])
        )
    return (
        '<div class="cards" id="cards">'
        + "".join(
            f'<div class="card"><div class="k">{esc(k)}</div><div class="v">{esc(v)}</div>'
            + (f'<div class="s">{esc(small)}</div>' if small else "")
            + "</div>"
            for k, v, small in cards
        )
        + "</div>"
    )


def _subtitle(summary: dict) -> str:
    cfg = _dict(summary, "config")
    bits = [
        ("job", summary.get("job_id")),
        ("strategy", summary.get("strategy")),
        ("backend", summary.get("backend")),
        ("model", cfg.get("model_def")),
        ("epochs", summary.get("epochs")),
        ("records per epoch", summary.get("records_per_epoch")),
        ("minibatch", cfg.get("minibatch_size")),
        (
            "workers",
            f"{cfg['min_workers']}–{cfg['max_workers']}" if "min_workers" in cfg and "max_workers" in cfg else None,
        ),
        ("parameter servers", cfg.get("num_ps")),
    ]
    return '<p class="sub">' + " · ".join(f"{esc(k)} <b>{esc(v)}</b>" for k, v in bits if v not in (None, "")) + "</p>"


def _error(summary: dict) -> str:
    err = summary.get("error")
    if not err:
        return ""
    if isinstance(err, dict):
        where = f" ({err['instance']})" if err.get("instance") else ""
        head = f"{err.get('kind', 'error')}{where}: {err.get('message', '')}"
        tail = err.get("traceback") or ""
    else:
        head, tail = str(err), ""
    return (
        f'<div class="error" id="error"><b>The job failed.</b> {esc(head)}'
        + (
            f"<details><summary>Traceback / last lines of its log</summary><pre>{esc(tail)}</pre></details>"
            if tail
            else ""
        )
        + "</div>"
    )


def epoch_state(r: dict, finished: bool) -> str:
    """ "exact": every record committed once; "incomplete": the epoch a failed job stopped in (what was
    committed, was committed once); "NOT exact": records lost or applied twice."""
    committed, records = _int(r.get("committed")), _int(r.get("records"))
    if _int(r.get("double_applied")) or committed > records:
        return "NOT exact"
    if committed == records:
        return "exact"
    return "NOT exact" if finished else "incomplete"  # the ledger's `lost` is records - committed


def _finished(summary: dict) -> bool:
    return summary.get("status") == "succeeded"


def goodput_chart(goodput: dict) -> str:
    """Two stacked bars: the step's wall time and its workers' seconds, each split into training that produced records
    committed once and the causes of the rest."""
    title = "Goodput: where the step's time went"
    bars = [
        ("wall time", _dict(goodput, "wall_s"), "ratio"),
        ("worker-seconds", _dict(goodput, "worker_s"), "worker_ratio"),
    ]
    shown = [(k, n, c) for k, n, c in GOODPUT_PARTS if any((num(b.get(k)) or 0) > 0 for _, b, _ in bars)]
    height, left, bar_h = 116, 110, 32  # as tall as a person reads a bar at a glance (the render test: > 100 px)
    out = [
        f"<figure><figcaption>{title}{_legend([(n, c, None) for _, n, c in shown])}</figcaption>"
        f'<svg id="chart-goodput" class="chart" viewBox="0 0 {W} {height}" role="img" aria-label="{title}" '
        f'xmlns="http://www.w3.org/2000/svg">'
    ]
    width = W - left - PAD_R - 60
    for row, (name, spent, ratio) in enumerate(bars):
        y = 14 + row * (bar_h + 22)
        total = sum(max(0.0, num(v) or 0.0) for v in spent.values())
        out.append(f'<text x="{left - 6}" y="{y + bar_h * 0.7}" text-anchor="end">{name}</text>')
        if not total:
            out.append(f'<text x="{left}" y="{y + bar_h * 0.7}" class="nodata">no goodput recorded</text>')
            continue
        x = float(left)
        for key, label, colour in shown:
            w = max(0.0, num(spent.get(key)) or 0.0) / total * width
            if w > 0:
                out.append(
                    f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="{colour}">'
                    f"<title>{esc(label)}: {fmt(num(spent.get(key)))} s</title></rect>"
                )
            x += w
        share = num(goodput.get(ratio))
        if share is not None:
            out.append(f'<text x="{left + width + 6}" y="{y + bar_h * 0.7}">{100 * share:.0f} %</text>')
    out.append("</svg></figure>")
    return "".join(out)


def ledger_chart(rows: list[dict], finished: bool = True) -> str:
    """One bar per epoch: records committed (green) against the epoch's records (dashed line), records
    not committed (red; grey in the epoch a failed job stopped in) and applied twice (dark red) stacked
    on top, records requeued after a loss (orange) inside."""
    height, top, plot_h = 150, 12, 104
    bottom = top + plot_h
    title = "Records committed per epoch"
    missing_colour = LOST if finished else "#c8c8c8"
    keys = _ledger_keys(rows, finished, missing_colour)
    out = [
        f"<figure><figcaption>{title}{_legend([(n, c, None) for c, n in keys])}</figcaption>"
        f'<svg id="chart-ledger" class="chart" viewBox="0 0 {W} {height}" role="img" aria-label="{title}" '
        f'xmlns="http://www.w3.org/2000/svg">'
    ]
    if not rows:
        out.append(
            f'<text x="{W / 2}" y="{top + plot_h / 2}" text-anchor="middle" class="nodata">no epoch was '
            f"committed</text></svg></figure>"
        )
        return "".join(out)
    y_hi = _nice_max(
        max(max(_int(r.get("records")), _int(r.get("committed")) + _int(r.get("double_applied"))) for r in rows) or 1
    )

    def y(v: float) -> float:
        return bottom - v / y_hi * plot_h

    slot = (W - PAD_L - PAD_R) / len(rows)
    bar = max(1.0, min(slot * 0.72, 40.0))
    for tv in nice_ticks(0.0, y_hi, 2):
        out.append(
            f'<line x1="{PAD_L}" x2="{W - PAD_R}" y1="{y(tv):.1f}" y2="{y(tv):.1f}" class="grid"/>'
            f'<text x="{PAD_L - 6}" y="{y(tv) + 4:.1f}" text-anchor="end" class="tick">{fmt(tv)}</text>'
        )
    every = max(1, math.ceil(len(rows) / 20))
    for i, r in enumerate(rows):
        cx = PAD_L + slot * (i + 0.5)
        out.append(_epoch_bar(r, i, cx, bar, y, missing_colour))
        if i % every == 0:
            out.append(
                f'<text x="{cx:.1f}" y="{bottom + 14}" text-anchor="middle" class="tick">'
                f"{esc(r.get('epoch', i))}</text>"
            )
    out.append(
        f'<text x="{W - PAD_R}" y="{height - 3}" text-anchor="end" class="tick">epoch (dashed: the '
        f'epoch\'s records)</text><text x="{PAD_L - 6}" y="{top - 2}" text-anchor="end" class="tick">'
        f"records</text></svg></figure>"
    )
    return "".join(out)


def _ledger_keys(rows: list[dict], finished: bool, missing_colour: str) -> list[tuple[str, str]]:
    """The ledger chart's legend, (colour, what): only what some epoch shows."""
    keys = [(JOINED, "committed")]
    if any(_int(r.get("requeued")) for r in rows):
        keys.append((RATE, "of which requeued after a loss"))
    if any(_int(r.get("committed")) < _int(r.get("records")) for r in rows):
        keys.append((missing_colour, "not committed" if finished else "not committed (the job stopped)"))
    if any(_int(r.get("double_applied")) for r in rows):
        keys.append((FAILED, "applied twice"))
    return keys


def _epoch_bar(r: dict, i: int, cx: float, bar: float, y, missing_colour: str) -> str:
    """One epoch's bar, centred on `cx`: committed, requeued inside it, not committed and applied twice on top,
    and a dashed line at the epoch's records."""
    out = []
    records, committed = _int(r.get("records")), _int(r.get("committed"))
    lost, double, requeued = max(0, records - committed), _int(r.get("double_applied")), _int(r.get("requeued"))
    x0 = cx - bar / 2
    tip = (
        f"epoch {r.get('epoch', i)}: {committed} of {records} records committed, "
        f"{double} applied twice, {requeued} requeued after a loss"
    )
    out.append(
        f'<g class="epoch"><title>{esc(tip)}</title>'
        f'<rect x="{x0:.1f}" y="{y(committed):.1f}" width="{bar:.1f}" height="{y(0) - y(committed):.1f}" '
        f'fill="{JOINED}" opacity="0.75"/>'
    )
    if requeued:
        out.append(
            f'<rect x="{x0:.1f}" y="{y(requeued):.1f}" width="{bar:.1f}" '
            f'height="{y(0) - y(requeued):.1f}" fill="{RATE}"/>'
            f'<text x="{cx:.1f}" y="{y(max(records, committed)) - 3:.1f}" text-anchor="middle" '
            f'class="tick" fill="{RATE}">{requeued}</text>'
        )
    if lost:
        out.append(
            f'<rect x="{x0:.1f}" y="{y(committed + lost):.1f}" width="{bar:.1f}" '
            f'height="{y(committed) - y(committed + lost):.1f}" fill="{missing_colour}"/>'
        )
    if double:
        base = max(committed, records)
        out.append(
            f'<rect x="{x0:.1f}" y="{y(base + double):.1f}" width="{bar:.1f}" '
            f'height="{y(base) - y(base + double):.1f}" fill="{FAILED}"/>'
        )
    out.append(
        f'<line x1="{x0 - 1:.1f}" x2="{x0 + bar + 1:.1f}" y1="{y(records):.1f}" y2="{y(records):.1f}" '
        f'stroke="#333" stroke-dasharray="2 2"/></g>'
    )
    return "".join(out)


def _ledger(summary: dict) -> str:
    ledger = _dict(summary, "ledger")
    rows = _rows(ledger, "epochs")
    states = [epoch_state(r, _finished(summary)) for r in rows]
    exact, bad = states.count("exact"), states.count("NOT exact")
    requeued = sum(_int(r.get("requeued")) for r in rows)
    lost_workers = _int(_dict(summary, "workers").get("lost"))
    if rows:
        if bad:
            verdict = f'<b class="bad">{bad} of {len(rows)} epochs NOT exact</b>: records missing or applied twice'
        elif exact == len(rows):
            verdict = f"<b>All {len(rows)} epochs exact</b>: every record committed exactly once"
        else:
            verdict = (
                f"<b>No record applied twice</b>: {exact} complete epoch{'s' if exact != 1 else ''} exact; "
                f"the job stopped in epoch {esc(rows[-1].get('epoch', len(rows) - 1))}, which is incomplete"
            )
        verdict += (
            f"; {requeued} records requeued after {lost_workers} worker loss{'es' if lost_workers != 1 else ''}"
            if requeued
            else ""
        ) + "."
    else:
        verdict = "No epoch was committed."
    body = []
    for i, (r, state) in enumerate(zip(rows, states)):
        records, committed = _int(r.get("records")), _int(r.get("committed"))
        width = min(100.0, 100.0 * committed / records) if records else 0.0
        body.append(
            f'<tr class="{"bad" if state == "NOT exact" else "ok"}"><td>{esc(r.get("epoch", i))}</td><td>{records}</td>'
            f'<td><span class="bar"><span style="width:{width:.1f}%"></span></span> {committed}</td>'
            f"<td>{max(0, records - committed)}</td><td>{_int(r.get('double_applied'))}</td>"
            f"<td>{_int(r.get('requeued'))}</td><td>{state}</td></tr>"
        )
    table = (
        '<table id="ledger"><thead><tr><th>epoch</th><th>records</th><th>committed</th><th>not committed</th>'
        "<th>applied twice</th><th>requeued after a loss</th><th></th></tr></thead><tbody>"
        + "".join(body)
        + "</tbody></table>"
    )
    is_open = " open" if len(rows) <= 12 or bad else ""
    return (
        f'<p id="ledger-verdict">{verdict}</p>{ledger_chart(rows, _finished(summary))}'
        f"<details{is_open}><summary>Per-epoch table ({len(rows)} epochs)</summary>{table}</details>"
    )


def _audit(summary: dict) -> str:
    """The exactly-once audit: the model state's own accounting laid over the data set (master/durability/audit.py)."""
    audit = _dict(summary, "audit")
    if not audit:
        return '<p id="audit-verdict">No audit in this summary.</p>'
    rows = _rows(audit, "epochs")
    verdict = str(audit.get("verdict"))
    if verdict == "exact":
        head = (
            f"<b>Exact</b>: every record of all {len(rows)} epochs was applied exactly once, "
            f"{esc(audit.get('where', ''))}."
        )
    elif verdict == "violated":
        head = '<b class="bad">VIOLATED</b>: see the epochs marked below.'
        if _int(audit.get("records_outside_the_data")):
            head += f" {_int(audit.get('records_outside_the_data'))} applied records are not in the data set."
    else:
        head = f"Unavailable: {esc(audit.get('reason', ''))}."
    body = "".join(
        f'<tr class="{"ok" if _int(r.get("applied_once")) == _int(r.get("records")) else "bad"}">'
        f"<td>{esc(r.get('epoch', i))}</td><td>{_int(r.get('records'))}</td><td>{_int(r.get('applied_once'))}</td>"
        f"<td>{_int(r.get('never'))}</td><td>{_int(r.get('more_than_once'))}</td>"
        f"<td>{_int(r.get('shards_disagree'))}</td></tr>"
        for i, r in enumerate(rows)
    )
    table = (
        '<table id="audit"><thead><tr><th>epoch</th><th>records</th><th>applied once</th><th>never</th>'
        "<th>more than once</th><th>shards disagree</th></tr></thead><tbody>" + body + "</tbody></table>"
    )
    is_open = " open" if len(rows) <= 12 or verdict != "exact" else ""
    return (
        f'<p id="audit-verdict">{head}</p>'
        f"<details{is_open}><summary>Per-epoch audit ({len(rows)} epochs)</summary>{table}</details>"
    )


def _recovery(summary: dict) -> str:
    rec, w, ledger = _dict(summary, "recovery"), _dict(summary, "workers"), _dict(summary, "ledger")
    lat = [v for v in (num(x) for x in rec.get("requeue_latency_s", []) or []) if v is not None]
    first = [v for v in (num(x) for x in rec.get("first_commit_after_loss_s", []) or []) if v is not None]
    facts = [
        ("workers lost / relaunched", f"{_int(w.get('lost'))} / {_int(w.get('relaunched'))}"),
        ("most workers training at once", str(_int(w.get("max_alive")))),
        ("loss → its remainder requeued", ", ".join(f"{v * 1000:.1f} ms" for v in lat) or "– (no lease was cut short)"),
        ("loss → the replacement's first commit", ", ".join(f"{v:.2f} s" for v in first) or "–"),
        ("records applied twice", str(sum(_int(r.get("double_applied")) for r in _rows(ledger, "epochs")))),
        ("duplicate pushes suppressed by the parameter servers", str(_int(ledger.get("duplicate_pushes_suppressed")))),
    ]
    fencing = summary.get("fencing") if isinstance(summary.get("fencing"), dict) else {}
    if fencing.get("fenced"):  # worker launches given up; their calls and pushes refused (guarantees.md)
        refused_pushes = sum(_int(p.get("pushes_fenced")) for p in _rows(summary, "ps"))
        facts.append(
            (
                "fenced worker launches (refused: calls to the master, pushes)",
                f"{', '.join(sorted(fencing['fenced']))} ({_int(fencing.get('refused'))}, {refused_pushes})",
            )
        )
    out = "<dl>" + "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in facts) + "</dl>"
    ps = _rows(summary, "ps")
    if ps:
        out += (
            '<table id="ps"><thead><tr><th>PS shard</th><th>pushes applied</th><th>duplicates skipped</th>'
            "<th>fenced pushes refused</th><th>dense parameters</th></tr></thead><tbody>"
            + "".join(
                f"<tr><td>{esc(p.get('shard', i))}</td><td>{_int(p.get('pushes_applied'))}</td>"
                f"<td>{_int(p.get('pushes_skipped'))}</td><td>{_int(p.get('pushes_fenced'))}</td>"
                f"<td>{_int(p.get('dense_parameters')):,}</td></tr>"
                for i, p in enumerate(ps)
            )
            + "</tbody></table>"
        )
    return out


CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 20px auto; max-width: 760px;
  padding: 0 12px; color: #222; }
h1 { font-size: 21px; margin: 0 0 2px; } h2 { font-size: 16px; margin: 26px 0 4px; border-bottom: 1px solid #ddd; }
.status { font-size: 13px; padding: 2px 9px; border-radius: 10px; vertical-align: middle; margin-left: 6px;
  color: #fff; background: #777; } .status.succeeded { background: #2a8a2a; } .status.failed { background: #c0392b; }
.sub { color: #555; margin: 2px 0 12px; font-size: 13px; } .sub b { color: #222; font-weight: 600; }
.cards { display: grid; grid-template-columns: repeat(3, 1fr); gap: 8px; }
.card { border: 1px solid #e2e2e2; border-radius: 6px; padding: 6px 10px; background: #fcfcfc; }
.card .k { font-size: 12px; color: #666; } .card .v { font-size: 17px; font-weight: 600; white-space: nowrap; }
.card .s { font-size: 11px; color: #777; }
figure { margin: 10px 0 14px; } figcaption { font-weight: 600; margin-bottom: 3px; }
.key { font-weight: 400; font-size: 12px; color: #444; margin-left: 8px; white-space: nowrap; }
.key i { display: inline-block; width: 10px; height: 10px; margin-right: 4px; vertical-align: -1px; }
svg.chart { width: 100%; height: auto; background: #fff; border: 1px solid #e4e4e4; display: block; }
.grid { stroke: #eee; } .axis { stroke: #999; } .tick { font-size: 10px; fill: #666; }
.mlabel, .reflabel { font-size: 10px; } .dotlabel { font-size: 11px; font-weight: 600; }
.startup { fill: #f1f1f1; } .nodata { font-size: 13px; fill: #999; }
.error { color: #8b0000; background: #fdecea; border: 1px solid #f5c6c1; padding: 8px 10px; border-radius: 6px;
  margin: 10px 0; } .error pre { white-space: pre-wrap; font-size: 12px; margin: 6px 0 0; color: #333; }
dl { display: grid; grid-template-columns: max-content auto; gap: 2px 16px; margin: 6px 0; } dt { color: #666; }
dd { margin: 0; }
table { border-collapse: collapse; min-width: 60%; margin: 6px 0; font-size: 13px; }
th, td { padding: 2px 8px; border-bottom: 1px solid #eee; text-align: right; } th { color: #555; font-weight: 600; }
tr.bad td, .bad { color: #b00; } details summary { cursor: pointer; color: #444; margin: 4px 0; }
.bar { display: inline-block; width: 70px; height: 8px; background: #eee; vertical-align: middle; }
.bar span { display: block; height: 8px; background: #2ca02c; }
.note { color: #555; font-size: 13px; margin: 2px 0 6px; }
"""


def _loss_chart(summary: dict, axis: TimeAxis, startup: float | None) -> str:
    return time_chart(
        "chart-loss",
        "Training loss (moving average over reported minibatches)",
        axis,
        [("loss", LOSS, _series(_rows(summary, "timeseries"), "loss"))],
        "loss",
        startup=startup,
    )


def _eval_chart(summary: dict, axis: TimeAxis, startup: float | None) -> str:
    """Each eval metric over time, and the final evaluation's figures as dots at the end; on a 0..1 scale when
    every figure is a share."""
    names = eval_names(summary)
    history = _rows(summary, "eval_history")
    final = _dict(summary, "eval")
    eval_series = [(n, EVAL_COLOURS[i % len(EVAL_COLOURS)], _series(history, n)) for i, n in enumerate(names)]
    dots = [
        (axis.t_end, num(final[n]), EVAL_COLOURS[i % len(EVAL_COLOURS)], f"final {n} {num(final[n]):.4f}")
        for i, n in enumerate(names)
        if num(final.get(n)) is not None
    ]
    bounded = all(0.0 <= v <= 1.0 for _, _, pts in eval_series for _, v in pts) and all(0 <= d[1] <= 1 for d in dots)
    return time_chart(
        "chart-eval",
        "Evaluation on held-out data before training, after epochs (within 2 % of training's time), "
        "and the final evaluation",
        axis,
        eval_series,
        " / ".join(names),
        dots=dots,
        startup=startup,
        y_max=1.0 if bounded else None,
        legend=len(names) > 1,
        points=True,
    )


def _throughput_chart(summary: dict, axis: TimeAxis, startup: float | None) -> str:
    rate = throughput_series(_rows(summary, "timeseries"))
    overall = num(summary.get("throughput_records_per_s"))
    return time_chart(
        "chart-throughput",
        "Throughput: records committed per second",
        axis,
        [("records/s", RATE, rate)],
        "records/s",
        startup=startup,
        hlines=[(overall, "#a0522d", f"whole job: {overall:,.0f} records/s")] if overall else [],
    )


def _workers_chart(summary: dict, axis: TimeAxis, startup: float | None) -> str:
    alive = _series(_rows(summary, "workers_alive"), "alive")
    if alive and alive[-1][0] < axis.t_end:
        alive.append((axis.t_end, alive[-1][1]))  # the count holds until the end
    max_workers = num(_dict(summary, "config").get("max_workers"))
    return time_chart(
        "chart-workers",
        "Workers training (red: lost or ended early; green: relaunched worker rejoined)",
        axis,
        [("workers", ALIVE, alive)],
        "workers",
        step=True,
        startup=startup,
        hlines=[(max_workers, "#888", f"max_workers {max_workers:.0f}")] if max_workers else [],
    )


def render_report(summary: dict) -> str:
    """The report as one HTML string; any summary, however incomplete, renders."""
    summary = summary if isinstance(summary, dict) else {}
    axis = TimeAxis(_t_end(summary), markers(summary))
    startup = _startup(summary)
    status = str(summary.get("status") or "unknown")
    charts = [
        _loss_chart(summary, axis, startup),
        _eval_chart(summary, axis, startup),
        _throughput_chart(summary, axis, startup),
        _workers_chart(summary, axis, startup),
    ]
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>elastic-step training report — {esc(summary.get("job_id", ""))}</title>
<style>{CSS}</style></head><body>
<h1>Training report <span class="status {esc(status)}" id="status">{esc(status)}</span></h1>
{_subtitle(summary)}
{_error(summary)}
{_cards(summary)}
<h2>Training</h2>
<p class="note">All charts share one time axis. Grey: start-up (parameter servers and workers starting).
Dashed vertical lines: workers lost (red) and relaunched workers rejoining (green).</p>
{"".join(charts)}
{goodput_chart(_dict(summary, "goodput"))}
<h2>Data ledger</h2>
<p class="note">A lost worker's task is requeued from its last reported watermark, not replayed whole, and a
parameter server applies each (task, minibatch) push at most once.</p>
{_ledger(summary)}
<h2>Exactly-once audit</h2>
<p class="note">The ledger is what the master believes. The audit checks it against evidence it does not
produce: each PS shard accounts for the records of every push it applied, and those ranges are laid over
the data set. A record counts as applied once only when every shard applied it exactly once.</p>
{_audit(summary)}
<h2>Recovery</h2>
{_recovery(summary)}
</body></html>
"""


def write_report(summary: dict, path: str) -> None:
    """Write the report atomically (local path or fsspec URI): a reader never sees half a page."""
    atomic_write_text(path, render_report(summary))
