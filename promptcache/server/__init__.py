"""OpenAI- and Anthropic-compatible HTTP server around one engine."""
