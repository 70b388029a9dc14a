"""Environments for agent episodes, and the sandbox every one of their tool calls runs in."""
