"""The OpenAI-compatible server: AsyncEngine (engine thread + async streams), the FastAPI app,
Prometheus metrics, and the `serve` / `chat` commands."""
