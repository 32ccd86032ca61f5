"""The training report: one self-contained HTML page drawn from summary.json.

Charts are inline SVG drawn here (no script, no fonts, no network fetches), so the page renders
the same in the KFP UI's sandboxed iframe, in a browser from a bucket, or offline.
"""
from __future__ import annotations

import html
import math

from elastic_step.util.atomic import atomic_write_text

W, H, PAD_L, PAD_R, PAD_T, PAD_B = 640, 200, 56, 16, 14, 30
LOST, JOINED = "#d62728", "#2ca02c"


def _scale(lo: float, hi: float, a: float, b: float):
    span = (hi - lo) or 1.0
    return lambda v: a + (v - lo) / span * (b - a)


def _ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    if hi <= lo:
        return [lo]
    step = 10 ** math.floor(math.log10((hi - lo) / n))
    for m in (1, 2, 5, 10):
        if (hi - lo) / (step * m) <= n:
            step *= m
            break
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def _fmt(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 or v == int(v) else f"{v:.3g}"


def line_chart(chart_id: str, title: str, series: list[tuple[str, str, list[tuple[float, float]]]],
               markers: list[tuple[float, str, str]] = (), y_label: str = "", step: bool = False) -> str:
    """An SVG line chart: series of (name, colour, [(t, y)]) and vertical markers (t, colour, label)."""
    points = [p for _, _, pts in series for p in pts]
    out = [f'<figure><figcaption>{html.escape(title)}</figcaption>',
           f'<svg id="{chart_id}" class="chart" viewBox="0 0 {W} {H}" role="img" '
           f'aria-label="{html.escape(title)}" xmlns="http://www.w3.org/2000/svg">']
    if not points:
        out.append(f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle" class="muted">no data</text></svg></figure>')
        return "".join(out)
    t_hi = max([p[0] for p in points] + [m[0] for m in markers]) or 1.0
    y_lo, y_hi = min(0.0, min(p[1] for p in points)), max(p[1] for p in points) * 1.08 or 1.0
    x = _scale(0.0, t_hi, PAD_L, W - PAD_R)
    y = _scale(y_lo, y_hi, H - PAD_B, PAD_T)
    for tv in _ticks(y_lo, y_hi):
        out.append(f'<line x1="{PAD_L}" x2="{W - PAD_R}" y1="{y(tv):.1f}" y2="{y(tv):.1f}" class="grid"/>'
                   f'<text x="{PAD_L - 6}" y="{y(tv) + 4:.1f}" text-anchor="end" class="tick">{_fmt(tv)}</text>')
    for tv in _ticks(0.0, t_hi, 6):
        out.append(f'<text x="{x(tv):.1f}" y="{H - PAD_B + 16}" text-anchor="middle" class="tick">{_fmt(tv)}</text>')
    out.append(f'<text x="{W - PAD_R}" y="{H - 2}" text-anchor="end" class="tick">seconds</text>')
    if y_label:
        out.append(f'<text x="4" y="{PAD_T - 2}" class="tick">{html.escape(y_label)}</text>')
    for i, (t, colour, label) in enumerate(markers):
        # Labels on three staggered rows, flipped left near the right edge, so neighbours stay legible.
        near_right = x(t) > W - PAD_R - 90
        lx, anchor = (x(t) - 3, "end") if near_right else (x(t) + 3, "start")
        out.append(f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{PAD_T}" y2="{H - PAD_B}" stroke="{colour}" '
                   f'stroke-dasharray="4 3" class="marker"><title>{html.escape(label)}</title></line>'
                   f'<text x="{lx:.1f}" y="{PAD_T + 10 + (i % 3) * 11}" text-anchor="{anchor}" class="mlabel" '
                   f'fill="{colour}">{html.escape(label)}</text>')
    for name, colour, pts in series:
        if not pts:
            continue
        coords = []
        for i, (t, v) in enumerate(pts):
            if step and i:
                coords.append(f"{x(t):.1f},{y(pts[i - 1][1]):.1f}")
            coords.append(f"{x(t):.1f},{y(v):.1f}")
        out.append(f'<polyline points="{" ".join(coords)}" fill="none" stroke="{colour}" stroke-width="2" '
                   f'class="series" data-name="{html.escape(name)}"/>')
    out.append("</svg></figure>")
    return "".join(out)


def _markers(summary: dict) -> list[tuple[float, str, str]]:
    """A red line where a worker was lost (and relaunched), a green one where its replacement joined."""
    out, relaunched, seen = [], set(), set()
    for e in summary.get("events", []):
        kind, inst = e.get("kind"), e.get("instance", "")
        if kind == "decision" and e.get("detail", "").startswith("relaunch"):
            out.append((float(e["t"]), LOST, f"{inst} lost, relaunched"))
            relaunched.add(inst)
        elif kind == "registered" and inst.startswith("worker"):
            if inst in seen and inst in relaunched:
                out.append((float(e["t"]), JOINED, f"{inst} rejoined"))
            seen.add(inst)
    return out


def eval_series(summary: dict) -> list[tuple[str, str, list[tuple[float, float]]]]:
    """One series per eval metric over time: the per-epoch points, then the final evaluation."""
    points = list(summary.get("eval_history", []))
    final = summary.get("eval") or {}
    if final and summary.get("timeseries"):
        points.append({"t": summary["timeseries"][-1]["t"], **final})
    names = [k for k in final if k not in ("loss", "records") and isinstance(final[k], (int, float))] or ["loss"]
    colours = ["#9467bd", "#8c564b", "#e377c2", "#17becf"]
    return [(n, colours[i % len(colours)], [(p["t"], p[n]) for p in points if isinstance(p.get(n), (int, float))])
            for i, n in enumerate(names)]


def _ledger_table(summary: dict) -> str:
    rows = summary.get("ledger", {}).get("epochs", [])
    if not rows:
        return '<p class="muted">No epoch was committed.</p>'
    body = []
    for r in rows:
        exact = r["committed"] == r["records"] and r["lost"] == 0 and r["double_applied"] == 0
        width = 100.0 * r["committed"] / r["records"] if r["records"] else 0.0
        body.append(
            f'<tr class="{"ok" if exact else "bad"}"><td>{r["epoch"]}</td><td>{r["records"]}</td>'
            f'<td><span class="bar"><span style="width:{width:.1f}%"></span></span> {r["committed"]}</td>'
            f'<td>{r["lost"]}</td><td>{r["double_applied"]}</td><td>{r.get("requeued", 0)}</td>'
            f'<td>{"exact" if exact else "NOT exact"}</td></tr>')
    return ('<table id="ledger"><thead><tr><th>epoch</th><th>records</th><th>committed</th><th>lost</th>'
            '<th>double-applied</th><th>requeued after losses</th><th></th></tr></thead><tbody>'
            + "".join(body) + "</tbody></table>")


def _facts(summary: dict) -> str:
    ev = summary.get("eval", {})
    w = summary.get("workers", {})
    rec = summary.get("recovery", {})
    facts = [("status", summary.get("status", "?")), ("job", summary.get("job_id", "?")),
             ("strategy", summary.get("strategy", "?")), ("backend", summary.get("backend", "?"))]
    facts += [(f"eval {k}", f"{v:.4f}") for k, v in ev.items() if isinstance(v, float)]
    facts += [("throughput", f"{summary.get('throughput_records_per_s', 0):.0f} records/s"),
              ("workers started / lost / relaunched / max alive",
               f"{w.get('started', 0)} / {w.get('lost', 0)} / {w.get('relaunched', 0)} / {w.get('max_alive', 0)}"),
              ("requeue latency after a loss", ", ".join(f"{x:.3f} s" for x in rec.get("requeue_latency_s", []))
               or "none (no lease was cut short)"),
              ("duplicate pushes suppressed", str(summary.get("ledger", {}).get("duplicate_pushes_suppressed", 0)))]
    return "<dl>" + "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(str(v))}</dd>" for k, v in facts) + "</dl>"


def render_report(summary: dict) -> str:
    samples = summary.get("timeseries", [])
    markers = _markers(summary)
    loss = [(s["t"], s["loss"]) for s in samples if s.get("loss") is not None]
    rate = [(s["t"], s["records_per_s"]) for s in samples]
    alive = [(a["t"], a["alive"]) for a in summary.get("workers_alive", [])]
    eval_lines = ""
    if summary.get("eval"):
        eval_lines = "<p>Final evaluation: " + ", ".join(
            f"{html.escape(k)} <b>{v:.4f}</b>" for k, v in summary["eval"].items() if isinstance(v, float)) + "</p>"
    error = ""
    if summary.get("error"):
        error = f'<p class="error">{html.escape(str(summary["error"].get("message", summary["error"])))}</p>'
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>elastic-step training report — {html.escape(str(summary.get("job_id", "")))}</title>
<style>
body {{ font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 720px; color: #222; }}
h1 {{ font-size: 20px; margin-bottom: 4px; }} h2 {{ font-size: 16px; margin: 22px 0 6px; }}
dl {{ display: grid; grid-template-columns: max-content auto; gap: 2px 14px; }} dt {{ color: #666; }}
figure {{ margin: 8px 0 16px; }} figcaption {{ font-weight: 600; margin-bottom: 2px; }}
svg.chart {{ width: 100%; height: auto; background: #fafafa; border: 1px solid #e4e4e4; }}
.grid {{ stroke: #e6e6e6; }} .tick {{ font-size: 10px; fill: #777; }} .mlabel {{ font-size: 10px; }}
.muted {{ color: #888; }} .error {{ color: #b00; font-weight: 600; }}
table {{ border-collapse: collapse; width: 100%; }} th, td {{ padding: 3px 8px; border-bottom: 1px solid #eee;
  text-align: right; }} tr.bad td {{ color: #b00; }}
.bar {{ display: inline-block; width: 80px; height: 8px; background: #eee; vertical-align: middle; }}
.bar span {{ display: block; height: 8px; background: #2ca02c; }}
</style></head><body>
<h1>Training report</h1>
{_facts(summary)}
{error}{eval_lines}
<h2>Training</h2>
{line_chart("chart-loss", "Training loss (moving average of reported minibatches)", [("loss", "#1f77b4", loss)],
            markers, "loss")}
{line_chart("chart-eval", "Evaluation after each epoch (the last point is the final evaluation)",
            eval_series(summary), markers)}
{line_chart("chart-throughput", "Throughput (records/s)", [("records/s", "#ff7f0e", rate)], markers, "records/s")}
{line_chart("chart-workers", "Workers training (losses in red, relaunches in green)",
            [("workers", "#2ca02c", alive)], markers, "workers", step=True)}
<h2>Data ledger</h2>
<p>Every record of every epoch is committed exactly once: a lost worker's remainder is requeued from its
last watermark, and a push already applied by a parameter server is not applied again.</p>
{_ledger_table(summary)}
</body></html>
"""


def write_report(summary: dict, path: str) -> None:
    atomic_write_text(path, render_report(summary))
