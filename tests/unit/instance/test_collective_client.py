"""The master's pull of an allreduce member's state at a step it committed: the master commits a run before the
member hears of it, and the member serves the state before the run until it does. An epoch's evaluation (and with
early stopping, the best epoch's weights, which become the job's model) must be of the epoch's end."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from elastic_step.instance.collective_client import pull_state_since
from elastic_step.worker.allreduce import collective
from tests.unit.worker.allreduce.test_trainer import trainer

TOKEN = "test-token"


@pytest.fixture
def member(tmp_path):
    """A member's trainer and the Collective service that serves its state, at step 0; and a witness trainer that
    applied and committed nothing."""
    t, witness = trainer(tmp_path, 3), trainer(tmp_path, 3)
    witness.load_state(*t.state())
    state = collective.StateProvider(t.state)
    state.set_applied(0)
    server, port = collective.serve(collective.CollectiveService(TOKEN, state, 0), "127.0.0.1")
    yield t, witness, state, f"127.0.0.1:{port}"
    server.stop(grace=0)
    with state.cv:  # a pull still waiting for a step sees its call is over
        state.cv.notify_all()


def committed(t, state: collective.StateProvider, step: int) -> None:
    """The member hears of the master's commit of its run: as member.py commits it."""
    with state.cv:
        t.commit()
        state.applied_step = step
        state.cv.notify_all()


def test_a_pull_of_a_committed_step_is_that_steps_state_even_before_the_member_hears_of_the_commit(member):
    t, witness, state, address = member
    mean = np.linspace(-1, 1, t.size).astype(np.float32)
    for trained in (t, witness):
        trained.apply(mean, 1.0)  # step 1: the run the master committed
    witness.commit()
    # The master's answer is on its way: the member still serves the state before the run.
    hears = threading.Timer(0.3, committed, (t, state, 1))
    hears.start()
    try:
        pulled = pull_state_since(address, TOKEN, 1, timeout=30)
    finally:
        hears.join()
    assert pulled.step == 1
    for value, expected in zip(pulled.values, witness.state()[1]):
        np.testing.assert_array_equal(value, expected)


def test_a_member_past_the_committed_step_gives_its_later_state_and_one_short_of_it_no_state(member):
    t, _, state, address = member
    for step in (1, 2):
        t.apply(np.full(t.size, 0.1 * step, np.float32), 1.0)
        committed(t, state, step)
    pulled = pull_state_since(address, TOKEN, 1, timeout=30)
    assert pulled.step == 2
    for value, expected in zip(pulled.values, t.state()[1]):
        np.testing.assert_array_equal(value, expected)
    with pytest.raises(grpc.RpcError) as raised:  # never step 2's state for step 3's
        pull_state_since(address, TOKEN, 3, timeout=0.5)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
