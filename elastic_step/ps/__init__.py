"""ps role of elastic-step."""
