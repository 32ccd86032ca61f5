from elastic_step.master.pace import Pace


def test_a_recovery_figure_is_closed_by_the_next_commit_alone():
    pace = Pace()
    restart, restore = {"from_checkpoint": 3}, {"ps": 0}
    pace.until_next_commit(restart, "start_to_first_commit_s", 10.0)
    pace.until_next_commit(restore, "loss_to_first_commit_s", 11.5)
    pace.committed(12.25, 0.5, 64)
    assert restart == {"from_checkpoint": 3, "start_to_first_commit_s": 2.25}
    assert restore == {"ps": 0, "loss_to_first_commit_s": 0.75}
    pace.committed(20.0, 0.5, 128)  # a later commit leaves them as the first one closed them
    assert restart["start_to_first_commit_s"] == 2.25 and restore["loss_to_first_commit_s"] == 0.75
