"""`justfit serve`: the OpenAI HTTP API over a Runtime (spec: API.md; pydantic models in schema.py)."""
