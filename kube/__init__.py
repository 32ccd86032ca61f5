"""Test infrastructure around a real Kubernetes control plane (see kube/harness)."""
