"""The job spec is the one declaration of every parameter: TrainConfig, the KFP signatures (which KFP reads
literally, so they are written out) and the CLI agree with it, each parameter has one default, and the
checkpoint location one name and one layout.

No `from __future__ import annotations`: the KFP signatures are read with their real types."""

import dataclasses
import inspect
import pathlib
import re
import typing

import pytest

from elastic_step import components, spec
from elastic_step.cli import build_parser
from elastic_step.master.api import TrainConfig
from elastic_step.master.plan import checkpoint_root

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOT_IN_SPEC = {"chaos"}  # fault injection's, not a parameter of the job


def _type(annotation):
    """str | None -> str: the spec's type of an optional field."""
    if isinstance(annotation, str):
        annotation = eval(annotation, vars(typing))  # TrainConfig's module uses postponed annotations
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


def test_train_config_fields_are_the_spec_training_parameters():
    fields = {f.name: f for f in dataclasses.fields(TrainConfig) if f.name not in NOT_IN_SPEC}
    assert set(fields) == {p.name for p in spec.params(spec.CONFIG)}
    for name, f in fields.items():
        p = spec.BY_NAME[name]
        default = spec.REQUIRED if f.default is dataclasses.MISSING else f.default
        assert (default, _type(f.type)) == (p.default, p.type), name


def test_train_config_is_immutable():
    cfg = TrainConfig(model_def="m.py", train_data="t", output="o")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.backend = "local"


def test_what_train_takes_is_configuration():
    assert {p.name for p in spec.params(spec.TRAIN)} <= {p.name for p in spec.params(spec.CONFIG)}


def _kfp_signatures() -> dict[str, tuple[str, inspect.Signature]]:
    """component or pipeline -> (its step, or None for the pipeline; its Python signature)."""
    import elastic_step.components as components
    from elastic_step.pipelines.compile import COMPONENTS
    from elastic_step.pipelines.train_eval import train_eval

    out = {
        attr: (step, inspect.signature(getattr(components, attr).python_func))
        for step, stems in COMPONENTS.items()
        for attr in stems.values()
    }
    out["train_eval"] = (None, inspect.signature(train_eval.pipeline_func))
    return out


# The KFP signatures' own arguments: data as URIs (the *_uri variants, for the UI) and the job id's sources.
KFP_ONLY = {"train_uri", "eval_uri", "model_uri", "pipeline_run_id", "pipeline_task_name", "publish_uri"}
# What KFP itself fills in, never a user: the training task's settings (dsl.TaskConfig), on elastic_train_op.
KFP_FILLED = {"task_config"}


@pytest.mark.parametrize("name", [*(n for n in components.__all__ if n.endswith("_op")), "train_eval"])
def test_kfp_signatures_are_the_spec(name):
    step, sig = _kfp_signatures()[name]
    params = {
        n: p for n, p in sig.parameters.items() if p.annotation in (int, float, str, bool) or n in KFP_FILLED
    }  # artifacts (Input/Output[...]) aside
    expected = spec.params(spec.PIPELINE) if step is None else spec.params(spec.COMPONENT, step)
    assert {p.name for p in expected} <= set(params), "missing in the signature"
    assert set(params) - {p.name for p in expected} <= KFP_ONLY | KFP_FILLED, "not in the spec"
    if name == "elastic_train_op":
        from kfp import dsl

        assert (params["task_config"].annotation, params["task_config"].default) == (dsl.TaskConfig, None)
    for p in expected:
        got = params[p.name]
        default = spec.REQUIRED if got.default is inspect.Parameter.empty else got.default
        assert (got.annotation, default) == (p.type, p.default), (name, p.name)


def _defaults(argv: list[str]) -> dict:
    return vars(build_parser().parse_args(argv))


@pytest.mark.parametrize(
    "surface, argv",
    [
        (spec.PREP, ["data", "prep", "--source", "s", "--output", "o"]),
        (spec.TRAIN, ["train", "--model-def", "m.py", "--output", "o"]),
        (spec.EVAL, ["evaluate", "--model", "m", "--model-def", "m.py", "--prepared", "p"]),
        (spec.RUN, ["pipeline", "run", "--source", "s", "--model-def", "m.py", "--output", "o"]),
        (spec.PIPELINE, ["schedule", "create", "--host", "h", "--cron", "c", "--source", "s", "--model-def", "m.py"]),
    ],
)
def test_the_cli_parsers_take_the_spec_with_its_defaults(surface, argv):
    args = _defaults(argv)
    for p in spec.params(surface):
        if not p.required and p.cli_required is None:
            assert args[p.name] == p.default, p.name


def test_one_default_per_parameter_everywhere():
    """The Argo template's and the v1 components' defaults are rendered from the spec: the same strings."""
    from elastic_step.pipelines import argo
    from elastic_step.pipelines.compile import _v1

    for name, (value, _) in argo.PARAMETERS.items():
        p = spec.BY_NAME[name.replace("-", "_")]
        assert value == (None if p.required else str(p.default)), name
    for component in _v1("image").values():
        for i in component["inputs"]:
            if i["name"] in spec.BY_NAME and "default" in i:
                assert i["default"] == str(spec.BY_NAME[i["name"]].default), i["name"]


def test_one_name_for_the_checkpoint_location():
    """checkpoint_uri / --checkpoint-uri, nowhere another name."""
    stale = []
    for folder in ("elastic_step", "components", "pipelines", "scripts", "tests", "docs"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".yaml", ".md", "") and path != pathlib.Path(__file__):
                text = path.read_text(errors="replace")
                if re.search(r"checkpoint[_-]dir", text):
                    stale.append(str(path.relative_to(ROOT)))
    assert stale == []


@pytest.mark.parametrize(
    "uri, output, expected",
    [
        ("", "/out", "/out/checkpoints/job-1"),
        ("", "gs://b/out/", "gs://b/out/checkpoints/job-1"),
        ("gs://b/ckpt", "/out", "gs://b/ckpt/job-1"),
        ("gs://b/ckpt/", "gs://b/out", "gs://b/ckpt/job-1"),
    ],
)
def test_one_checkpoint_layout(uri, output, expected):
    assert checkpoint_root(uri, output, "job-1") == expected


def test_every_parameter_is_documented_and_on_a_surface():
    for p in spec.PARAMS:
        assert p.help and p.on <= set(spec.SURFACES), p.name
        assert p.type in (int, float, str, bool) and (p.required or p.default is None or isinstance(p.default, p.type))
        assert not p.choices or p.required or p.default in p.choices, p.name
        assert set(p.steps) <= {spec.DATA_PREP, spec.ELASTIC_TRAIN, spec.EVALUATE, spec.PUBLISH_MODEL}


def test_cli_args_spell_the_values_as_the_parsers_read_them():
    argv = spec.cli_args(source_uri="s.csv", model_def="m.py", output="o", epochs=3, eval_fraction=0.5)
    assert argv == [
        "--source",
        "s.csv",
        "--model-def",
        "m.py",
        "--output",
        "o",
        "--epochs",
        "3",
        "--eval-fraction",
        "0.5",
    ]
    args = build_parser().parse_args(["pipeline", "run", *argv])
    assert (args.source_uri, args.epochs, args.eval_fraction) == ("s.csv", 3, 0.5)
