"""OpenAI- and Anthropic-compatible HTTP server around one engine: ``app.create_app`` over a
``state.ServerState``; ``launcher.ServerProcess`` runs a real server for tests and benchmarks."""

__all__ = ["app", "launcher", "state"]
