"""Multi-turn chat: each turn extends the cached conversation."""

from _backend import setup

import radixrt.lang as rl


@rl.function
def chat(s, questions):
    s += rl.system("You are a concise assistant.")
    for i, q in enumerate(questions):
        s += rl.user(q)
        s += rl.assistant(rl.gen(f"answer_{i}", max_tokens=48))


if __name__ == "__main__":
    setup(__doc__)
    state = chat.run(
        questions=[
            "What is a radix tree?",
            "Why does it help an LLM server?",
            "Summarize that in five words.",
        ]
    )
    if state.error:
        raise state.error
    for m in state.messages():
        print(f"[{m['role']}] {m['content']}")
    print("cached tokens of the last turn:", state.get_meta_info("answer_2")["cached_tokens"])
