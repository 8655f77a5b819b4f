"""Configuration: one frozen, slotted dataclass per role, validated on construction.

- ``EngineConfig``: the engine (model, KV pool, scheduling); ``radixrt.Engine``
  takes one, its fields as keyword overrides, or both (``engine_config``).
- ``ServerConfig``: what ``radixrt launch`` adds around the engine (addresses,
  limits, keys, drain). It crosses into the server's child processes as a
  pickled value (spawn), so every child reads the same validated settings.

Every field carries its help text in ``dataclasses.field(metadata=...)`` (made
by ``setting``); the ``radixrt launch`` flags are generated from those fields,
so a field's name, default and help live in one place. ``load_config`` is the
one way to build both from outside: defaults < a TOML file < the environment <
flags. Neither dataclass is mutated after construction.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import tomllib
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

ATTENTION_BACKENDS = ("auto", "cpu", "triton", "torch")
LINEAR_KERNELS = ("auto", "amx", "avx512_bf16", "fma", "onednn", "torch_fp32", "torch")
DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULE_POLICIES = ("lpm", "fcfs", "dfs-weight")
EVICTION_POLICIES = ("lru", "lfu")
DEVICES = ("auto", "cpu", "cuda")  # "cuda:N" picks one GPU
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
LOAD_BALANCE_METHODS = ("cache_aware", "round_robin", "shortest_queue")
HICACHE_WRITE_POLICIES = ("write_through", "write_back")
DEFAULT_PREFILL_STEP_MS = 200.0
SPECULATIVE_ALGORITHMS = ("NGRAM",)
EMBEDDING_POOLINGS = ("last", "mean")
DEFAULT_DRAFT_TOKENS = 16
MAX_DRAFT_TOKENS = 64
REASONING_PARSERS = ("deepseek-r1", "qwen3")
TOOL_CALL_PARSERS = ("hermes", "qwen25", "llama3", "llama3_json", "mistral")


def setting(
    default: object,
    help: str,
    *,
    unset: str | None = None,
    flag: str | None = None,
    env: str | None = None,
    choices: tuple[str, ...] | None = None,
    hidden: bool = False,
    cli: bool = True,
) -> typing.Any:
    """A dataclass field with its documentation in ``metadata``.

    ``help``: what the setting does (the ``--help`` line, which adds the default);
    ``unset``: what a None default means; ``flag``: the flag when it is not
    ``--field-name``; ``env``: an environment variable that sets it (a non-empty
    value wins over the TOML file, a flag wins over it); ``choices``: the allowed
    values (checked on construction); ``hidden``: a flag left out of ``--help``;
    ``cli``: False for a field with no flag (TOML and keywords only).
    """
    metadata = {
        "help": help,
        "unset": unset,
        "flag": flag,
        "env": env,
        "choices": choices,
        "hidden": hidden,
        "cli": cli,
    }
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = setting(
        None,
        "a Hugging Face model folder or a GGUF file",
        unset="SmolLM2-135M-Instruct, the embedded model",
    )
    quantization: str | None = setting(
        None,
        "weights in GGUF blocks: gguf (a .gguf model's own, implied), or a safetensors model's "
        "2-D weights quantized at load to q8_0, q4_0 or q4_k (round to nearest)",
        unset="the model's own weights",
    )
    dtype: str = setting(
        "auto",
        "activations, KV and dense weights' dtype; auto: bfloat16 on CPU, the model's own on "
        "GPU (the default model: auto serves its Q4_1 file, a dtype its converted folder)",
        choices=DTYPES,
    )
    max_total_tokens: int | None = setting(
        None, "KV slots in the pool", unset="sized from free memory"
    )
    page_size: int = setting(1, "tokens per KV page; the prefix cache matches whole pages")
    schedule_policy: str = setting(
        "lpm", "the order waiting requests are admitted in", choices=SCHEDULE_POLICIES
    )
    disable_radix_cache: bool = setting(
        False, "turn the prefix cache off: every prompt is prefilled in full"
    )
    disable_hybrid_swa_memory: bool = setting(
        False,
        "keep every token's KV in sliding-window layers too (by default they hold only the "
        "window's, in a pool of their own)",
    )
    swa_full_tokens_ratio: float = setting(
        0.8, "the sliding-window layers' KV slots as a fraction of the full layers'"
    )
    chunked_prefill_size: int | None = setting(
        None, "tokens per prefill chunk of a long prompt", unset="no chunking"
    )
    max_running_requests: int | None = setting(None, "requests decoding at once", unset="256")
    attention_backend: str = setting(
        "auto",
        "attention kernels; auto: triton on GPU, cpu (the "
        "C kernel) on CPU where it builds, else torch (the reference)",
        choices=ATTENTION_BACKENDS,
    )
    linear_kernel: str = setting(
        "auto",
        "the bf16 CPU linear path; auto: each weight shape's fastest on this CPU, measured at "
        "the first start and cached",
        choices=LINEAR_KERNELS,
    )
    max_prefill_tokens: int = setting(16384, "token budget of one prefill batch")
    max_prefill_step_ms: float = setting(
        DEFAULT_PREFILL_STEP_MS,
        "the time a step that prefills should take: its prompt tokens are budgeted by this "
        "machine's measured cost per token (prompts longer than that are chunked); while "
        "requests decode, a step is also held to a few times their decode step; 0: token "
        "budgets only",
    )
    disable_mixed_chunk: bool = setting(
        False,
        "prefill steps do not carry the running requests' next tokens (they wait for a "
        "decode step)",
    )
    new_token_ratio: float = setting(
        0.5,
        "share of a running request's remaining max_new_tokens "
        "kept in reserve when admitting more, 0 to 1",
    )
    eviction_policy: str = setting(
        "lru", "which cached prefixes go first under memory pressure", choices=EVICTION_POLICIES
    )
    device: str = setting(
        "auto", "where the model runs: auto (cuda when present), cpu, cuda or cuda:N"
    )
    seed: int = setting(
        0, "seeds the sampling of requests without a seed of their own", flag="--random-seed"
    )
    enable_torch_compile: bool = setting(
        False, "compile the model's forward with torch.compile (slower start, faster steps)"
    )
    disable_decode_chain: bool = setting(
        False,
        "run forwards of up to 512 tokens layer by layer on the CPU, not as one C call (the "
        "decode chain: the same logits, fewer fixed costs)",
    )
    enable_hierarchical_cache: bool = setting(
        False,
        "keep KV the pool evicts in host memory (and, with --hicache-storage-dir, on disk) and "
        "load it back on a hit instead of recomputing it (off with --disable-radix-cache)",
    )
    hicache_ratio: float = setting(
        2.0, "the host tier's size as a multiple of the KV pool's (unless --hicache-size)"
    )
    hicache_size: float = setting(
        0.0, "the host tier's size in GB; 0: --hicache-ratio times the KV pool"
    )
    hicache_write_policy: str = setting(
        "write_through",
        "write_through: a request's KV goes down the tiers when it finishes; write_back: when "
        "the pool (then the host tier) evicts it",
        choices=HICACHE_WRITE_POLICIES,
    )
    hicache_storage_dir: str | None = setting(
        None,
        "the storage tier: a directory of KV files that outlives the server (needs "
        "--enable-hierarchical-cache)",
        unset="no storage tier",
    )
    hicache_storage_size: float = setting(
        8.0, "the storage tier's limit in GB; the least recently used files go first"
    )
    enable_deterministic_inference: bool = setting(
        False,
        "exact outputs on CUDA too (the Triton attention kernels in fixed split sizes and "
        "order), and refuse to start where a part cannot be exact; on the CPU outputs are exact "
        "by default",
    )
    disable_deterministic_inference: bool = setting(
        False,
        "allow a request's outputs to depend on its batch and the cache (the CPU's faster "
        "kernels per batch size, the non-exact kernels and torch.compile)",
    )
    constrained_json_disable_any_whitespace: bool = setting(
        False,
        "JSON-schema outputs are compact (', ' and ': ' between elements) instead of allowing "
        "any whitespace there",
    )
    embedding_pooling: str = setting(
        "last",
        "an embedding (/v1/embeddings, Engine.encode) is the prompt's final hidden state (after "
        "the final norm) at its last token (last: a cached prefix is reused), or averaged over "
        "every prompt token (mean: the whole prompt is computed)",
        choices=EMBEDDING_POOLINGS,
    )
    speculative_algorithm: str | None = setting(
        None,
        "speculative decoding: NGRAM drafts a running request's next tokens from earlier "
        "occurrences of its latest tokens, in its own tokens and in every sequence the radix "
        "cache holds under its cache_salt, and verifies them in one forward (greedy outputs "
        "and logprobs unchanged, sampling's distribution unchanged)",
        unset="off",
    )
    speculative_num_draft_tokens: int | None = setting(
        None,
        f"draft tokens verified per request and step, 1 to {MAX_DRAFT_TOKENS}",
        unset=f"{DEFAULT_DRAFT_TOKENS} with --speculative-algorithm",
    )
    speculative_ngram_min_match_window_size: int = setting(
        3,
        "NGRAM: the fewest latest tokens a match must cover (SGLang's default is 1; shorter "
        "matches draft text that is not repeating)",
    )
    speculative_ngram_max_match_window_size: int = setting(
        12, "NGRAM: the most latest tokens a match is looked up with"
    )
    speculative_ngram_min_bfs_breadth: int = setting(
        1, "NGRAM: the fewest branches a draft tree from the cache is given"
    )
    speculative_ngram_max_bfs_breadth: int = setting(
        10, "NGRAM: the most branches a draft tree from the cache is given"
    )
    speculative_ngram_branch_length: int = setting(
        18, "NGRAM: the most draft tokens taken after one occurrence of a match"
    )

    def __post_init__(self) -> None:
        _check_types(self)
        _check_choices(self)
        _check_optional_text("model", self.model)
        _check_quantization(self.model, self.quantization)
        _check_positive("page_size", self.page_size)
        _check_positive("max_prefill_tokens", self.max_prefill_tokens)
        if not 0 <= self.max_prefill_step_ms < math.inf:
            raise ValueError(
                f"max_prefill_step_ms must be a number >= 0, got {self.max_prefill_step_ms!r}"
            )
        for name in ("max_total_tokens", "chunked_prefill_size", "max_running_requests"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        if self.max_total_tokens is not None and self.max_total_tokens < 4 * self.page_size:
            raise ValueError(f"max_total_tokens ({self.max_total_tokens}) must be at least 4 pages")
        if not 0.0 <= self.new_token_ratio <= 1.0:
            raise ValueError(f"new_token_ratio must be in [0, 1], got {self.new_token_ratio}")
        self._check_hierarchical_cache()
        self._check_speculative()
        if self.enable_deterministic_inference and self.disable_deterministic_inference:
            raise ValueError(
                "enable_deterministic_inference and disable_deterministic_inference are both set"
            )
        kind, _, index = self.device.partition(":")
        if kind not in DEVICES or (index and (kind != "cuda" or not index.isdigit())):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")

    def _check_hierarchical_cache(self) -> None:
        _check_optional_text("hicache_storage_dir", self.hicache_storage_dir)
        for name in ("hicache_ratio", "hicache_storage_size"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be a positive number, got {getattr(self, name)!r}")
        if not self.hicache_size >= 0:
            raise ValueError(f"hicache_size must be >= 0 GB, got {self.hicache_size!r}")
        if self.hicache_storage_dir is not None and not self.enable_hierarchical_cache:
            raise ValueError("hicache_storage_dir needs enable_hierarchical_cache")
        ratio = self.swa_full_tokens_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(f"swa_full_tokens_ratio must be in (0, 1], got {ratio!r}")

    def _check_speculative(self) -> None:
        """The speculative settings, and the combinations speculation does not implement."""
        algo, n = self.speculative_algorithm, self.speculative_num_draft_tokens
        if algo is not None and algo not in SPECULATIVE_ALGORITHMS:
            raise ValueError(
                f"speculative_algorithm {algo!r} is not implemented (one of "
                f"{', '.join(SPECULATIVE_ALGORITHMS)}, or None)"
            )
        if n is not None and (isinstance(n, bool) or not 1 <= n <= MAX_DRAFT_TOKENS):
            raise ValueError(
                f"speculative_num_draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}], "
                f"got {n!r}"
            )
        if n is not None and algo is None:
            raise ValueError("speculative_num_draft_tokens needs speculative_algorithm")
        for kind in ("match_window_size", "bfs_breadth"):
            low = getattr(self, f"speculative_ngram_min_{kind}")
            high = getattr(self, f"speculative_ngram_max_{kind}")
            _check_positive(f"speculative_ngram_min_{kind}", low)
            if high < low:
                raise ValueError(
                    f"speculative_ngram_max_{kind} ({high}) is below "
                    f"speculative_ngram_min_{kind} ({low})"
                )
        _check_positive("speculative_ngram_branch_length", self.speculative_ngram_branch_length)
        if algo is not None and self.page_size != 1:
            raise ValueError(
                f"speculative_algorithm {algo} with page_size {self.page_size}: speculative "
                "decoding needs page_size 1"
            )
        if algo is not None and self.device.startswith("cuda"):
            raise ValueError(
                f"speculative_algorithm {algo} on {self.device}: speculative decoding runs on the "
                "CPU only (untested on GPUs)"
            )

    @property
    def draft_tokens(self) -> int:
        """Draft tokens per request and step (0: speculation off)."""
        if self.speculative_algorithm is None:
            return 0
        return self.speculative_num_draft_tokens or DEFAULT_DRAFT_TOKENS

    @property
    def prefill_budget(self) -> int:
        """Tokens one prefill batch may compute (a chunk size bounds it too)."""
        return min(self.max_prefill_tokens, self.chunked_prefill_size or self.max_prefill_tokens)

    @property
    def running_limit(self) -> int:
        return self.max_running_requests or 256

    def wants_exact(self, device_type: str) -> bool:
        """Whether outputs are to be exact on a device of this type: on the CPU unless
        disabled, elsewhere when enabled."""
        if self.disable_deterministic_inference:
            return False
        return self.enable_deterministic_inference or device_type == "cpu"


def engine_config(config: EngineConfig | None = None, **overrides: object) -> EngineConfig:
    """``config`` (None: the defaults) with the fields in ``overrides`` replaced.

    Raises TypeError when ``config`` is not an EngineConfig or an override names no field of
    it (before anything is loaded), ValueError when a value is invalid.
    """
    if config is not None and not isinstance(config, EngineConfig):
        raise TypeError(
            f"expected an EngineConfig, got {type(config).__name__} {config!r} "
            "(a model folder is passed as model=...)"
        )
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(EngineConfig)})
    if unknown:
        raise TypeError(f"unknown EngineConfig fields {unknown}")
    if config is None:
        return EngineConfig(**overrides)
    return dataclasses.replace(config, **overrides)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = setting(
        "127.0.0.1",
        "the interface both ports bind; a warning if it is not loopback and there is no API key",
    )
    port: int = setting(30000, "the ZeroMQ RPC port")
    http_port: int = setting(8000, "the OpenAI-compatible HTTP API's port; 0: no HTTP")
    served_model_name: str | None = setting(
        None, "the model's name in the HTTP API", unset="the model folder's name"
    )
    max_waiting_requests: int | None = setting(
        None, "refuse new requests with 'overloaded' past this many waiting", unset="no limit"
    )
    log_level: str = setting(
        "warning", f"logging level, one of {', '.join(LOG_LEVELS)}, in any case"
    )
    grace_period: float = setting(
        30.0, "on SIGTERM, seconds running requests may take to finish before the rest are aborted"
    )
    max_message_bytes: int = setting(
        16 << 20, "refuse client messages larger than this with too_large"
    )
    max_prompt_tokens: int | None = setting(
        None, "refuse longer prompts with prompt_too_long", unset="the model's context"
    )
    max_new_tokens_limit: int = setting(
        32768, "refuse requests asking for more max_new_tokens with limit_exceeded"
    )
    max_requests_per_client: int = setting(
        256, "requests one client may have in flight; more get limit_exceeded"
    )
    api_key: str | None = setting(
        None,
        "require this key (or one of KEY1,KEY2,...) on every request",
        unset="none",
        env="RADIXRT_API_KEY",
    )
    isolate_by_api_key: bool = setting(
        False, "salt each request's prefix cache with its API key (needs --api-key)"
    )
    curve_keys: str | None = setting(
        None,
        "CurveZMQ: a folder made by `radixrt curve-keygen`, holding server.key_secret",
        unset="plaintext",
    )
    max_forward_failures: int = setting(
        3, "consecutive forward-pass failures before the server exits"
    )
    debug_faults: str | None = setting(
        None, "test-only fault injection (radixrt.server.faults)", unset="none", hidden=True
    )
    dp_size: int = setting(
        1, "data-parallel replicas: scheduler processes, each with its own model, KV pool and tree"
    )
    threads_per_replica: int | None = setting(
        None, "CPU threads of each replica's scheduler", unset="the CPUs divided by dp_size"
    )
    dp_restart: bool = setting(
        False, "restart a replica whose process dies (else the rest serve on without it)"
    )
    load_balance_method: str = setting(
        "cache_aware",
        "how the front picks a replica: the longest cached prefix (from each replica's KV "
        "events) unless out of balance, round_robin, or shortest_queue (fewest waiting tokens)",
        choices=LOAD_BALANCE_METHODS,
    )
    cache_threshold: float = setting(
        0.5,
        "cache_aware: the share of a prompt a replica must hold cached to win on the cache; "
        "below it the least loaded replica gets the request",
    )
    balance_abs_threshold: int = setting(
        4096,
        "cache_aware: out of balance when the most loaded replica waits on this many more "
        "prompt tokens than the least loaded ...",
    )
    balance_rel_threshold: float = setting(2.0, "... and on more than this many times as many")
    kv_events_endpoint: str | None = setting(
        None,
        "also publish every replica's KV events on this ZeroMQ PUB address (e.g. tcp://*:5557)",
        unset="none",
    )
    reasoning_parser: str | None = setting(
        None,
        "chat completions answer the model's reasoning (<think>...</think>) apart, in "
        f"reasoning_content, and a structured output applies after it; one of "
        f"{', '.join(REASONING_PARSERS)}",
        unset="none",
    )
    responses_store_size: int = setting(
        1024,
        "POST /v1/responses: stored responses kept for previous_response_id and GET (least "
        "recently used out first), over every API key",
    )
    tool_call_parser: str | None = setting(
        None,
        "read tool calls out of chat completions written in this format: hermes or qwen25 "
        "(<tool_call>{json}</tool_call>), llama3 or llama3_json ({json}; {json}), mistral "
        "([TOOL_CALLS][...]); tool_choice auto, required and named need it",
        unset="none",
    )
    enable_auto_tool_choice: bool = setting(
        False,
        "accept tool_choice auto (a request's default when it has tools): the model answers "
        "or calls tools as it chooses (needs --tool-call-parser)",
    )

    def __post_init__(self) -> None:
        _check_types(self)
        _check_choices(self)
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser {self.reasoning_parser!r} is not known (one of "
                f"{', '.join(REASONING_PARSERS)}, or None)"
            )
        _check_optional_text("host", self.host)
        _check_port("port", self.port, allow_zero=False)
        _check_port("http_port", self.http_port, allow_zero=True)
        if self.http_port and self.http_port == self.port:
            raise ValueError(f"http_port and port are both {self.port}")
        for name in (
            "max_message_bytes",
            "max_new_tokens_limit",
            "max_requests_per_client",
            "max_forward_failures",
            "responses_store_size",
        ):
            _check_positive(name, getattr(self, name))
        for name in ("max_prompt_tokens", "max_waiting_requests"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        if self.grace_period < 0:
            raise ValueError(
                f"grace_period must be a number of seconds >= 0, got {self.grace_period!r}"
            )
        if self.log_level.lower() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        for name in ("served_model_name", "curve_keys", "debug_faults"):
            _check_optional_text(name, getattr(self, name))
        if self.api_key is not None and not self.api_keys:
            raise ValueError(f"api_key must hold at least one key, got {self.api_key!r}")
        if self.isolate_by_api_key and not self.api_keys:
            raise ValueError("isolate_by_api_key needs an api_key")
        self._check_data_parallel()
        self._check_tools()

    def _check_tools(self) -> None:
        parser = self.tool_call_parser
        if parser is not None and parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser {parser!r} is not known; the parsers are "
                f"{', '.join(TOOL_CALL_PARSERS)}"
            )
        if self.enable_auto_tool_choice and parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser")

    def _check_data_parallel(self) -> None:
        _check_positive("dp_size", self.dp_size)
        _check_positive("balance_abs_threshold", self.balance_abs_threshold)
        if self.threads_per_replica is not None:
            _check_positive("threads_per_replica", self.threads_per_replica)
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_rel_threshold < 1.0:
            raise ValueError(
                f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}"
            )
        _check_optional_text("kv_events_endpoint", self.kv_events_endpoint)

    @property
    def kv_events(self) -> bool:
        """Whether replicas publish KV events: the front routes from them, or an outside
        consumer subscribes."""
        return self.dp_size > 1 or self.kv_events_endpoint is not None

    @property
    def replica_threads(self) -> int:
        """CPU threads each replica's scheduler runs with."""
        if self.threads_per_replica is not None:
            return self.threads_per_replica
        return max(1, len(os.sched_getaffinity(0)) // self.dp_size)

    @property
    def api_keys(self) -> tuple[bytes, ...]:
        """The accepted keys of ``api_key`` ("KEY" or "KEY1,KEY2"); empty: no key needed."""
        return tuple(k.strip().encode() for k in (self.api_key or "").split(",") if k.strip())

    @property
    def loopback(self) -> bool:
        """Whether ``host`` is a loopback address (reachable from the local host only)."""
        return self.host in LOOPBACK_HOSTS

    @property
    def logging_level(self) -> int:
        return logging.getLevelName(self.log_level.upper())


def launch_fields() -> Iterator[tuple[type, dataclasses.Field]]:
    """(class, field) of every setting ``load_config`` knows, EngineConfig's first."""
    for cls in (EngineConfig, ServerConfig):
        for f in dataclasses.fields(cls):
            yield cls, f


def load_config(
    path: str | None = None,
    flags: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[EngineConfig, ServerConfig]:
    """The engine's and the server's settings from, lowest first: the defaults; the TOML file
    at ``path`` (flat keys, ``-`` or ``_``); each field's ``env`` variable in ``environ``
    (``os.environ`` when None) where set and non-empty; ``flags`` (field name -> value, None
    meaning not given).

    Raises ValueError naming unknown TOML keys or flags, or the first invalid field.
    """
    values = _read_toml(path) if path else {}
    env = os.environ if environ is None else environ
    for _, f in launch_fields():
        if f.metadata["env"] and env.get(f.metadata["env"]):
            values[f.name] = env[f.metadata["env"]]
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    _reject_unknown(given, "flags")
    values.update(given)
    engine = {f.name: values[f.name] for f in dataclasses.fields(EngineConfig) if f.name in values}
    server = {f.name: values[f.name] for f in dataclasses.fields(ServerConfig) if f.name in values}
    return EngineConfig(**engine), ServerConfig(**server)


def _read_toml(path: str) -> dict[str, object]:
    with open(path, "rb") as f:
        data = {k.replace("-", "_"): v for k, v in tomllib.load(f).items()}
    _reject_unknown(data, path)
    return data


def _reject_unknown(values: Mapping[str, object], source: str) -> None:
    unknown = sorted(set(values) - {f.name for _, f in launch_fields()})
    if unknown:
        raise ValueError(
            f"{source}: unknown settings {unknown} (each must be a field of "
            "EngineConfig or ServerConfig; see `radixrt launch --help`)"
        )


@functools.cache
def field_types(cls: type) -> dict[str, tuple[type, bool]]:
    """Each field's (base type, whether None is allowed), read from the annotations."""
    types = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = typing.get_args(hint)
        base = next(a for a in args if a is not type(None)) if args else hint
        types[name] = (base, type(None) in args)
    return types


_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _check_types(config: object) -> None:
    """Raise unless every field holds its annotated type (an int is a float; a bool is no int)."""
    for name, (base, optional) in field_types(type(config)).items():
        value = getattr(config, name)
        if value is None and optional:
            continue
        wanted = (int, float) if base is float else base
        if isinstance(value, bool) != (base is bool) or not isinstance(value, wanted):
            raise ValueError(f"{name} must be {_TYPE_WORDS[base]}, got {value!r}")


def _check_choices(config: object) -> None:
    for f in dataclasses.fields(config):
        choices = f.metadata["choices"]
        if choices is not None and getattr(config, f.name) not in choices:
            raise ValueError(f"{f.name} must be one of {choices}, got {getattr(config, f.name)!r}")


QUANTIZATIONS = ("gguf", "q8_0", "q4_0", "q4_k")


def _check_quantization(model: str | None, quantization: str | None) -> None:
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    is_gguf = model is not None and model.endswith(".gguf")
    if quantization == "gguf" and not is_gguf:
        raise ValueError("quantization 'gguf' needs a .gguf model file")
    if quantization != "gguf" and is_gguf:
        raise ValueError(
            f"quantization {quantization!r}: a .gguf model is already quantized (its blocks run "
            "as they are)"
        )


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_port(name: str, value: int, allow_zero: bool) -> None:
    if not (0 if allow_zero else 1) <= value < 65536:
        extra = " (0: off)" if allow_zero else ""
        raise ValueError(f"{name} must be a port number{extra}, got {value!r}")


def _check_optional_text(name: str, value: str | None) -> None:
    if value is not None and not value.strip():
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")
