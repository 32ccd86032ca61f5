"""bench/cluster_sim.py's invariants: a lone job takes its analytic time on every side, work is conserved under
churn, a gang job restarts whole, and the simulator reproduces bench/gang.py's measured two jobs within its bound."""

from __future__ import annotations

import dataclasses

import pytest

from bench.cluster_sim import SIDES, VALIDATION_BOUND, Costs, Job, Mix, job_mix, reclaim_trace, simulate, validate

CALM = Mix(reclaim_mtbf_h=0)


@pytest.mark.parametrize("side", SIDES)
def test_a_lone_job_without_churn_takes_its_start_up_and_its_work_over_its_workers(side):
    costs = Costs()
    r = simulate(side, 1, [Job(0, 0.0, 4, 1000.0)], costs, CALM)
    assert r["makespan_s"] == pytest.approx(costs.job_start_s + 1000.0 / 4)
    assert r["lost"] == 0
    assert r["trained"] == pytest.approx(1000.0)


def test_throughput_at_k_workers_follows_the_scaling_exponent():
    costs = Costs(scaling=0.5)
    r = simulate("gang", 1, [Job(0, 0.0, 4, 1000.0)], costs, CALM)
    assert r["makespan_s"] == pytest.approx(costs.job_start_s + 1000.0 / 4**0.5)


@pytest.mark.parametrize("side", SIDES)
def test_under_reclaims_and_preemption_every_worker_second_trained_is_kept_or_counted_lost(side):
    mix = Mix(reclaim_mtbf_h=1.0, high_fraction=0.3)
    jobs = job_mix(4, mix, seed=1)
    r = simulate(side, 4, jobs, Costs(), mix, reclaim_trace(4, mix, 1, horizon=1e6))
    assert r["trained"] == pytest.approx(r["useful"] + r["lost"], rel=1e-9)
    assert r["useful"] == pytest.approx(sum(j.work for j in jobs))
    assert r["lost"] > 0
    assert 0 < r["goodput"] < 1
    assert r["utilization_makespan"] <= r["allocation"]


def test_a_lost_gang_worker_restarts_the_whole_job_from_its_checkpoint_and_an_elastic_one_does_not():
    costs = Costs(ckpt_interval_s=100.0)
    mix = Mix(slots_per_node=2, reclaim_mtbf_h=0, node_down_s=10.0)
    job = Job(0, 0.0, 4, 4000.0)  # 2 nodes of 2 slots; node 1 reclaimed 250 s into training
    reclaim = [(costs.job_start_s + 250.0, 1)]
    gang = simulate("gang", 2, [job], costs, mix, reclaim)
    # 4 workers x 50 s trained since the checkpoint at 200 s are lost; the job waits for the node, starts again
    assert gang["lost"] == pytest.approx(4 * 50.0)
    assert gang["restarts"] == 1
    assert gang["makespan_s"] == pytest.approx(costs.job_start_s + 250.0 + 10.0 + costs.job_start_s + 3200.0 / 4)
    elastic = simulate("elastic", 2, [job], costs, mix, reclaim)
    assert elastic["lost"] == pytest.approx(2 * costs.inflight_s)
    assert elastic["restarts"] == 0
    assert elastic["makespan_s"] < gang["makespan_s"]


def test_the_same_trace_without_contention_or_churn_ends_alike_on_every_side():
    jobs = [Job(i, 100.0 * i, 2, 500.0, queued_at=100.0 * i) for i in range(5)]
    ends = {side: simulate(side, 1, jobs, Costs(), CALM)["job_ends"] for side in SIDES}
    assert ends["elastic"] == pytest.approx(ends["gang"]) and ends["gang"] == pytest.approx(ends["kueue"])


def test_kueue_admits_strictly_in_order_where_gang_lets_a_small_job_pass():
    costs = Costs()
    jobs = [Job(0, 0.0, 6, 6000.0), Job(1, 1.0, 8, 800.0, queued_at=1.0), Job(2, 2.0, 2, 200.0, queued_at=2.0)]
    gang = simulate("gang", 1, jobs, costs, CALM)["job_ends"]
    kueue = simulate("kueue", 1, jobs, costs, CALM)["job_ends"]
    assert gang[2] < gang[0]  # the small job ran beside the first on the 2 free slots
    assert kueue[2] > kueue[1]  # it waited behind the 8-worker job


def test_the_simulator_reproduces_bench_gangs_two_jobs_within_its_bound():
    v = validate()
    assert abs(v["ratio"]["error"]) <= VALIDATION_BOUND
    for side, error in v["error"].items():
        assert abs(error) <= VALIDATION_BOUND, side


def test_a_job_wider_than_the_cluster_is_refused_naming_it():
    with pytest.raises(ValueError, match="job 7 wants 1-9 workers on 8 slots"):
        simulate("gang", 1, [Job(7, 0.0, 9, 10.0)], Costs(), CALM)
    with pytest.raises(ValueError, match="side 'slurm'"):
        simulate("slurm", 1, [Job(0, 0.0, 1, 10.0)], Costs(), CALM)


def test_a_seed_draws_the_same_trace():
    a, b = job_mix(10, CALM, seed=3), job_mix(10, CALM, seed=3)
    assert [dataclasses.astuple(j) for j in a] == [dataclasses.astuple(j) for j in b]
    assert [j.arrival for j in a] != [j.arrival for j in job_mix(10, CALM, seed=4)]
