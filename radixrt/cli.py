"""The ``radixrt`` command line.

    radixrt generate [--model PATH] [--chat] [--max-new-tokens N] [--temperature T] "prompt"

runs the offline Engine in this process (the default model when --model is
not given) and prints the completion. ``radixrt launch`` (the server) arrives
with the serving issue.
"""

from __future__ import annotations

import argparse
import sys


def _generate(args: argparse.Namespace) -> int:
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="radixrt", description="prefix-caching LLM runtime")
    sub = ap.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion in-process")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="HF model folder (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args(argv)
    try:
        return _generate(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"radixrt: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
