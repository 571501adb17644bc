"""The OpenAI-compatible HTTP server (`hisparse serve`)."""
