"""OpenAI-compatible HTTP server (Starlette + uvicorn) over the jaxpaged AsyncEngine."""
