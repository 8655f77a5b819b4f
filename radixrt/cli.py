"""The ``radixrt`` command line.

    radixrt generate [--model PATH] [--chat] [--max-new-tokens N] [--temperature T] "prompt"

runs the offline Engine in this process (the default model when --model is
not given) and prints the completion; with ``--server tcp://HOST:PORT`` it
streams the completion from a running server instead.

    radixrt launch [--model PATH] [--host H] [--port P] [--config configs/NAME.toml] ...

starts the server (see ``radixrt.server``); flags mirror the Engine's
arguments (SGLang names); a TOML file may set any of them (and the server
settings of ``SERVER_SETTINGS``: host, port, limits, api_key, ...); flags
override it.

    radixrt curve-keygen FOLDER

writes a CurveZMQ key pair for ``radixrt launch --curve-keys FOLDER``.
"""

from __future__ import annotations

import argparse
import os
import sys


def _generate(args: argparse.Namespace) -> int:
    if args.server:
        return _generate_remote(args)
    from radixrt import Engine, SamplingParams
    eng = Engine(model=args.model, dtype=args.dtype)
    prompt = args.prompt
    if args.chat:
        prompt = eng.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                   tokenize=False, add_generation_prompt=True)
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    out = eng.generate(prompt, sp)[0]
    print(out.text)
    print(f"[{len(out.token_ids)} tokens, finish: {out.finish_reason}, model: {eng.model_path}]",
          file=sys.stderr)
    return 0


def _generate_remote(args: argparse.Namespace) -> int:
    from radixrt.client import Client
    sp = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    kwargs = ({"messages": [{"role": "user", "content": args.prompt}]} if args.chat
              else {"prompt": args.prompt})
    n, last = 0, None
    with Client(args.server, timeout=args.timeout, api_key=args.api_key,
                curve_server_key=args.curve_server_key) as client:
        for chunk in client.generate(sampling_params=sp, stream=True, **kwargs):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            n += len(chunk.token_ids)
            last = chunk
    print()
    print(f"[{n} tokens, finish: {last.finish_reason}, cached: {last.cached_tokens}, "
          f"server: {args.server}]", file=sys.stderr)
    return 0


SERVER_SETTINGS = {
    "host": "127.0.0.1", "port": 30000, "max_waiting_requests": None, "log_level": "warning",
    "http_port": 8000,                  # the OpenAI-compatible HTTP API; 0 turns it off
    "served_model_name": None,          # the model's name over HTTP (default: its folder's name)
    # reliability and security (see radixrt.server)
    "grace_period": 30.0,               # seconds a SIGTERM drain waits for running requests
    "max_message_bytes": 16 << 20,      # the largest client frame accepted
    "max_prompt_tokens": None,          # None: the model's context
    "max_new_tokens_limit": 32768,      # the largest max_new_tokens a request may ask for
    "max_requests_per_client": 256,     # requests in flight per client connection
    "api_key": None,                    # also RADIXRT_API_KEY
    "isolate_by_api_key": False,        # salt each request's cache namespace with its key
    "curve_keys": None,                 # a folder from `radixrt curve-keygen` (CurveZMQ)
    "max_forward_failures": 3,          # consecutive forward failures before the server exits
    "debug_faults": None,               # test-only fault injection (radixrt.server.faults)
}
ENGINE_FLAGS = ("model", "dtype", "max_total_tokens", "page_size", "schedule_policy", "disable_radix_cache",
                "chunked_prefill_size", "max_running_requests", "attention_backend", "enable_torch_compile")


def _launch_settings(args: argparse.Namespace):
    """(EngineConfig, server settings): defaults < the TOML file < flags."""
    import dataclasses
    import tomllib
    from radixrt.config import EngineConfig
    data: dict = {}
    if args.config:
        with open(args.config, "rb") as f:
            data = {k.replace("-", "_"): v for k, v in tomllib.load(f).items()}
    server = {k: data.pop(k, default) for k, default in SERVER_SETTINGS.items()}
    unknown = set(data) - {f.name for f in dataclasses.fields(EngineConfig)}
    if unknown:
        raise ValueError(f"{args.config}: unknown settings {sorted(unknown)}")
    data.update({k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None})
    server.update({k: getattr(args, k) for k in SERVER_SETTINGS if getattr(args, k) is not None})
    _check_server_settings(server)
    return EngineConfig(**data), server


def _check_server_settings(server: dict) -> None:
    positive = ("max_message_bytes", "max_prompt_tokens", "max_new_tokens_limit", "max_requests_per_client",
                "max_forward_failures", "max_waiting_requests", "port")
    port = server["http_port"]
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port < 65536:
        raise ValueError(f"http_port must be a port number (0: no HTTP), got {port!r}")
    if port and port == server["port"]:
        raise ValueError(f"http_port and port are both {port}")
    name = server["served_model_name"]
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ValueError(f"served_model_name must be a non-empty string, got {name!r}")
    for name in positive:
        value = server[name]
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    grace = server["grace_period"]
    if not isinstance(grace, (int, float)) or isinstance(grace, bool) or grace < 0:
        raise ValueError(f"grace_period must be a number of seconds >= 0, got {grace!r}")


def _launch(args: argparse.Namespace) -> int:
    import logging
    from radixrt.server.launcher import Launcher
    config, server = _launch_settings(args)
    logging.basicConfig(level=str(server["log_level"]).upper())
    if server["api_key"] is None:
        server["api_key"] = os.environ.get("RADIXRT_API_KEY") or None
    if server["host"] not in ("127.0.0.1", "localhost", "::1") and not server["api_key"]:
        print(f"radixrt: warning: listening on {server['host']} without --api-key: anyone who can "
              "reach this port may use the server", file=sys.stderr)
    return Launcher(config, server).run()


def _curve_keygen(args: argparse.Namespace) -> int:
    """Write server.key / server.key_secret into the folder (zmq.auth's certificate files)."""
    import zmq.auth
    os.makedirs(args.folder, exist_ok=True)
    public_file, _ = zmq.auth.create_certificates(args.folder, "server")
    os.chmod(os.path.join(args.folder, "server.key_secret"), 0o600)
    public = zmq.auth.load_certificate(public_file)[0].decode()
    print(f"wrote {args.folder}/server.key (public) and server.key_secret (secret)\n"
          f"server: radixrt launch --curve-keys {args.folder} ...\n"
          f"client: Client(addr, curve_server_key={public!r})")
    return 0


def _add_launch_parser(sub) -> None:
    p = sub.add_parser("launch", help="start the server")
    p.add_argument("--model", default=None, help="HF model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--host", default=None, help="default 127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="the ZeroMQ port (default 30000)")
    p.add_argument("--http-port", type=int, default=None,
                   help="the OpenAI-compatible HTTP API's port (default 8000; 0: no HTTP)")
    p.add_argument("--served-model-name", default=None,
                   help="the model's name in the HTTP API (default: the model folder's name)")
    p.add_argument("--config", default=None, help="a TOML file (configs/NAME.toml); flags override it")
    p.add_argument("--dtype", default=None)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--schedule-policy", default=None)
    p.add_argument("--disable-radix-cache", action="store_true", default=None)
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--max-waiting-requests", type=int, default=None,
                   help="refuse new requests with 'overloaded' past this many waiting")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--enable-torch-compile", action="store_true", default=None,
                   help="compile the model's forward with torch.compile (slower start, faster steps)")
    p.add_argument("--log-level", default=None, help="default warning")
    p.add_argument("--grace-period", type=float, default=None,
                   help="on SIGTERM, seconds to let running requests finish (default 30)")
    p.add_argument("--max-message-bytes", type=int, default=None,
                   help="refuse client messages larger than this (default 16 MiB)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="refuse longer prompts (default: the model's context)")
    p.add_argument("--max-new-tokens-limit", type=int, default=None,
                   help="refuse requests asking for more max_new_tokens (default 32768)")
    p.add_argument("--max-requests-per-client", type=int, default=None,
                   help="requests one client may have in flight (default 256)")
    p.add_argument("--api-key", default=None,
                   help="require this key on every request (default: $RADIXRT_API_KEY)")
    p.add_argument("--isolate-by-api-key", action="store_true", default=None,
                   help="salt each request's prefix cache with its API key")
    p.add_argument("--curve-keys", default=None,
                   help="CurveZMQ: a folder made by `radixrt curve-keygen` (server.key_secret)")
    p.add_argument("--max-forward-failures", type=int, default=None,
                   help="consecutive forward-pass failures before the server exits (default 3)")
    p.add_argument("--debug-faults", default=None, help=argparse.SUPPRESS)  # tests only


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="radixrt", description="prefix-caching LLM runtime")
    sub = ap.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion (in-process, or from --server)")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="HF model folder (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--server", default=None, help="tcp://HOST:PORT of a running server")
    gen.add_argument("--timeout", type=float, default=300.0)
    gen.add_argument("--api-key", default=None, help="with --server (default: $RADIXRT_API_KEY)")
    gen.add_argument("--curve-server-key", default=None,
                     help="with --server: the server's CurveZMQ public key (Z85) or server.key file")
    _add_launch_parser(sub)
    keygen = sub.add_parser("curve-keygen", help="create CurveZMQ key pairs for --curve-keys")
    keygen.add_argument("folder")
    args = ap.parse_args(argv)
    commands = {"launch": _launch, "generate": _generate, "curve-keygen": _curve_keygen}
    try:
        return commands[args.command](args)
    except (ValueError, FileNotFoundError, RuntimeError, TimeoutError) as e:
        print(f"radixrt: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
