"""Spawners and the GPU share translation they share: profiles → Kubernetes resources or local devices."""
