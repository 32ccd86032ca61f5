"""Test infrastructure around a real Kubernetes control plane (see tests/infra/kube/harness)."""
