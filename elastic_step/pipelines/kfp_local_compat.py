"""Make kfp.local evaluate `dsl.If` on a named task output, so a local run executes the very
pipeline that is compiled for a cluster (the gate included).

kfp 2.17's local orchestrator evaluates a condition such as
`inputs.parameter_values['pipelinechannel--evaluate-op-passed'] == true` by resolving the channel
name itself. It understands `<task>-Output` (a single return value) and `<task>--<key>`, but the
compiler names a NamedTuple field's channel `<task>-<key>` ("evaluate-op-passed"); that one falls
through to a pipeline-parameter lookup, fails with "Could not resolve parent input", and the
branch is silently skipped. Output keys are Python identifiers (no "-"), so the split at the last
"-" is unambiguous: `<task>` = "evaluate-op", `<key>` = "passed".

`install()` wraps the resolver to try that split first (a pure lookup in the run's IOStore) and
defers to kfp's own resolver for everything else. It is idempotent, only used by
`elastic-step pipeline run`, and does nothing if kfp's internals moved (a test then fails loudly:
tests/pipeline/test_local_gate.py runs the gate both ways).
"""

from __future__ import annotations

_MARK = "_elastic_step_named_output_fix"
PREFIX = "pipelinechannel--"


def resolve_named_task_output(channel_ref: str, io_store):
    """The value of a `<task>-<key>` channel from the IOStore, or raise LookupError."""
    ref = channel_ref[len(PREFIX) :] if channel_ref.startswith(PREFIX) else channel_ref
    task, sep, key = ref.rpartition("-")
    if not sep or not task or not key.isidentifier():
        raise LookupError(channel_ref)
    try:
        return io_store.get_task_output(task, key)
    except ValueError as e:  # the IOStore's "task not found" / "no output named"
        raise LookupError(channel_ref) from e


def install() -> bool:
    """Patch kfp.local's condition resolver (once). Returns whether the patch is in place."""
    try:
        from kfp.local.orchestrator.enhanced_dag_orchestrator import ConditionEvaluator
    except ImportError:
        return False
    original = ConditionEvaluator.__dict__.get("_resolve_pipeline_channel")
    if original is None:
        return False
    if getattr(original, _MARK, False):
        return True
    original_func = original.__func__ if isinstance(original, staticmethod) else original

    def _resolve_pipeline_channel(channel_ref, io_store):
        try:
            return resolve_named_task_output(channel_ref, io_store)
        except LookupError:
            return original_func(channel_ref, io_store)

    setattr(_resolve_pipeline_channel, _MARK, True)
    ConditionEvaluator._resolve_pipeline_channel = staticmethod(_resolve_pipeline_channel)
    return True
