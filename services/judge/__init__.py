"""The judge service: scores each turn from its next state (PRM votes, rules, plugins, OPD)."""
