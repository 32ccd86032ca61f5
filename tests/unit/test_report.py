"""The HTML training report: self-contained, every chart present, user text escaped, losses and
relaunches marked, and it renders whatever summary a job leaves behind (a failed one, an empty one,
junk values)."""

from __future__ import annotations

import html.parser
import json
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_step.report import (
    CHART_IDS,
    epoch_state,
    markers,
    nice_ticks,
    render_report,
    throughput_series,
    write_report,
)

SUMMARY = {
    "status": "succeeded",
    "job_id": "es-1",
    "strategy": "ps",
    "backend": "local",
    "records_per_epoch": 100,
    "epochs": 2,
    "throughput_records_per_s": 1234.5,
    "training_seconds": 2.4,
    "startup_seconds": 0.9,
    "config": {"minibatch_size": 32, "min_workers": 1, "max_workers": 2, "num_ps": 1, "model_def": "m.py"},
    "eval": {"loss": 0.1, "records": 40, "accuracy": 0.97},
    "ledger": {
        "epochs": [
            {"epoch": 0, "records": 100, "committed": 100, "lost": 0, "double_applied": 0, "requeued": 32},
            {"epoch": 1, "records": 100, "committed": 100, "lost": 0, "double_applied": 0, "requeued": 0},
        ],
        "records_committed": 200,
        "duplicate_pushes_suppressed": 1,
    },
    "workers": {"started": 3, "lost": 1, "relaunched": 1, "max_alive": 2},
    "eval_history": [
        {"t": 1.2, "epoch": 0, "loss": 0.5, "accuracy": 0.8},
        {"t": 2.2, "epoch": 1, "loss": 0.2, "accuracy": 0.95},
    ],
    "recovery": {"requeue_latency_s": [0.012], "first_commit_after_loss_s": [1.1]},
    "timeseries": [
        {"t": 0.5, "epoch": 0, "records": 0, "records_per_s": 0.0, "loss": None, "workers_alive": 2},
        {"t": 1.0, "epoch": 0, "records": 60, "records_per_s": 100.0, "loss": 2.0, "workers_alive": 2},
        {"t": 2.0, "epoch": 1, "records": 200, "records_per_s": 140.0, "loss": 0.5, "workers_alive": 1},
    ],
    "workers_alive": [{"t": 0.5, "alive": 1}, {"t": 0.9, "alive": 2}, {"t": 1.5, "alive": 1}, {"t": 2.5, "alive": 2}],
    "events": [
        {"t": 0.9, "kind": "registered", "instance": "worker-0", "detail": ""},
        {"t": 0.95, "kind": "training_started", "instance": "", "detail": "2 workers registered"},
        {"t": 1.49, "kind": "chaos", "instance": "worker-0", "detail": "kill at 80 records"},
        {"t": 1.5, "kind": "lost", "instance": "worker-0", "detail": "killed by SIGKILL"},
        {"t": 1.5, "kind": "requeued", "instance": "worker-0", "detail": "records [64,96)"},
        {"t": 1.5, "kind": "decision", "instance": "worker-0", "detail": "relaunch: worker-0 killed"},
        {"t": 2.5, "kind": "registered", "instance": "worker-0", "detail": ""},
    ],
    "ps": [{"shard": 0, "pushes_applied": 12, "pushes_skipped": 1, "dense_parameters": 17226}],
}


class _Checker(html.parser.HTMLParser):
    """Collects ids and tags, and checks that every element opened is closed in order."""

    VOID = {"meta", "br", "img", "input", "link", "hr", "line", "rect", "circle", "polyline", "path"}

    def __init__(self):
        super().__init__()
        self.ids, self.stack, self.errors, self.texts = [], [], [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.append(a["id"])
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        if dict(attrs).get("id"):
            self.ids.append(dict(attrs)["id"])

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()

    def handle_data(self, data):
        self.texts.append(data)


def parse(page: str) -> _Checker:
    c = _Checker()
    c.feed(page)
    c.close()
    return c


def test_all_charts_and_the_ledger_are_there_and_the_markup_is_balanced():
    page = render_report(SUMMARY)
    doc = parse(page)
    assert doc.errors == [] and doc.stack == []
    assert len(doc.ids) == len(set(doc.ids)), "ids must be unique"
    for chart in CHART_IDS:
        assert chart in doc.ids
    for chart in ("chart-loss", "chart-eval", "chart-throughput", "chart-workers"):
        assert re.search(rf'<svg id="{chart}"[^>]*>.*?<polyline', page, re.S), chart
    assert {"ledger", "ps", "status", "cards", "ledger-verdict"} <= set(doc.ids)
    assert page.count('<tr class="ok">') == 2 and "All 2 epochs exact" in page


def test_header_shows_status_job_eval_and_throughput():
    text = " ".join(parse(render_report(SUMMARY)).texts)
    for expected in (
        "succeeded",
        "es-1",
        "0.9700",
        "0.1000",
        "1,234 rec/s",
        "1 lost · 1 relaunched",
        "on 40 held-out records",
    ):
        assert expected in text, expected


def test_loss_and_relaunch_are_marked_on_every_time_chart():
    page = render_report(SUMMARY)
    assert markers(SUMMARY) == [
        (1.5, "#d62728", "worker-0 lost (chaos kill), relaunched"),
        (2.5, "#2ca02c", "worker-0 rejoined"),
    ]
    for chart in ("chart-loss", "chart-eval", "chart-throughput", "chart-workers"):
        svg = re.search(rf'<svg id="{chart}".*?</svg>', page, re.S).group(0)
        assert "worker-0 lost (chaos kill), relaunched" in svg and "worker-0 rejoined" in svg, chart
        assert 'class="startup"' in svg  # the start-up band, up to training_started


def test_final_evaluation_is_a_labelled_dot_after_the_per_epoch_curve():
    svg = re.search(r'<svg id="chart-eval".*?</svg>', render_report(SUMMARY), re.S).group(0)
    assert 'class="final"' in svg and "final accuracy 0.9700" in svg
    assert svg.count('class="point"') == 2  # one dot per epoch evaluation


def test_a_worker_that_exits_early_and_a_failed_ps_are_marked():
    events = [
        {"t": 1.0, "kind": "exited", "instance": "worker-1", "detail": "exit 0"},
        {"t": 1.0, "kind": "decision", "instance": "worker-1", "detail": "relaunch: exited with code 0"},
        {"t": 3.0, "kind": "lost", "instance": "ps-0", "detail": "deleted"},
        {"t": 3.0, "kind": "decision", "instance": "ps-0", "detail": "fail: parameter server lost"},
        {"t": 3.1, "kind": "failure", "instance": "ps-0", "detail": "instance_failed: ..."},
    ]
    labels = [m[2] for m in markers({"events": events})]
    assert labels == ["worker-1 exited (exit 0), relaunched", "ps-0 lost: job failed"]


def test_a_worker_declared_hung_is_marked_with_its_bound_not_as_the_chaos_that_froze_it():
    events = [
        {"t": 1.0, "kind": "chaos", "instance": "worker-1", "detail": "stop at 400 records"},
        {"t": 4.0, "kind": "hung", "instance": "worker-1", "detail": "no progress ...", "idle_s": 3.1, "bound_s": 3.0},
        {"t": 4.01, "kind": "lost", "instance": "worker-1", "detail": "declared hung, then killed by SIGKILL"},
        {"t": 4.01, "kind": "decision", "instance": "worker-1", "detail": "relaunch: worker-1 declared hung"},
        {"t": 4.5, "kind": "registered", "instance": "worker-1", "detail": ""},
    ]
    assert markers({"events": events}) == [
        (4.0, "#d62728", "worker-1 declared hung (bound 3 s), relaunched"),
        (4.5, "#2ca02c", "worker-1 rejoined"),
    ]


def test_a_zombie_is_marked_as_fenced_and_its_refusals_counted():
    events = [
        {"t": 4.0, "kind": "fenced", "instance": "worker-1", "detail": "launch 1: declared hung", "launch": 1},
        {"t": 4.0, "kind": "hung", "instance": "worker-1", "detail": "no progress ...", "idle_s": 3.1, "bound_s": 3.0},
        {"t": 4.02, "kind": "fence_refused", "instance": "worker-1", "detail": "launch 1: GetTask refused"},
        {"t": 4.05, "kind": "lost", "instance": "worker-1", "detail": "declared hung, then exit code 4"},
        {"t": 4.05, "kind": "decision", "instance": "worker-1", "detail": "relaunch: worker-1 declared hung"},
    ]
    assert markers({"events": events}) == [
        (4.0, "#d62728", "worker-1 declared hung (bound 3 s), came back fenced, relaunched")
    ]
    fencing = {"fenced": {"worker-1": {"launch": 1, "why": "declared hung", "refused": 2}}, "refused": 2}
    ps = [{**SUMMARY["ps"][0], "pushes_fenced": 1}]
    text = " ".join(parse(render_report({**SUMMARY, "events": events, "fencing": fencing, "ps": ps})).texts)
    assert "fenced worker launches (refused: calls to the master, pushes) worker-1 (2, 1)" in text


def test_a_stragglers_handover_is_marked_with_its_paces():
    events = [
        {
            "t": 7.0,
            "kind": "straggler",
            "instance": "worker-0",
            "detail": "...",
            "holder_records_per_s": 40.0,
            "idle_records_per_s": 390.5,
            "holder_s": 9.6,
            "records": 320,
        }
    ]
    assert markers({"events": events}) == [
        (7.0, "#ff7f0e", "worker-0 straggler (40 against 390.5 records/s): 320 records re-leased")
    ]


def test_an_allreduce_straggler_left_out_of_the_ring_is_marked_with_its_paces_in_the_same_style():
    ring = {"t": 9.0, "kind": "straggler", "instance": "worker-0", "step_s": 0.42, "others_step_s": 0.04}
    events = [ring | {"action": "left out of the ring, replaced"}, ring | {"t": 30.0, "action": "left out for good"}]
    assert markers({"events": events}) == [
        (9.0, "#ff7f0e", "worker-0 straggler (0.42 against 0.04 s a step): left out of the ring, replaced"),
        (30.0, "#ff7f0e", "worker-0 straggler (0.42 against 0.04 s a step): left out for good"),
    ]


def test_throughput_is_the_rate_between_samples():
    assert throughput_series(SUMMARY["timeseries"]) == [(1.0, 120.0), (2.0, 140.0)]
    # without record counts, the sample's own rate
    assert throughput_series([{"t": 1.0, "records_per_s": 5.0}]) == [(1.0, 5.0)]


def test_self_contained_no_network_no_script():
    page = render_report(SUMMARY)
    assert not re.search(r"""(src|href|action|poster|data)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", page)  # only the SVG namespace name
    assert "<script" not in page and "@import" not in page and "url(" not in page and "<link" not in page
    assert "@font-face" not in page


def test_user_text_is_escaped():
    summary = {
        **SUMMARY,
        "job_id": "<script>alert(1)</script>",
        "config": {**SUMMARY["config"], "model_def": '"><img src=x onerror=alert(1)>'},
        "events": [
            {"t": 1.0, "kind": "decision", "instance": "worker-<i>0</i>", "detail": "relaunch: <b>"},
            {"t": 2.0, "kind": "registered", "instance": "worker-<i>0</i>", "detail": ""},
        ],
        "eval": {"<acc>": 0.9},
        "ledger": {"epochs": [{"epoch": "<e>", "records": 1, "committed": 1}]},
        "error": {"kind": "x", "instance": "worker-<1>", "message": "bad <input>", "traceback": "<tb>"},
    }
    page = render_report(summary)
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert "<img" not in page and "<i>" not in page and "<acc>" not in page and "<e>" not in page
    assert "<input>" not in page and "<tb>" not in page and "worker-<1>" not in page
    assert "worker-&lt;i&gt;0&lt;/i&gt; ended, relaunched" in page
    assert "worker-&lt;i&gt;0&lt;/i&gt; rejoined" in page
    assert parse(page).errors == []


def test_a_failed_job_without_progress_still_renders():
    page = render_report(
        {
            "status": "failed",
            "error": {
                "kind": "model_error",
                "instance": "worker-1",
                "message": "feed() raised <ValueError>",
                "traceback": "Traceback ...\nValueError",
            },
        }
    )
    assert 'class="error"' in page and "feed() raised &lt;ValueError&gt;" in page and "Traceback ..." in page
    assert page.count("no data") == 4 and "no epoch was committed" in page
    assert "No epoch was committed" in page
    assert parse(page).errors == []


def test_the_epoch_a_failed_job_stopped_in_is_incomplete_not_inexact():
    rows = [
        {"epoch": 0, "records": 100, "committed": 100, "lost": 0, "double_applied": 0},
        {"epoch": 1, "records": 100, "committed": 40, "lost": 60, "double_applied": 0},
    ]
    page = render_report({**SUMMARY, "status": "failed", "ledger": {"epochs": rows}})
    assert "NOT exact" not in page and "incomplete" in page and "the job stopped in epoch 1" in page
    # the same ledger from a job that claims success is wrong
    page = render_report({**SUMMARY, "ledger": {"epochs": rows}})
    assert '<tr class="bad">' in page and "1 of 2 epochs NOT exact" in page


def test_a_ledger_with_double_applied_records_is_flagged():
    row = {"epoch": 0, "records": 100, "committed": 100, "lost": 0, "double_applied": 3}
    assert epoch_state(row, finished=True) == epoch_state(row, finished=False) == "NOT exact"
    page = render_report({**SUMMARY, "ledger": {"epochs": [row]}})
    assert '<tr class="bad">' in page and "applied twice" in page


def test_empty_and_degenerate_summaries_render():
    for summary in (
        {},
        {"status": "running"},
        {"timeseries": [{"t": 0.0, "records": 0, "loss": 1.0}]},
        {"timeseries": [], "events": [], "workers_alive": [{"t": 0, "alive": 0}]},
        {"eval": {"accuracy": 0.5}},  # a final evaluation and nothing else: one dot
        {"ledger": {"epochs": [{"epoch": 0, "records": 0, "committed": 0}]}},
        {
            "timeseries": [{"t": 1.0, "loss": float("nan"), "records": float("inf")}],
            "throughput_records_per_s": float("nan"),
            "eval": {"loss": float("nan")},
        },
    ):
        page = render_report(summary)
        assert parse(page).errors == [], summary
        assert "nan" not in page.lower().replace("nanosec", ""), summary
        for chart in CHART_IDS:
            assert f'id="{chart}"' in page


def test_long_jobs_use_minutes_or_hours_on_the_time_axis():
    hours = {"timeseries": [{"t": 0.0, "records": 0}, {"t": 5 * 3600.0, "records": 10**7}]}
    assert "hours since the step started" in render_report(hours)
    minutes = {"timeseries": [{"t": 0.0, "records": 0}, {"t": 1800.0, "records": 10**6}]}
    assert "minutes since the step started" in render_report(minutes)


def test_nice_ticks():
    assert nice_ticks(0, 1) == [0, 0.25, 0.5, 0.75, 1.0]
    assert nice_ticks(0, 8000) == [0, 2000, 4000, 6000, 8000]
    assert nice_ticks(0, 12.3, 8) == [0, 2, 4, 6, 8, 10, 12]
    # Ranges whose width overflows or underflows a float get one tick, not a crash.
    assert nice_ticks(-1.7e308, 1.7e308) == [-1.7e308]
    assert nice_ticks(0.0, 5e-324) == [0.0]
    assert nice_ticks(3, 3) == [3]


def test_write_report_is_atomic_and_complete(tmp_path):
    path = tmp_path / "out" / "report.html"
    write_report(SUMMARY, str(path))
    assert path.read_text() == render_report(SUMMARY)
    assert [p.name for p in path.parent.iterdir()] == ["report.html"]  # no temporary file left


def test_the_real_sample_summary_renders():
    """A summary written by a real job with a killed worker (the shape job.py writes)."""
    real = json.loads(json.dumps(SUMMARY))
    real["events"] += [
        {"t": 3.0, "kind": "epoch_end", "instance": "", "detail": "epoch 1 committed 100 records"},
        {"t": 3.1, "kind": "exited", "instance": "worker-1", "detail": "exit 0"},
    ]
    page = render_report(real)
    assert "worker-1 exited" not in page  # workers ending after training are not marked


JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
ROW = st.fixed_dictionaries(
    {},
    optional={
        k: JUNK | st.floats(-1e6, 1e6)
        for k in (
            "t",
            "epoch",
            "records",
            "records_per_s",
            "loss",
            "alive",
            "committed",
            "lost",
            "double_applied",
            "requeued",
            "accuracy",
            "kind",
            "instance",
            "detail",
        )
    },
)


@settings(max_examples=150, deadline=None)
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "status": JUNK,
            "job_id": JUNK,
            "error": JUNK,
            "eval": JUNK | st.dictionaries(st.text(max_size=5), JUNK),
            "throughput_records_per_s": JUNK,
            "timeseries": st.lists(ROW, max_size=6) | JUNK,
            "workers_alive": st.lists(ROW, max_size=6),
            "events": st.lists(ROW, max_size=6),
            "eval_history": st.lists(ROW, max_size=4),
            "ledger": st.fixed_dictionaries({}, optional={"epochs": st.lists(ROW, max_size=4)}) | JUNK,
            "workers": JUNK,
            "recovery": JUNK,
            "config": JUNK,
            "ps": st.lists(ROW, max_size=2) | JUNK,
        },
    )
)
def test_any_summary_renders(summary):
    page = render_report(summary)
    assert page.startswith("<!DOCTYPE html>") and parse(page).errors == []


def audited(verdict: str, **counts: int) -> dict:
    """SUMMARY with a PS audit (2 shards) of one epoch of 80 records, whose `counts` are given."""
    epoch = {"epoch": 0, "records": 80, "never": 0, "more_than_once": 0, "shards_disagree": 0, **counts}
    audit = {"source": "ps", "verdict": verdict, "holders": 2, "where": "on all 2 PS shard(s)"}
    return {**SUMMARY, "audit": {**audit, "records_outside_the_data": 0, "epochs": [epoch]}}


def test_the_audit_is_shown_and_a_violation_stands_out():
    html = render_report(audited("exact", applied_once=80))
    assert (
        "<b>Exact</b>: every record of all 1 epochs was applied exactly once, on all 2 PS shard(s)" in html
        and 'id="audit"' in html
    )
    html = render_report(audited("violated", applied_once=70, never=4, more_than_once=6))
    assert (
        '<b class="bad">VIOLATED</b>' in html
        and '<tr class="bad"><td>0</td><td>80</td><td>70</td><td>4</td><td>6</td>' in html
    )


def test_the_goodput_chart_splits_wall_time_and_worker_seconds_by_cause():
    goodput = {
        "ratio": 0.6,
        "worker_ratio": 0.5,
        "wall_s": {"training": 60.0, "startup": 30.0, "rewind": 10.0, "checkpoint": 0.0},
        "worker_s": {"training": 100.0, "startup": 60.0, "waiting": 40.0},
    }
    page = render_report({"goodput": goodput})
    chart = re.search(r'<svg id="chart-goodput".*?</svg>', page, re.S).group(0)
    assert "60 %" in chart and "50 %" in chart
    assert chart.count("<rect") == 6  # three parts of wall time, three of worker-seconds, none of 0 s
    assert "trained again after a loss: 10 s" in chart and "checkpoint holds" not in chart
    assert "no goodput recorded" in render_report({})


def test_early_stopping_says_which_epochs_weights_the_model_holds_and_why_training_ended():
    stop = {
        "best_epoch": 3,
        "stopped_epoch": 5,
        "reason": "loss did not improve by more than 0 for 2 epoch(s) after epoch 4",
    }
    text = " ".join(parse(render_report({**SUMMARY, "early_stop": stop})).texts)
    assert "early stopping" in text and "epoch 4's weights" in text and "did not improve" in text
    assert "early stopping" not in " ".join(parse(render_report(SUMMARY)).texts)
