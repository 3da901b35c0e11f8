"""The worker's OpenAI-style HTTP API (FastAPI on uvicorn)."""
