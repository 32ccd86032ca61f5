"""One pod as the Kubernetes backend makes it (pod_body), for the unit tests of what dresses it (no cluster)."""

from elastic_step.backends.api import InstanceId, InstanceSpec
from elastic_step.backends.kubernetes.pods import _Launch, pod_body


def job_pod(
    role: str, index: int = 0, number: int = 1, spec: dict | None = None, argv: tuple = ("run",), **options
) -> dict:
    """The pod of launch `number` of `role`-`index` of job `j` in namespace `ns`, running `argv`; `spec`: InstanceSpec
    fields; `options`: pod_body's (pod_spec, pod_labels, queue, num_ps, settings)."""
    name = f"j-{role}-{index}" + (f"-{number}" if number > 1 else "")
    launch = _Launch(InstanceSpec(InstanceId(role, index), list(argv), **(spec or {})), number, name=name)
    return pod_body(
        launch,
        job_id="j",
        namespace="ns",
        image="img",
        secret_name="j-token",
        grace_s=30,
        default_priority=None,
        owner_refs=[],
        **({"pod_spec": {}} | options),
    )
