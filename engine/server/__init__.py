"""`python -m engine serve`: the loaded model behind OpenAI- and Anthropic-compatible HTTP endpoints."""
