"""The HTTP server: an OpenAI-style API for a model (FastAPI + uvicorn, the [serve] extra).

protocol            the request and response bodies (pydantic models, in the OpenAPI schema)
serving_completion  POST /v1/completions: checks, the scheduler's and the scoring's work,
                    whole and streamed answers
serving_models      the model and tokenizer endpoints: /v1/models, /health, /tokenize,
                    /detokenize, /tokenizer_info
logprobs            the completions' logprobs and text offsets (UTF-8 offset rules)
tokens              the tokenizer as the API uses it: prompts to ids, ids checked, end of text
errors              `ApiError` and OpenAI's error bodies
limits              `ServeLimits`: what a request may ask for, the batch and the queue
                    (the `decoderlm serve` limit flags; imports no [serve] extra)
admission           the choices in progress against the batch and the queue (503)
routes              the FastAPI routes, each a few lines calling `serving_models` or
                    `serving_completion`
guard               ASGI middleware before the routes: the API key (401) and the body size (413)
app                 `create_app`, the error handlers, `run_server` and the `decoderlm serve`
                    command (`app` imports FastAPI only when a server is built)
"""
