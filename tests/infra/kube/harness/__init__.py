"""A real Kubernetes control plane for tests, plus a *process kubelet*.

    from tests.infra.kube.harness import ControlPlane

    with ControlPlane() as cp:                      # builds once (scripts/build-control-plane), starts
        cp.add_node("node-a", cpu="2", memory="4Gi") # a ProcessKubelet: pods run as local processes
        api = cp.api_client()                       # kubernetes.client.ApiClient, admin
        cp.kubeconfig_path                          # admin kubeconfig file
        token = cp.add_token("alice", ["team"])     # another user, for RBAC tests
        cp.api_client(token=token); cp.kubeconfig_for(token)

See controlplane.py and kubelet.py for details.
"""

from .controlplane import ControlPlane, ControlPlaneError, build_control_plane
from .kubelet import ProcessKubelet
from .process import wait_for

__all__ = ["ControlPlane", "ControlPlaneError", "ProcessKubelet", "build_control_plane", "wait_for"]
