"""A user-facing error also goes where Kubernetes reads a container's termination message."""

from elastic_step.cli import main
from elastic_step.errors import write_termination_message


def test_the_message_goes_to_the_termination_log_when_the_container_has_one(tmp_path):
    log = tmp_path / "termination-log"
    log.write_text("")
    write_termination_message("the cause and the fix", str(log))
    assert log.read_text() == "the cause and the fix"
    write_termination_message("x" * 5000, str(log))  # Kubernetes keeps 4096 bytes
    assert len(log.read_bytes()) == 4096


def test_nothing_is_written_outside_a_container(tmp_path):
    write_termination_message("no container here", str(tmp_path / "termination-log"))
    assert not (tmp_path / "termination-log").exists()


def test_the_cli_leaves_its_error_there(tmp_path, monkeypatch):
    log = tmp_path / "termination-log"
    log.write_text("")
    monkeypatch.setattr("elastic_step.errors.TERMINATION_LOG", str(log))
    code = main(
        [
            "evaluate",
            "--model",
            str(tmp_path / "no-model"),
            "--eval-data",
            str(tmp_path / "no-data"),
            "--model-def",
            str(tmp_path / "model.py"),
        ]
    )
    assert code == 2
    assert str(tmp_path / "model.py") in log.read_text() and "does not exist" in log.read_text()
