"""The HTTP front: OpenAI's API, SGLang's native API and Prometheus metrics.

It runs inside the TokenizerManager process, on its asyncio loop (uvicorn,
Starlette), so an HTTP request costs no process hop more than a ZeroMQ one.
It sees that process only through ``radixrt.server.front_api.FrontApi``: a
handler tokenizes and admits its requests there (``open_response`` /
``submit``), then reads their text deltas from its own queue (a ``Job``).
Nothing in this package imports the rest of ``radixrt.server`` but that
interface module and the metrics' content type.

Modules: ``app`` (routes, errors, the read-only endpoints, ``serve_http``),
``context`` (what every endpoint shares: keys, bodies, sampling, jobs),
``jobs`` (the engine requests behind one HTTP request; Server-Sent Events),
``openai_api``, ``sglang_api`` (the generating endpoints) and ``schemas``
(the request and response bodies). The package itself imports none of
them: the TokenizerManager imports ``app.serve_http``.

Endpoints:
- ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``
  (OpenAI's shapes; streams are Server-Sent Events ending in ``data: [DONE]``);
- ``POST /generate``, ``GET /get_model_info``, ``GET /get_server_info``,
  ``POST /flush_cache`` (SGLang's);
- ``GET /health`` (200 serving, 503 draining) and ``GET /metrics``, which
  answer without an API key; everything else needs ``Authorization: Bearer
  KEY`` when the server has ``--api-key``.

Every error is an OpenAI error object with its status (see
``radixrt.server.http.schemas.ApiError``); nothing a client sends gets a stack trace or
stops the server. A client that disconnects before its answer is complete
has its requests aborted (their KV is freed).
"""
