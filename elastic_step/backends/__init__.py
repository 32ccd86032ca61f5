"""backends role of elastic-step."""
