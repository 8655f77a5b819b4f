"""Few-shot sentiment classification with ``select`` (choices scored in one shared-prefix call)."""

from _backend import setup

import radixrt.lang as rl

EXAMPLES = [
    ("I loved every minute of it.", "positive"),
    ("Total waste of money.", "negative"),
    ("Works exactly as described, great.", "positive"),
    ("It broke after a day.", "negative"),
]


@rl.function
def classify(s, review):
    s += "Classify the sentiment of each review.\n\n"
    for text, label in EXAMPLES:
        s += f"Review: {text}\nSentiment: {label}\n\n"
    s += f"Review: {review}\nSentiment: "
    s += rl.select("label", choices=["positive", "negative"])


if __name__ == "__main__":
    setup(__doc__)
    reviews = [
        "Absolutely fantastic service.",
        "The screen cracked immediately.",
        "Would buy again.",
    ]
    for review, st in zip(reviews, classify.run_batch([{"review": r} for r in reviews])):
        print(f"{review!r:40} -> {st['label']}  {st.get_meta_info('label')['normalized_logprobs']}")
