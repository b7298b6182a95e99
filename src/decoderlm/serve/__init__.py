"""The HTTP server: an OpenAI-style API (app)."""
