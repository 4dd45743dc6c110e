"""`headstart serve`: an OpenAI-compatible HTTP server over one Engine, one request at a time."""
