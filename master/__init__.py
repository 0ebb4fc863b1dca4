"""The master role: KV-cache-aware routing of requests across backends."""
