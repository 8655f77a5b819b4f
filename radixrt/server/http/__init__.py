"""The HTTP front: OpenAI's API, SGLang's native API and Prometheus metrics.

It runs inside the TokenizerManager process, on its asyncio loop (uvicorn,
Starlette), so an HTTP request costs no process hop more than a ZeroMQ one:
a handler tokenizes, validates and admits its requests through the
TokenizerManager (``check_admission`` / ``admit``), then reads their text
deltas from its own queue (a ``Job``).

Endpoints:
- ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``
  (OpenAI's shapes; streams are Server-Sent Events ending in ``data: [DONE]``);
- ``POST /generate``, ``GET /get_model_info``, ``GET /get_server_info``,
  ``POST /flush_cache`` (SGLang's);
- ``GET /health`` (200 serving, 503 draining) and ``GET /metrics``, which
  answer without an API key; everything else needs ``Authorization: Bearer
  KEY`` when the server has ``--api-key``.

Every error is an OpenAI error object with its status (see
``radixrt.server.http.protocol.ApiError``); nothing a client sends gets a stack trace or
stops the server. A client that disconnects before its answer is complete
has its requests aborted (their KV is freed).
"""

from radixrt.server.http.front import serve_http

__all__ = ["serve_http"]
