"""The ``radixrt`` command line.

    radixrt generate [--model PATH] [--chat] [--max-new-tokens N] [--temperature T] "prompt"

runs the offline Engine in this process (the default model when --model is
not given) and prints the completion; with ``--server tcp://HOST:PORT`` it
streams the completion from a running server instead.

    radixrt launch [--model PATH] [--host H] [--port P] [--config configs/NAME.toml] ...

starts the server (see ``radixrt.server``). Its flags are generated from the
fields of ``radixrt.config.EngineConfig`` and ``ServerConfig`` (SGLang's names);
a TOML file may set any field, the environment some (``RADIXRT_API_KEY``), and
flags override both (``radixrt.config.load_config``). ``--speculative-algorithm NGRAM``
(with ``--speculative-num-draft-tokens N`` and the ``--speculative-ngram-*`` settings)
turns on speculative decoding (``radixrt.scheduler.speculative``).

    radixrt curve-keygen FOLDER

writes a CurveZMQ key pair for ``radixrt launch --curve-keys FOLDER``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from radixrt.config import EngineConfig, ServerConfig, field_types, launch_fields, load_config


def _generate(args: argparse.Namespace) -> int:
    if args.server:
        return _generate_remote(args)
    from radixrt import Engine, SamplingParams

    eng = Engine(model=args.model, dtype=args.dtype)
    prompt = args.prompt
    if args.chat:
        prompt = eng.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    out = eng.generate(prompt, sp)[0]
    print(out.text)
    print(
        f"[{len(out.token_ids)} tokens, finish: {out.finish_reason}, model: {eng.model_path}]",
        file=sys.stderr,
    )
    return 0


def _generate_remote(args: argparse.Namespace) -> int:
    from radixrt.client import Client

    sp = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    kwargs = (
        {"messages": [{"role": "user", "content": args.prompt}]}
        if args.chat
        else {"prompt": args.prompt}
    )
    n, last = 0, None
    with Client(
        args.server,
        timeout=args.timeout,
        api_key=args.api_key,
        curve_server_key=args.curve_server_key,
    ) as client:
        for chunk in client.generate(sampling_params=sp, stream=True, **kwargs):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            n += len(chunk.token_ids)
            last = chunk
    print()
    print(
        f"[{n} tokens, finish: {last.finish_reason}, cached: {last.cached_tokens}, "
        f"server: {args.server}]",
        file=sys.stderr,
    )
    return 0


def _launch_settings(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """(EngineConfig, ServerConfig) of parsed ``launch`` arguments (see ``load_config``)."""
    flags = {f.name: getattr(args, f.name, None) for _, f in launch_fields()}
    return load_config(args.config, flags)


def _launch(args: argparse.Namespace) -> int:
    import logging

    from radixrt.server.launcher import Launcher

    config, server = _launch_settings(args)
    logging.basicConfig(level=server.logging_level)
    if not server.loopback and not server.api_keys:
        print(
            f"radixrt: warning: listening on {server.host} without --api-key: anyone who can "
            "reach this port may use the server",
            file=sys.stderr,
        )
    return Launcher(config, server).run()


def _curve_keygen(args: argparse.Namespace) -> int:
    """Write server.key / server.key_secret into the folder (zmq.auth's certificate files)."""
    import zmq.auth

    os.makedirs(args.folder, exist_ok=True)
    public_file, _ = zmq.auth.create_certificates(args.folder, "server")
    os.chmod(os.path.join(args.folder, "server.key_secret"), 0o600)
    public = zmq.auth.load_certificate(public_file)[0].decode()
    print(
        f"wrote {args.folder}/server.key (public) and server.key_secret (secret)\n"
        f"server: radixrt launch --curve-keys {args.folder} ...\n"
        f"client: Client(addr, curve_server_key={public!r})"
    )
    return 0


def _add_launch_parser(sub) -> None:
    """The ``launch`` command: ``--config``, then one flag per field of EngineConfig and
    ServerConfig (``setting`` metadata: help, flag name, hidden). Every flag defaults to None,
    "not given", so the TOML file and the environment show through (``load_config``)."""
    p = sub.add_parser(
        "launch",
        help="start the server",
        description="Start the server. Settings come from, lowest first: the "
        "defaults, --config, the environment, the flags.",
    )
    p.add_argument(
        "--config",
        default=None,
        help="a TOML file (configs/NAME.toml) setting any of the fields below",
    )
    for cls, title in ((EngineConfig, "engine"), (ServerConfig, "server")):
        group = p.add_argument_group(title)
        for f in dataclasses.fields(cls):
            if f.metadata["cli"]:
                _add_flag(group, field_types(cls)[f.name][0], f)


def _add_flag(group: argparse._ArgumentGroup, base: type, f: dataclasses.Field) -> None:
    flag = f.metadata["flag"] or "--" + f.name.replace("_", "-")
    text = argparse.SUPPRESS if f.metadata["hidden"] else _flag_help(f)
    if base is bool:
        group.add_argument(flag, dest=f.name, action="store_true", default=None, help=text)
    else:
        group.add_argument(flag, dest=f.name, type=base, default=None, help=text)


def _flag_help(f: dataclasses.Field) -> str:
    """The field's help, its choices and its default ("%" escaped for argparse)."""
    text = f.metadata["help"]
    if f.metadata["choices"]:
        text += f"; one of {', '.join(f.metadata['choices'])}"
    default = f.metadata["unset"] if f.default is None else f.default
    if f.metadata["env"]:
        default = f"${f.metadata['env']}, else {default}"
    if f.default is not False:  # a store_true flag is off unless given
        text += f" (default: {default})"
    return text.replace("%", "%%")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    commands = {"launch": _launch, "generate": _generate, "curve-keygen": _curve_keygen}
    try:
        return commands[args.command](args)
    except (ValueError, FileNotFoundError, RuntimeError, TimeoutError) as e:
        print(f"radixrt: error: {e}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    """The ``radixrt`` argument parser: ``generate``, ``launch`` and ``curve-keygen``."""
    ap = argparse.ArgumentParser(prog="radixrt", description="prefix-caching LLM runtime")
    sub = ap.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion (in-process, or from --server)")
    gen.add_argument("prompt")
    gen.add_argument(
        "--model", default=None, help="HF model folder (default: SmolLM2-135M-Instruct)"
    )
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--server", default=None, help="tcp://HOST:PORT of a running server")
    gen.add_argument("--timeout", type=float, default=300.0)
    gen.add_argument("--api-key", default=None, help="with --server (default: $RADIXRT_API_KEY)")
    gen.add_argument(
        "--curve-server-key",
        default=None,
        help="with --server: the server's CurveZMQ public key (Z85) or server.key file",
    )
    _add_launch_parser(sub)
    keygen = sub.add_parser("curve-keygen", help="create CurveZMQ key pairs for --curve-keys")
    keygen.add_argument("folder")
    return ap


if __name__ == "__main__":
    sys.exit(main())
