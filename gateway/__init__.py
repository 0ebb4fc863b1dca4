"""ROLE_TYPE=GATEWAY: one OpenAI endpoint in front of any OpenAI-compatible servers, queueing instead of 429s."""
