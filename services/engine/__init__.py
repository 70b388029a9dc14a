"""The CPU inference engine: SGLang's native HTTP API (and OpenAI chat) over transformers."""
