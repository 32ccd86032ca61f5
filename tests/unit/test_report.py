"""The HTML training report: self-contained, every chart present, user text escaped, and it
renders for a failed job too."""
from __future__ import annotations

import re

from elastic_step.report import render_report

SUMMARY = {
    "status": "succeeded", "job_id": "es-1", "strategy": "ps", "backend": "local",
    "records_per_epoch": 100, "epochs": 2, "throughput_records_per_s": 1234.5,
    "eval": {"loss": 0.1, "accuracy": 0.97},
    "ledger": {"epochs": [{"epoch": 0, "records": 100, "committed": 100, "lost": 0, "double_applied": 0,
                           "requeued": 32},
                          {"epoch": 1, "records": 100, "committed": 100, "lost": 0, "double_applied": 0,
                           "requeued": 0}], "duplicate_pushes_suppressed": 1},
    "workers": {"started": 3, "lost": 1, "relaunched": 1, "max_alive": 2},
    "eval_history": [{"t": 1.2, "epoch": 0, "loss": 0.5, "accuracy": 0.8}],
    "recovery": {"requeue_latency_s": [0.012]},
    "timeseries": [{"t": 1.0, "epoch": 0, "records": 10, "records_per_s": 100.0, "loss": 2.0, "workers_alive": 2},
                   {"t": 2.0, "epoch": 1, "records": 150, "records_per_s": 140.0, "loss": 0.5,
                    "workers_alive": 1}],
    "workers_alive": [{"t": 0.5, "alive": 1}, {"t": 0.9, "alive": 2}, {"t": 1.5, "alive": 1}, {"t": 2.5, "alive": 2}],
    "events": [{"t": 0.9, "kind": "registered", "instance": "worker-0", "detail": ""},
               {"t": 1.5, "kind": "lost", "instance": "worker-0", "detail": "killed by SIGKILL"},
               {"t": 1.5, "kind": "decision", "instance": "worker-0", "detail": "relaunch: worker-0 <b>killed</b>"},
               {"t": 2.5, "kind": "registered", "instance": "worker-0", "detail": ""}],
}


def test_all_charts_and_the_ledger_are_there():
    page = render_report(SUMMARY)
    for chart in ("chart-loss", "chart-eval", "chart-throughput", "chart-workers"):
        assert re.search(rf'<svg id="{chart}"[^>]*>.*?<polyline', page, re.S), chart
    assert page.count("<tr class=\"ok\">") == 2
    assert "worker-0 lost" in page and "worker-0 rejoined" in page
    assert "0.9700" in page and "1234 records/s" in page


def test_self_contained_no_network_no_script():
    page = render_report(SUMMARY)
    assert not re.search(r'(src|href)\s*=\s*"(https?:)?//', page)
    assert "<script" not in page and "@import" not in page and "url(" not in page


def test_user_text_is_escaped():
    summary = {**SUMMARY, "job_id": "<script>alert(1)</script>",
               "events": [{"t": 1.0, "kind": "decision", "instance": "worker-<i>0</i>", "detail": "relaunch"}]}
    page = render_report(summary)
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert "worker-&lt;i&gt;0&lt;/i&gt; lost" in page


def test_a_failed_job_without_progress_still_renders():
    page = render_report({"status": "failed", "error": {"message": "feed() raised <ValueError>"}})
    assert "feed() raised &lt;ValueError&gt;" in page
    assert page.count("no data") == 4
    assert "No epoch was committed" in page


def test_a_ledger_that_is_not_exact_is_flagged():
    summary = {**SUMMARY, "ledger": {"epochs": [{"epoch": 0, "records": 100, "committed": 99, "lost": 1,
                                                 "double_applied": 0}]}}
    assert '<tr class="bad">' in render_report(summary) and "NOT exact" in render_report(summary)
