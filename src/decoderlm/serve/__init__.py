"""The HTTP server: an OpenAI-style API for a model (FastAPI + uvicorn, the [serve] extra).

protocol  the request and response bodies (pydantic models, in the OpenAPI schema)
serving   the serving logic: checks, limits (`ServeLimits`), errors (`ApiError`),
          the scheduler's and the scoring's work, response models and streamed events
routes    the FastAPI routes, each a few lines calling `serving.Serving`
guard     ASGI middleware before the routes: the API key (401) and the body size (413)
app       `create_app`, the error handlers, `run_server` and the `decoderlm serve` command
          (`app` imports FastAPI only when a server is built)
"""
