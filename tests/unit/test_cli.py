"""The CLI's --prepared: the one folder data prep wrote stands for its train and eval manifests."""

import pytest

from elastic_step.cli import _prepared, build_parser
from elastic_step.errors import ConfigError


def test_prepared_stands_for_its_train_and_eval_folders_unless_given():
    args = build_parser().parse_args(["train", "--model-def", "m", "--output", "o", "--prepared", "gs://b/prep/"])
    _prepared(args, "train", "eval")
    assert (args.train_data, args.eval_data) == ("gs://b/prep/train", "gs://b/prep/eval")
    args = build_parser().parse_args(
        ["train", "--model-def", "m", "--output", "o", "--prepared", "/p", "--eval-data", "/other/eval"]
    )
    _prepared(args, "train", "eval")
    assert (args.train_data, args.eval_data) == ("/p/train", "/other/eval")
    args = build_parser().parse_args(["evaluate", "--model", "m", "--model-def", "d", "--prepared", "/p"])
    _prepared(args, "eval")
    assert args.eval_data == "/p/eval"


@pytest.mark.parametrize(
    "argv, names",
    [
        (["train", "--model-def", "m", "--output", "o"], ("train", "eval")),
        (["evaluate", "--model", "m", "--model-def", "d"], ("eval",)),
    ],
)
def test_no_data_at_all_is_a_clear_error(argv, names):
    with pytest.raises(ConfigError, match="--prepared"):
        _prepared(build_parser().parse_args(argv), *names)
