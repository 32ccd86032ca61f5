"""kfp.local evaluates the pipeline's gate (`dsl.If` on a NamedTuple output) once
elastic_step.pipelines.kfp_local_compat is installed: the branch runs when the condition holds and
is skipped when it does not. Tiny real components through the real SubprocessRunner (seconds).

No `from __future__ import annotations`: KFP reads the real types."""

import json
import pathlib
from typing import NamedTuple

from kfp import dsl, local
from kfp.dsl import Input, Model, Output

from elastic_step.pipelines import kfp_local_compat


@dsl.component(base_image="python:3.11", install_kfp_package=False)
def make_model(model: Output[Model]):
    with open(model.path, "w") as f:
        f.write("weights")


@dsl.component(base_image="python:3.11", install_kfp_package=False)
def judge(score: float, threshold: float) -> NamedTuple("Judged", [("score", float), ("passed", bool)]):
    return score, score >= threshold


@dsl.component(base_image="python:3.11", install_kfp_package=False)
def ship(model: Input[Model], to: str) -> str:
    return to


@dsl.pipeline(name="gate")
def gated(score: float, threshold: float, to: str):
    m = make_model()
    j = judge(score=score, threshold=threshold)
    with dsl.If(j.outputs["passed"] == True, name="passed"):  # noqa: E712
        ship(model=m.outputs["model"], to=to)


def ran(root: pathlib.Path) -> dict[str, dict]:
    (run,) = [p for p in root.iterdir() if p.is_dir()]
    return {t.name: json.loads((t / "executor_output.json").read_text()) for t in run.iterdir()}


def test_the_gate_takes_and_skips_the_branch_under_kfp_local(tmp_path):
    assert kfp_local_compat.install() and kfp_local_compat.install()  # idempotent
    for score, expect in ((0.95, True), (0.5, False)):
        root = tmp_path / str(score)
        local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root), raise_on_error=True)
        gated(score=score, threshold=0.9, to="dest")
        tasks = ran(root)
        assert tasks["judge"]["parameterValues"]["passed"] is expect
        assert ("ship" in tasks) is expect
        if expect:
            assert tasks["ship"]["parameterValues"]["Output"] == "dest"


def test_other_channels_still_resolve_through_kfp():
    """Pipeline parameters (no '-' in their names) and unknown tasks fall through to kfp's resolver."""
    from kfp.local import io

    store = io.IOStore()
    store.put_parent_input("threshold", 0.9)
    store.put_task_output("evaluate-op", "passed", True)
    resolve = kfp_local_compat.resolve_named_task_output
    assert resolve("pipelinechannel--evaluate-op-passed", store) is True
    for ref in ("pipelinechannel--threshold", "pipelinechannel--other-op-passed"):
        try:
            resolve(ref, store)
        except LookupError:
            pass
        else:
            raise AssertionError(ref)
    kfp_local_compat.install()
    from kfp.local.orchestrator.enhanced_dag_orchestrator import ConditionEvaluator

    assert (
        ConditionEvaluator.evaluate_condition("inputs.parameter_values['pipelinechannel--threshold'] > 0.5", store)
        is True
    )
    assert (
        ConditionEvaluator.evaluate_condition(
            "inputs.parameter_values['pipelinechannel--evaluate-op-passed'] == true", store
        )
        is True
    )
