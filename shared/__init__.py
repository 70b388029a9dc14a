"""nextstate: shared code used by two or more services."""
