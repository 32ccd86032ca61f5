"""Test infrastructure: a real Kubernetes control plane (kube/) and object-store servers (stores/)."""
