"""master role of elastic-step."""
