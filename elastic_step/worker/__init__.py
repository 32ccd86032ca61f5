"""worker role of elastic-step."""
