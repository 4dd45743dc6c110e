"""`headstart serve`: an OpenAI-compatible HTTP server over one Engine, many requests decoded at once."""
