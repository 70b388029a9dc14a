"""vLLM as the serving engine: the entrypoint that runs vLLM's server in the stack."""
