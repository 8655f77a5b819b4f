"""The ``radixrt`` command line.

    radixrt generate [--model PATH] [--chat] [--max-new-tokens N] [--temperature T] "prompt"

runs the offline Engine in this process (the default model when --model is
not given) and prints the completion; with ``--server tcp://HOST:PORT`` it
streams the completion from a running server instead.

    radixrt launch [--model PATH] [--host H] [--port P] [--config configs/NAME.toml] ...

starts the server (see ``radixrt.server``); flags mirror the Engine's
arguments (SGLang names); a TOML file may set any of them (and host, port,
max_waiting_requests, log_level); flags override it.
"""

from __future__ import annotations

import argparse
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
    with Client(args.server, timeout=args.timeout) as client:
        for chunk in client.generate(sampling_params=sp, stream=True, **kwargs):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            n += len(chunk.token_ids)
            last = chunk
    print()
    print(f"[{n} tokens, finish: {last.finish_reason}, cached: {last.cached_tokens}, "
          f"server: {args.server}]", file=sys.stderr)
    return 0


SERVER_SETTINGS = {"host": "127.0.0.1", "port": 30000, "max_waiting_requests": None, "log_level": "warning"}
ENGINE_FLAGS = ("model", "dtype", "max_total_tokens", "page_size", "schedule_policy", "disable_radix_cache",
                "chunked_prefill_size", "max_running_requests", "attention_backend")


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
    return EngineConfig(**data), server


def _launch(args: argparse.Namespace) -> int:
    import logging
    from radixrt.server.launcher import Launcher
    config, server = _launch_settings(args)
    logging.basicConfig(level=str(server["log_level"]).upper())
    return Launcher(config, server["host"], server["port"], server["max_waiting_requests"]).run()


def _add_launch_parser(sub) -> None:
    p = sub.add_parser("launch", help="start the server")
    p.add_argument("--model", default=None, help="HF model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--host", default=None, help="default 127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="default 30000")
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
    p.add_argument("--log-level", default=None, help="default warning")


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
    _add_launch_parser(sub)
    args = ap.parse_args(argv)
    try:
        return _launch(args) if args.command == "launch" else _generate(args)
    except (ValueError, FileNotFoundError, RuntimeError, TimeoutError) as e:
        print(f"radixrt: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
