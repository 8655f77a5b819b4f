"""Backends a prompt program runs against: an in-process ``Engine`` or a server.

Both speak token ids (so a fork's children extend exactly the ids of their
parent and hit its cached prefix) and offer the same four calls:
``generate``, ``generate_stream`` (text deltas, then the output), ``cache_prefix``
(prefill-only request: the ids enter the radix tree) and ``score``. Each takes a
``routing_key``: a server with several data-parallel replicas sends the requests
sharing one to the same replica (an in-process engine has one, and ignores it).
A program run's ``cache_salt`` travels in ``sp.cache_salt`` for ``generate``
and as the ``cache_salt`` argument of ``cache_prefix`` and ``score``; every
request a call sends carries it, so the run only shares KV within its salt.
``EngineBackend`` drives the engine from one thread, so programs running on many
threads are batched together by the scheduler; its deltas and outputs come from
``radixrt.output``, as the server's do.
Each backend keeps the latest prompts it sent in ``request_log``, at most
``request_log_len`` of them (``None``: every one, for a benchmark's finite run).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future

from radixrt.output import Detokenizer, OutputTracker
from radixrt.protocol import GenerateOutput
from radixrt.sampling import SamplingParams

REQUEST_LOG_LEN = 64


class Backend:
    tokenizer = None

    def ensure_ready(self) -> None:
        """Raise if the backend cannot serve (e.g. the server is down)."""

    def generate(
        self, ids: list[int], sp: SamplingParams, routing_key: str | None = None
    ) -> GenerateOutput:
        raise NotImplementedError

    def generate_stream(
        self, ids: list[int], sp: SamplingParams, routing_key: str | None = None
    ) -> Iterator[str | GenerateOutput]:
        out = self.generate(ids, sp, routing_key)
        yield out.text
        yield out

    def cache_prefix(
        self, ids: list[int], cache_salt: str | None = None, routing_key: str | None = None
    ) -> GenerateOutput:
        sp = SamplingParams(max_new_tokens=0, cache_salt=cache_salt)
        return self.generate(ids, sp, routing_key)

    def score(
        self,
        prefix: list[int],
        continuations: list[list[int]],
        cache_salt: str | None = None,
        routing_key: str | None = None,
    ) -> list[tuple[float, int]]:
        raise NotImplementedError


class EngineBackend(Backend):
    """Runs programs on an in-process ``Engine`` (one driver thread owns it)."""

    def __init__(self, engine, *, request_log_len: int | None = REQUEST_LOG_LEN) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._inbox: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.request_log: deque[list[int]] = deque(maxlen=request_log_len)

    def _submit(
        self,
        ids: list[int],
        sp: SamplingParams,
        logprob_start_len: int | None = None,
        deltas: queue.Queue | None = None,
    ) -> Future:
        fut: Future = Future()
        self.request_log.append(list(ids))
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._drive, name="radixrt-lang-engine", daemon=True
                )
                self._thread.start()
            self._inbox.put((list(ids), sp, logprob_start_len, fut, deltas))
        return fut

    def _drive(self) -> None:
        """Owns the engine: add queued requests, step, resolve finished ones; exit when idle."""
        detok, outputs = Detokenizer(self.tokenizer), OutputTracker()
        live: dict[str, tuple[Future, queue.Queue | None]] = {}  # rid -> (future, text deltas)
        while True:
            block = not live
            try:
                while True:
                    item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
                    block = False
                    self._add(item, live, outputs)
            except queue.Empty:
                if not live:
                    with self._lock:
                        if self._inbox.empty():
                            self._thread = None
                            return
                    continue
            try:
                self.engine.step()
            except Exception as e:  # fail every request rather than hang
                for rid, (fut, _) in live.items():
                    fut.set_exception(e)
                    outputs.remove(rid)
                    detok.forget(rid)
                live.clear()
                continue
            self._emit(outputs, live, detok)

    def _add(self, item, live: dict, outputs: OutputTracker) -> None:
        ids, sp, start, fut, deltas = item
        try:
            req = self.engine.add_request(ids, sp, logprob_start_len=start)
        except Exception as e:
            fut.set_exception(e)
            return
        live[req.rid] = (fut, deltas)
        outputs.add(req, stream=deltas is not None)

    def _emit(self, outputs: OutputTracker, live: dict, detok: Detokenizer) -> None:
        """Stream the new text of each request; resolve the finished ones' futures."""
        for req, delta in outputs.collect():
            fut, deltas = live[req.rid]
            if deltas is not None:
                text = detok.delta(delta).text
                if text:
                    deltas.put(text)
            if req.finished:
                del live[req.rid]
                fut.set_result(self.engine.make_output(req))

    def generate(
        self, ids: list[int], sp: SamplingParams, routing_key: str | None = None
    ) -> GenerateOutput:
        return self._submit(ids, sp).result()

    def generate_stream(
        self, ids: list[int], sp: SamplingParams, routing_key: str | None = None
    ) -> Iterator[str | GenerateOutput]:
        deltas: queue.Queue = queue.Queue()
        fut = self._submit(ids, sp, deltas=deltas)
        while not (fut.done() and deltas.empty()):
            try:
                yield deltas.get(timeout=0.05)
            except queue.Empty:
                pass
        yield fut.result()

    def score(
        self,
        prefix: list[int],
        continuations: list[list[int]],
        cache_salt: str | None = None,
        routing_key: str | None = None,
    ) -> list[tuple[float, int]]:
        self.cache_prefix(prefix, cache_salt)
        sp = SamplingParams(max_new_tokens=0, cache_salt=cache_salt)
        futs = [self._submit(prefix + c, sp, logprob_start_len=len(prefix)) for c in continuations]
        outs = [f.result() for f in futs]
        return [(sum(o.prompt_logprobs or ()), len(c)) for o, c in zip(outs, continuations)]


class RuntimeEndpoint(Backend):
    """Runs programs on a ``radixrt launch`` server (``tcp://host:port``).

    Connects lazily; ``ensure_ready`` raises ``TimeoutError`` if the server does
    not answer the handshake within ``connect_timeout`` seconds.
    """

    def __init__(
        self,
        address: str,
        timeout: float | None = 120.0,
        connect_timeout: float = 5.0,
        *,
        api_key: str | None = None,
        curve_server_key: str | bytes | None = None,
        request_log_len: int | None = REQUEST_LOG_LEN,
    ) -> None:
        self.address, self.timeout, self.connect_timeout = address, timeout, connect_timeout
        self.api_key, self.curve_server_key = api_key, curve_server_key
        self._client = None
        self._tokenizer = None
        self._lock = threading.Lock()
        self.request_log: deque[list[int]] = deque(maxlen=request_log_len)

    @property
    def client(self):
        with self._lock:
            if self._client is None:
                from radixrt.client import Client

                c = Client(
                    self.address,
                    timeout=self.connect_timeout,
                    api_key=self.api_key,
                    curve_server_key=self.curve_server_key,
                )
                c.timeout = self.timeout
                self._client = c
            return self._client

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.client.info["model"])
        return self._tokenizer

    def ensure_ready(self) -> None:
        self.client  # noqa: B018 -- connects (handshake) or raises

    def generate(
        self, ids: list[int], sp: SamplingParams, routing_key: str | None = None
    ) -> GenerateOutput:
        self.request_log.append(list(ids))
        return self.client.generate(input_ids=ids, sampling_params=sp, routing_key=routing_key)

    def generate_stream(
        self, ids: list[int], sp: SamplingParams, routing_key: str | None = None
    ) -> Iterator[str | GenerateOutput]:
        self.request_log.append(list(ids))
        text, token_ids, last = [], [], None
        chunks = self.client.generate(
            input_ids=ids, sampling_params=sp, stream=True, routing_key=routing_key
        )
        for chunk in chunks:
            if chunk.text:
                text.append(chunk.text)
                yield chunk.text
            token_ids.extend(chunk.token_ids)
            last = chunk
        yield GenerateOutput(
            rid="",
            text="".join(text),
            token_ids=token_ids,
            prompt_tokens=last.prompt_tokens,
            cached_tokens=last.cached_tokens,
            cached_tokens_details=last.cached_tokens_details,
            finish_reason=last.finish_reason,
        )

    def score(
        self,
        prefix: list[int],
        continuations: list[list[int]],
        cache_salt: str | None = None,
        routing_key: str | None = None,
    ) -> list[tuple[float, int]]:
        self.request_log.append(list(prefix))
        self.request_log.extend(prefix + c for c in continuations)
        return self.client.score(
            prefix, continuations, cache_salt=cache_salt, routing_key=routing_key
        )

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
