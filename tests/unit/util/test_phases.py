import json

from elastic_step.util.phases import Clock


def test_phases_add_up_per_name_and_are_written_at_the_end(tmp_path):
    clock = Clock(str(tmp_path / "profile"))
    for _ in range(3):
        with clock.phase("compute"):
            pass
    clock.add("push", 0.25)
    clock.dump("worker-0")
    written = json.loads((tmp_path / "profile" / "worker-0.json").read_text())
    assert written["compute"]["n"] == 3 and written["compute"]["s"] >= 0
    assert written["push"] == {"s": 0.25, "n": 1}


def test_off_nothing_is_counted_or_written(tmp_path):
    clock = Clock(None)
    with clock.phase("compute"):
        pass
    clock.dump("worker-0")
    assert clock.seconds == {} and list(tmp_path.iterdir()) == []


def test_an_error_inside_a_phase_is_timed_and_raised():
    clock = Clock("unused")
    try:
        with clock.phase("compute"):
            raise KeyError("boom")
    except KeyError:
        pass
    assert clock.counts == {"compute": 1}


def test_a_span_adds_the_process_cpu_beside_its_wall_time(tmp_path):
    clock = Clock(str(tmp_path))
    with clock.span("training"):
        sum(i * i for i in range(200_000))  # some CPU
    assert clock.counts == {"training": 1, "training: CPU of the process": 1}
    assert clock.seconds["training: CPU of the process"] > 0
