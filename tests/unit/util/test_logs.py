"""--log-format json: a line a record, with the job, the role and the event's kind."""

from __future__ import annotations

import json
import logging

from elastic_step.util.logs import JsonLines


def test_a_json_line_names_the_job_the_role_and_the_event():
    formatter = JsonLines("train-1", "worker-3")
    record = logging.LogRecord("elastic_step.master", logging.WARNING, __file__, 1, "%s hung", ("worker-1",), None)
    record.event = "hung"
    line = formatter.format(record)
    assert "\n" not in line
    parsed = json.loads(line)
    assert {k: parsed[k] for k in ("job", "role", "event", "level", "message")} == {
        "job": "train-1",
        "role": "worker-3",
        "event": "hung",
        "level": "WARNING",
        "message": "worker-1 hung",
    }
    plain = logging.LogRecord("x", logging.INFO, __file__, 1, "two\nlines", (), None)
    assert json.loads(formatter.format(plain))["event"] == "" and "\n" not in formatter.format(plain)
