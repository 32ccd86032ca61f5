"""Pipelines built from elastic_step.components."""
