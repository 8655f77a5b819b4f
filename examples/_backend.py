"""Shared by the examples: ``--server tcp://...`` or an in-process Engine (``--model``,
default tiny)."""

from __future__ import annotations

import argparse

import radixrt.lang as rl


def setup(description: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--server", help="tcp://host:port of a radixrt server")
    ap.add_argument("--model", default="tiny", help="'tiny', 'default' or a model path/name")
    args = ap.parse_args()
    if args.server:
        rl.set_default_backend(rl.RuntimeEndpoint(args.server))
    else:
        from radixrt import Engine
        from radixrt.testing import tiny_model_path

        model = {"tiny": tiny_model_path("llama"), "default": None}.get(args.model, args.model)
        rl.set_default_backend(rl.EngineBackend(Engine(model=model)))
    return args
