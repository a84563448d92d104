"""`dscale-serve`: an OpenAI-compatible HTTP server around one `Engine` running in a background thread."""
