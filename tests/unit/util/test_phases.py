import json
import threading
import time

from elastic_step.util.phases import Clock
from elastic_step.util.process import own_threads


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


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_phase_counts_its_threads_cpu_and_the_dump_each_threads_by_name(tmp_path):
    clock = Clock(str(tmp_path))
    with clock.phase("compute"):
        _burn(0.05)
    with clock.phase("wait"):
        time.sleep(0.05)
    assert clock.cpu["compute"] >= 0.05 and clock.cpu["wait"] < 0.01 < clock.seconds["wait"]
    done = threading.Event()
    burner = threading.Thread(target=lambda: (_burn(0.2), done.wait()))
    burner.start()
    deadline = time.monotonic() + 30
    try:
        while burner.native_id is None or not any(t.tid == burner.native_id and t.cpu_s >= 0.15 for t in own_threads()):
            assert time.monotonic() < deadline, "the kernel never counted the burner's CPU"
            time.sleep(0.01)  # the kernel's account of the thread we made burn 0.2 s (in whole clock ticks)
        threads = own_threads()
        assert {t.tid for t in threads} >= {t.native_id for t in threading.enumerate()}
        clock.dump("worker-0")
    finally:
        done.set()
        burner.join()
    written = json.loads((tmp_path / "worker-0.json").read_text())
    assert written["compute"]["cpu"] >= 0.05
    named = {k: v for k, v in written.items() if k.startswith("CPU of its threads named")}
    assert sum(v["n"] for v in named.values()) == len(threads)
    assert sum(v["s"] for v in named.values()) >= 0.15  # the burner's, at least
