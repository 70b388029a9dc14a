"""nextstate services: one folder each, started as `python -m services.<name>`."""
