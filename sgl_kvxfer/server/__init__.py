"""HTTP server (FastAPI): native SGLang routes, OpenAI routes, auth, error envelopes, metrics."""
