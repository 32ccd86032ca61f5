"""data role of elastic-step."""
