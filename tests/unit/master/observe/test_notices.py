"""What the master tells the platform from its timeline: the entries a platform acts on, each once, in order."""

from __future__ import annotations

from elastic_step.master.observe.notices import Notices


def test_the_timeline_entries_a_platform_acts_on_are_told_once_in_order():
    timeline: list[dict] = []
    told: list[tuple] = []
    notices = Notices(lambda reason, note, action, warning: told.append((reason, note, action, warning)), timeline)
    timeline += [
        {"kind": "registered", "instance": "worker-0", "detail": "127.0.0.1:1"},  # not the platform's business
        {"kind": "lost", "instance": "worker-1", "detail": "preempted by Kueue (pod j-worker-1): Preempted"},
        {
            "kind": "decision",
            "instance": "worker-1",
            "detail": "relaunch: worker-1 preempted by Kueue (pod j-worker-1): Preempted before training finished",
            "cause": "kueue",
        },
        {"kind": "hung", "instance": "worker-2", "detail": "idle 12 s, bound 6 s: declared hung, stopped and replaced"},
        {"kind": "fenced", "instance": "worker-2", "detail": "launch 1: declared hung"},
    ]
    notices.tick()
    notices.tick()  # nothing new: nothing told again
    timeline += [
        {"kind": "straggler", "instance": "worker-0", "detail": "a tail re-leased to worker-3"},
        {"kind": "straggler", "instance": "worker-4", "detail": "3x: left out", "action": "left out of the ring"},
        {"kind": "rewound", "instance": "ps-0", "detail": "to checkpoint 2: 640 records to train again"},
        {"kind": "decision", "instance": "ps-0", "detail": "restore: parameter server ps-0 was lost"},
    ]
    notices.finished("12000 records committed")
    assert [(r, a, w) for r, _, a, w in told] == [
        ("WorkerLost", "Relaunch", True),
        ("WorkerHung", "Fence", True),
        ("WorkerFenced", "Fence", True),
        ("StragglerHandedOver", "HandOver", False),
        ("StragglerLeftOut", "LeaveOut", True),
        ("ParameterServerRestored", "Restore", True),
        ("ParameterServerLost", "Restore", True),
        ("TrainingFinished", "Finish", False),
    ]
    assert (
        told[0][1] == "worker-1 lost (kueue): worker-1 preempted by Kueue (pod j-worker-1): Preempted before "
        "training finished"
    )  # the cause, and Kueue's reason as the backend saw it
