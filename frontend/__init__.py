"""The frontend role: OpenAI-compatible HTTP API in front of the backends."""
