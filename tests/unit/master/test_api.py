import pytest

from elastic_step.errors import ConfigError
from elastic_step.master.api import TrainConfig


def config(**kw) -> TrainConfig:
    return TrainConfig(model_def="m.py", train_data="t", eval_data=None, output="o", **kw)


def test_one_push_in_flight_unless_the_user_opts_into_more():
    assert config().validate().pushes_in_flight == 1
    assert config(pushes_in_flight=2).validate().pushes_in_flight == 2


@pytest.mark.parametrize(
    "depth, says", [(0, "--pushes-in-flight must be >= 1"), (9, "--pushes-in-flight 9 is more than 4")]
)
def test_pushes_in_flight_out_of_range_is_a_clear_error(depth, says):
    with pytest.raises(ConfigError, match=says):
        config(pushes_in_flight=depth).validate()


def test_minibatches_per_push_is_one_unless_asked_and_only_for_the_ps_strategy():
    assert config().validate().minibatches_per_push == 1
    assert config(minibatches_per_push=8).validate().minibatches_per_push == 8
    with pytest.raises(ConfigError, match="--minibatches-per-push must be >= 1"):
        config(minibatches_per_push=0).validate()
    with pytest.raises(
        ConfigError, match="--minibatches-per-push 4 is for --strategy ps; with allreduce, --global-batch fixed"
    ):
        config(minibatches_per_push=4, strategy="allreduce").validate()


def test_records_per_task_is_sized_from_the_data_unless_given():
    assert config().validate().records_per_task == 0
    with pytest.raises(ConfigError, match=r"--records-per-task must be >= 0 \(0: 32 minibatches a task"):
        config(records_per_task=-1).validate()


@pytest.mark.parametrize("port", [-2, 65536])
def test_a_health_port_that_is_no_port_is_a_clear_error(port):
    assert config().validate().health_port == -1  # 8080 in a pod, none elsewhere
    with pytest.raises(ConfigError, match=f"--health-port must be a TCP port, 0 .* or -1 .*, got {port}"):
        config(health_port=port).validate()
