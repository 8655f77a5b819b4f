"""Tree of thought: nested forks; every branch hits the prefix its parent cached."""

from _backend import setup

import radixrt.lang as rl


@rl.function
def tree_of_thought(s, question, width=2, depth=2):
    s += rl.user(question)
    s += rl.assistant("Let me think step by step.\n")
    frontier = [s]
    for level in range(depth):
        children = []
        for node in frontier:
            forks = node.fork(width)
            for i, f in enumerate(forks):
                f += f"Idea {level}.{i}: "
                f += rl.gen("idea", max_tokens=24, stop="\n", temperature=0.8, seed=level * 10 + i)
                f += "\n"
            children.extend(forks)
        frontier = children
    for leaf in frontier:
        leaf += "Is this line of reasoning sound? "
        leaf += rl.select("verdict", choices=["yes", "no"])
    s.meta["leaves"] = frontier


if __name__ == "__main__":
    setup(__doc__)
    state = tree_of_thought.run(question="How can I make a slow web page faster?")
    if state.error:
        raise state.error
    for leaf in state.meta["leaves"]:
        print("-" * 60)
        print(leaf.text().split("step by step.\n", 1)[1].strip())
        print(
            "cached:",
            leaf.get_meta_info("idea")["cached_tokens"],
            "prompt:",
            leaf.get_meta_info("idea")["prompt_tokens"],
        )
