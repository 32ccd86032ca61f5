"""bench/master_capacity.py's smoke: a few simulated workers against the real gRPC master, so that the bench keeps
up with the master it measures."""

from __future__ import annotations

import json

from bench import master_capacity


def test_the_capacity_bench_commits_every_record_once_through_the_real_master(tmp_path, capsys):
    out = tmp_path / "figures.json"
    args = ["--workers", "40", "--records", "40000", "--window", "20", "--baseline-s", "0.2", "--json", str(out)]
    assert master_capacity.main(args) == 0
    (run,) = json.loads(out.read_text())
    grpc = run["grpc"]
    assert grpc["finished"] and grpc["exactly_once"] and grpc["errors"] == 0, grpc
    assert grpc["records_committed"] == 40000
    assert "gRPC        W=40" in capsys.readouterr().out


def test_an_earlier_revision_gets_the_run_s_arguments_but_its_own_workers_and_figures_file():
    argv = ["--workers", "10", "20", "--think-ms", "100", "--json=a.json", "--before", "abc123", "--unary"]
    assert master_capacity.forwarded(argv) == ["--think-ms", "100", "--unary"]
