"""Speculative decoding (``--speculative-algorithm NGRAM``) against plain decoding, and
llama.cpp's ``llama-server`` with and without its n-gram speculation (issue 36's benchmark).

Every target serves the same GGUF file (default: the default model's Q4_1 file) and gets the
same chat-formatted text prompts over ``/v1/chat/completions``: streamed, greedy, each
request ending at its end of sequence or at ``--max-tokens`` (``--ignore-eos``: always at
``--max-tokens``). The workloads are built here from texts in this file, seeded:

- ``code_edit``: a ~60-line Python file; "rewrite the file with function X renamed to Y";
- ``extract``: a customer's letter; "copy these fields into JSON, quoting the text exactly";
- ``multi_turn``: a conversation whose last turn asks for an earlier answer again, verbatim;
- ``repeat_user``: a second user sends the prompt a first user sent (sent once, all at once
  and unmeasured, before the measured run: radixrt's tree holds the first outputs);
- ``random``: "write a story about <random words>": nothing to copy.

Each workload has ``--prompts`` distinct prompts; a run sends them with at most B in flight
for each B of ``--batches`` (1: one at a time; 8: all eight at once). Every run starts cold
after a warm-up request (radixrt flushes its cache; llama-server is started afresh).

Targets (``--targets``):

- ``radixrt``: ``radixrt launch --model FILE`` plus ``--radixrt-args``;
- ``radixrt-ngram``: the same plus ``--speculative-algorithm NGRAM`` (and
  ``--speculative-num-draft-tokens``, ``--radixrt-spec-args``); skipped, and said so, where
  this radixrt has no speculative decoding;
- ``llama``: ``--llama-server`` on the same file, one slot per request in flight, plus
  ``--llama-args`` (default on an AMX CPU: ``--no-repack``);
- ``llama-<type>``: the same with ``--spec-type <type>`` (``LLAMA_SPEC_TYPES``) plus
  ``--llama-spec-args``; the best type (its geometric-mean speedup over ``llama``, on the
  repetitive workloads) is the one radixrt is held against.

The radixrt servers stay up through the run (idle, they take no CPU); a llama-server runs
only during its own runs. The targets take turns on each workload and batch, so the runs
compared are made close together.

Reports per workload x batch x target (best of ``--repeats`` by wall time): output tokens/s,
its ratio to the same server without speculation, tokens per decode step (``1 + accepted /
steps``: radixrt from its ``spec_*`` counters, llama-server from ``timings.draft_n_accepted``),
radixrt's mean accepted length as SGLang defines it (``(accepted + verify_ct) / verify_ct``),
the share of draft tokens accepted, TTFT p50 and ITL p50 / p99 (per streamed chunk; a chunk
may carry several tokens) and how copyable the outputs were (the share of their word 4-grams
seen before, in the prompt or earlier in the output: a greedy small model may loop, so even
``random``'s outputs can repeat themselves); the issue's targets with PASS or FAIL
(``checks``); the requests whose text differs with and without speculation, per server
(greedy: none should). Writes ``bench/results/speculative.json`` (with the plain targets'
outputs), a Markdown table on stdout and a PNG (with matplotlib).

    python bench/speculative.py --scale 0.25 --targets radixrt,llama,llama-ngram-simple
    python bench/speculative.py --repeats 2 --speculative-num-draft-tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import peers  # noqa: E402  (llama-server groups, checks, machine)
import quantized  # noqa: E402  (the default GGUF file and llama-server path)
import routing  # noqa: E402  (radixrt launched as a subprocess)
import serving  # noqa: E402  (the HTTP backend, its Record, percentiles)

RESULTS = peers.RESULTS
WORKLOADS = ("code_edit", "extract", "multi_turn", "repeat_user", "random")
REPETITIVE = ("code_edit", "extract", "multi_turn", "repeat_user")
LLAMA_SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
RADIXRT, RADIXRT_SPEC, LLAMA = "radixrt", "radixrt-ngram", "llama"
TARGETS = (RADIXRT, RADIXRT_SPEC, LLAMA, *(f"{LLAMA}-{t}" for t in LLAMA_SPEC_TYPES))
BASELINE = {RADIXRT_SPEC: RADIXRT} | {f"{LLAMA}-{t}": LLAMA for t in LLAMA_SPEC_TYPES}
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
MAX_TOKENS = 256
COPY_GRAM = 4  # words per n-gram of the outputs' ``copyable`` share
WARM_UP = [{"role": "user", "content": "Say hello."}]
BATCH1_SPEEDUP, BATCHED_SPEEDUP, RANDOM_FLOOR = 2.0, 1.3, 0.97  # the targets


# ------------------------------------------------------------------ texts

# Python functions for ``code_edit``: (names it may have, its code with NAME, a call of it).
FUNCTIONS = (
    (
        ("read_lines", "load_lines", "file_lines"),
        '''def NAME(path):
    """Return the lines of a text file, without their newlines."""
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\\n") for line in f]''',
        'NAME("notes.txt")',
    ),
    (
        ("chunked", "split_chunks", "batches_of"),
        '''def NAME(items, size):
    """Split a list into chunks of at most ``size`` items."""
    if size < 1:
        raise ValueError(f"size must be at least 1, got {size}")
    return [items[i : i + size] for i in range(0, len(items), size)]''',
        "NAME(list(range(10)), 3)",
    ),
    (
        ("count_words", "word_counts", "tally_words"),
        '''def NAME(words):
    """Count how often each word occurs, ignoring case."""
    counts = {}
    for word in words:
        key = word.lower()
        counts[key] = counts.get(key, 0) + 1
    return counts''',
        'NAME("the cat saw The dog".split())',
    ),
    (
        ("mean_and_max", "summarize_values", "value_stats"),
        '''def NAME(values):
    """Return the mean and the largest value of a non-empty list."""
    if not values:
        raise ValueError("no values")
    total = sum(values)
    return total / len(values), max(values)''',
        "NAME([3, 1, 4, 1, 5])",
    ),
    (
        ("wrap_text", "fill_lines", "break_lines"),
        '''def NAME(text, width=72):
    """Wrap text into lines of at most ``width`` characters."""
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    if line:
        lines.append(line)
    return lines''',
        'NAME("a b c " * 30, 20)',
    ),
    (
        ("is_valid_record", "check_record", "record_ok"),
        '''def NAME(record):
    """Check that a record has a name and a positive quantity."""
    if not record.get("name"):
        return False
    quantity = record.get("quantity", 0)
    return isinstance(quantity, int) and quantity > 0''',
        'NAME({"name": "bolt", "quantity": 4})',
    ),
    (
        ("write_csv", "save_rows", "dump_rows"),
        '''def NAME(path, rows):
    """Write rows as comma-separated lines."""
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(",".join(str(cell) for cell in row) + "\\n")''',
        'NAME("out.csv", [[1, 2], [3, 4]])',
    ),
    (
        ("apply_discount", "discounted", "reduce_prices"),
        '''def NAME(prices, rate):
    """Apply a discount rate to every price, rounded to cents."""
    return [round(price * (1.0 - rate), 2) for price in prices]''',
        "NAME([9.99, 20.0], 0.15)",
    ),
    (
        ("format_duration", "as_clock", "hms"),
        '''def NAME(seconds):
    """Format a duration in seconds as hours, minutes and seconds."""
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours:02d}:{minutes:02d}:{seconds:02d}"''',
        "NAME(3725)",
    ),
    (
        ("reachable", "breadth_first", "walk_graph"),
        '''def NAME(graph, start):
    """Return the nodes reachable from ``start``, in breadth-first order."""
    seen, queue = [start], [start]
    while queue:
        node = queue.pop(0)
        for nxt in graph.get(node, ()):
            if nxt not in seen:
                seen.append(nxt)
                queue.append(nxt)
    return seen''',
        'NAME({"a": ["b", "c"], "b": ["d"]}, "a")',
    ),
    (
        ("slugify", "make_slug", "to_slug"),
        '''def NAME(text):
    """Turn a title into a lowercase slug of letters, digits and dashes."""
    out = []
    for ch in text.lower():
        if ch.isalnum():
            out.append(ch)
        elif out and out[-1] != "-":
            out.append("-")
    return "".join(out).strip("-")''',
        'NAME("Hello, World: 2024 Edition")',
    ),
    (
        ("merge_sorted", "merge_lists", "combine_sorted"),
        '''def NAME(a, b):
    """Merge two sorted lists into one sorted list."""
    i = j = 0
    out = []
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out + a[i:] + b[j:]''',
        "NAME([1, 4, 9], [2, 3, 10])",
    ),
)
FUNCTIONS_PER_FILE = 5
MODULE_TOPICS = ("inventory reports", "text utilities", "order processing", "log files")

# Pieces of the customer letters for ``extract``.
FIRST = ("Maria", "James", "Aiko", "Oliver", "Fatima", "Lukas", "Priya", "Sofia", "Daniel")
LAST = ("Okafor", "Lindqvist", "Moreau", "Tanaka", "Brennan", "Castillo", "Novak", "Haddad")
STREETS = ("Elm Street", "Harbour Road", "Kestrel Lane", "Mill Avenue", "Quarry Close")
CITIES = ("Leeds LS2 7QT", "Bristol BS1 4DJ", "Dublin D08 X2Y5", "Aberdeen AB10 1XG")
PRODUCTS = (
    "ceramic table lamp with a linen shade",
    "stainless steel kettle, 1.7 litres",
    "oak bookshelf with five shelves",
    "set of six blue enamel mugs",
    "wool throw blanket in forest green",
    "cast iron frying pan, 28 cm",
)
PROBLEMS = (
    "the base of the item was cracked along one side and the box was wet",
    "two of the pieces were missing and the assembly guide was for a different model",
    "the item was the wrong colour and had scratches across the top",
    "the glass panel was shattered and there were shards loose in the packaging",
)
REMEDIES = (
    "a full refund to my original payment method",
    "a replacement sent by express delivery, at no extra cost",
    "the missing parts posted to me this week",
    "someone to collect the damaged item and exchange it",
)
EXTRAS = (
    "I have kept the packaging and taken photographs of the damage.",
    "This is the second time an order from your shop has arrived in this state.",
    "The courier left the parcel outside in the rain without ringing the bell.",
    "I needed the item for a family visit this weekend, so I am quite disappointed.",
)
EXTRACT_FIELDS = (
    "name",
    "email",
    "order_number",
    "product",
    "quantity",
    "address",
    "problem",
    "requested_remedy",
    "phone",
)

# Earlier answers for ``multi_turn``: (topic, question, answer).
ANSWERS = (
    (
        "tea",
        "How is green tea different from black tea?",
        "Green tea and black tea come from the same plant, Camellia sinensis. The difference "
        "is in how the leaves are processed. For green tea, the leaves are heated soon after "
        "picking, by steaming or pan firing, which stops the enzymes that would darken them, "
        "so the tea keeps a fresh, grassy taste and a pale colour. For black tea, the leaves "
        "are rolled and left to oxidise fully before drying, which turns them dark and gives "
        "the tea a stronger, maltier flavour and more colour in the cup.",
    ),
    (
        "bicycle gears",
        "Why do bicycles have gears?",
        "Gears let a rider keep pedalling at a comfortable speed while the road changes. On a "
        "steep hill, a low gear means each turn of the pedals moves the bike a short distance, "
        "so the effort per stroke is small. On flat ground or downhill, a high gear means each "
        "turn moves the bike much further, so the rider can go faster without spinning the "
        "pedals wildly. The chain moves between sprockets of different sizes at the front and "
        "the back, and the ratio of their teeth sets how hard each stroke feels.",
    ),
    (
        "lighthouses",
        "How did lighthouses help ships at night?",
        "A lighthouse marks a dangerous coast or the entrance to a harbour with a bright light "
        "that sailors can see from far out at sea. Each lighthouse has its own pattern of "
        "flashes, called its character, so a navigator who counts the flashes and the dark "
        "gaps can tell which lighthouse it is and find the ship's position on the chart. Large "
        "Fresnel lenses, made of rings of glass prisms, gather the light of a single lamp into "
        "a narrow beam that can be seen more than twenty miles away.",
    ),
    (
        "honeybees",
        "How do honeybees tell each other where flowers are?",
        "A forager bee that finds a good patch of flowers returns to the hive and performs a "
        "waggle dance on the comb. The direction of the straight waggle run, measured against "
        "the vertical, shows the direction of the flowers relative to the sun. The length of "
        "the waggle run tells the other bees how far away the flowers are, with longer runs "
        "meaning longer flights. The dancer also shares the scent of the flowers, which helps "
        "the recruits recognise the right place when they arrive.",
    ),
    (
        "volcanoes",
        "Why do some volcanoes explode while others flow gently?",
        "It depends mostly on the magma. Runny magma that is low in silica, like the basalt of "
        "Hawaii, lets gas bubbles escape easily, so it pours out as lava flows that are "
        "dangerous but rarely explosive. Thick magma that is rich in silica traps the gas, and "
        "the pressure builds until the rock above gives way. The gas then expands suddenly and "
        "shatters the magma into ash and pumice, which is why volcanoes like Mount St. Helens "
        "erupt with such violence.",
    ),
    (
        "libraries",
        "How do libraries organise their books?",
        "Most public libraries use a classification system that gives every book a call "
        "number based on its subject. In the Dewey Decimal system, the numbers from 000 to 999 "
        "are split into ten main classes, such as 500 for science and 900 for history and "
        "geography, and each class is divided again and again into narrower topics. The call "
        "number is printed on the spine, and the books stand on the shelves in numerical "
        "order, so books on the same subject sit next to each other.",
    ),
    (
        "sourdough",
        "What makes sourdough bread rise?",
        "Sourdough rises because of a starter, a mixture of flour and water that is home to "
        "wild yeasts and lactic acid bacteria. The yeasts eat the sugars in the flour and "
        "release carbon dioxide, which gets trapped in the gluten network of the dough and "
        "makes it swell. The bacteria produce lactic and acetic acids, which give the bread "
        "its sour taste and help it keep longer. Because the wild yeasts work slowly, the "
        "dough needs many hours to rise, often overnight.",
    ),
    (
        "tides",
        "What causes the tides?",
        "Tides are caused mainly by the pull of the Moon's gravity on the oceans. The Moon "
        "pulls hardest on the side of the Earth facing it, so the water there bulges towards "
        "the Moon, and a second bulge forms on the far side, where the pull is weakest. As the "
        "Earth turns, each coast passes through both bulges, which gives most places two high "
        "tides and two low tides a day. When the Sun and the Moon line up, their pulls add "
        "together and the tides are higher, which are called spring tides.",
    ),
)
REPEAT_ASKS = (
    "Please repeat your first answer, word for word.",
    "Can you give me your answer about {topic} again, exactly as you wrote it?",
    "Copy your earlier answer about {topic} here again, verbatim.",
)

# Questions for ``repeat_user`` (each asked by two users, one after the other).
QUESTIONS = (
    "Explain how a refrigerator keeps food cold, step by step.",
    "Explain how compound interest works, with a small example.",
    "Explain how a hash table stores and finds values.",
    "Explain how plants make their food by photosynthesis.",
    "Write a short guide to planting tomatoes in a garden.",
    "Explain how vaccines train the immune system.",
    "Write a short guide to preparing for a job interview.",
    "Explain how a bicycle stays upright while it moves.",
    "Write a short guide to keeping a sourdough starter alive.",
)

# Words for ``random``.
ADJECTIVES = (
    "silver", "anxious", "tiny", "forgotten", "clockwork", "sleepy", "brave", "purple",
    "ancient", "noisy", "gentle", "frozen", "curious", "invisible", "lonely", "golden",
)  # fmt: skip
NOUNS = (
    "otter", "librarian", "teapot", "lighthouse keeper", "robot", "violin", "glacier",
    "baker", "comet", "umbrella", "fox", "submarine", "gardener", "dragon", "kite", "moth",
)  # fmt: skip
PLACES = (
    "a desert town", "the bottom of the sea", "a busy train station", "a snowy mountain",
    "an abandoned factory", "a floating market", "the moon", "a rainy island",
)  # fmt: skip


# -------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Prompt:
    messages: list[dict]
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[Prompt]
    first_pass: bool = False  # the prompts are sent once, unmeasured, before the run


def chat(user: str, *turns: str) -> list[dict]:
    """A conversation: the system prompt, ``user``, then alternating assistant/user turns."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    for i, text in enumerate(turns):
        messages.append({"role": "assistant" if i % 2 == 0 else "user", "content": text})
    return messages


def code_file(rng: random.Random) -> tuple[str, str, str]:
    """(a Python file of FUNCTIONS_PER_FILE functions and a main, a function's name, a new
    name for it)."""
    picked = rng.sample(FUNCTIONS, FUNCTIONS_PER_FILE)
    names = [rng.choice(names) for names, _, _ in picked]
    topic = rng.choice(MODULE_TOPICS)
    parts = [f'"""Small helpers for {topic}."""\n\nimport sys']
    parts += [code.replace("NAME", n) for (_, code, _), n in zip(picked, names)]
    calls = [f"    print({call.replace('NAME', n)})" for (_, _, call), n in zip(picked, names)]
    parts.append("def main():\n" + "\n".join(calls) + "\n    return 0")
    parts.append('if __name__ == "__main__":\n    sys.exit(main())\n')
    k = rng.randrange(FUNCTIONS_PER_FILE)
    new = rng.choice([n for n in picked[k][0] if n != names[k]])
    return "\n\n\n".join(parts), names[k], new


def code_edit(rng: random.Random, n: int, max_tokens: int) -> Workload:
    prompts = []
    for _ in range(n):
        text, old, new = code_file(rng)
        ask = (
            f"Rewrite the following Python file with the function `{old}` renamed to `{new}`, "
            "in its definition and in every call. Reply with the whole file and nothing "
            f"else.\n\n```python\n{text}```"
        )
        prompts.append(Prompt(chat(ask), max_tokens))
    return Workload("code_edit", prompts)


def letter(rng: random.Random) -> str:
    """A customer's complaint about an order, with every field of EXTRACT_FIELDS in it."""
    first, last = rng.choice(FIRST), rng.choice(LAST)
    order = f"{rng.choice('ABCDEFGH')}{rng.randrange(10**6, 10**7)}"
    ordered = f"{rng.randrange(1, 28)} {rng.choice(('March', 'April', 'May', 'June'))} 2024"
    return (
        f"From: {first} {last} <{first.lower()}.{last.lower()}@example.com>\n"
        f"Subject: Order {order} arrived damaged\n\n"
        f"Hello,\n\nI ordered {rng.randrange(1, 5)} x {rng.choice(PRODUCTS)} on {ordered} "
        f"(order {order}), to be delivered to {rng.randrange(2, 120)} {rng.choice(STREETS)}, "
        f"{rng.choice(CITIES)}. The parcel arrived today, but {rng.choice(PROBLEMS)}. "
        f"{rng.choice(EXTRAS)}\n\nI would like {rng.choice(REMEDIES)}. You can reach me on "
        f"07{rng.randrange(10**8, 10**9)} on weekdays after {rng.randrange(4, 7)} pm.\n\n"
        f"Kind regards,\n{first} {last}\n"
    )


def extract(rng: random.Random, n: int, max_tokens: int) -> Workload:
    fields = ", ".join(f'"{f}"' for f in EXTRACT_FIELDS)
    prompts = []
    for _ in range(n):
        ask = (
            f"Copy the following fields from the letter below into a JSON object: {fields}. "
            "Quote the text of the letter exactly, without changing a word.\n\n"
            f"Letter:\n{letter(rng)}"
        )
        prompts.append(Prompt(chat(ask), max_tokens))
    return Workload("extract", prompts)


def multi_turn(rng: random.Random, n: int, max_tokens: int) -> Workload:
    prompts = []
    for i in range(n):
        topic, question, answer = ANSWERS[i % len(ANSWERS)]
        _, question2, answer2 = rng.choice([a for a in ANSWERS if a[0] != topic])
        ask = REPEAT_ASKS[i % len(REPEAT_ASKS)].format(topic=topic)
        prompts.append(Prompt(chat(question, answer, question2, answer2, ask), max_tokens))
    return Workload("multi_turn", prompts)


def repeat_user(rng: random.Random, n: int, max_tokens: int) -> Workload:
    questions = rng.sample(QUESTIONS, min(n, len(QUESTIONS)))
    questions += [f"{rng.choice(QUESTIONS)} ({i})" for i in range(n - len(questions))]
    return Workload("repeat_user", [Prompt(chat(q), max_tokens) for q in questions], True)


def random_story(rng: random.Random, n: int, max_tokens: int) -> Workload:
    prompts = []
    for _ in range(n):
        a, b = rng.sample(ADJECTIVES, 2)
        x, y = rng.sample(NOUNS, 2)
        ask = (
            f"Write a story about a {a} {x} and a {b} {y} who meet in {rng.choice(PLACES)}, "
            f"with the words {', '.join(rng.sample(ADJECTIVES + NOUNS, 3))} in it."
        )
        prompts.append(Prompt(chat(ask), max_tokens))
    return Workload("random", prompts)


BUILDERS = {
    "code_edit": code_edit,
    "extract": extract,
    "multi_turn": multi_turn,
    "repeat_user": repeat_user,
    "random": random_story,
}


def make_workload(name: str, n: int, max_tokens: int, seed: int) -> Workload:
    """The named workload's ``n`` prompts, the same for every target."""
    if name not in BUILDERS:
        raise ValueError(f"unknown workload {name!r} (one of {', '.join(WORKLOADS)})")
    return BUILDERS[name](random.Random(f"{seed}:{name}"), n, max_tokens)


def scaled_tokens(max_tokens: int, scale: float) -> int:
    return max(8, round(max_tokens * scale))


# ----------------------------------------------------------------- client


@dataclass
class SpecRecord(serving.Record):
    spec: dict[str, int] = field(default_factory=dict)  # accepted, drafted, verify_ct


SPEC_NAMES = (
    ("accepted", "spec_accepted_tokens"),
    ("drafted", "spec_draft_tokens"),
    ("verify_ct", "spec_verify_ct"),
)


def spec_counters(chunk: dict) -> dict[str, int]:
    """The speculative counters a response chunk carries: radixrt's (SGLang's ``meta_info``
    names, at the top level, in ``usage``, ``meta_info`` or a choice) and llama-server's
    (``timings.draft_n``, ``draft_n_accepted``), as accepted / drafted / verify_ct."""
    out: dict[str, int] = {}
    places = [chunk, chunk.get("usage"), chunk.get("meta_info"), *(chunk.get("choices") or ())]
    for place in (p for p in places if isinstance(p, dict)):
        for ours, theirs in SPEC_NAMES:
            if isinstance(place.get(theirs), int):
                out[ours] = place[theirs]
    timings = chunk.get("timings") or {}
    if isinstance(timings.get("draft_n"), int):
        out["drafted"], out["accepted"] = timings["draft_n"], timings.get("draft_n_accepted", 0)
    return out


class ChatBackend(serving.OpenAIBackend):
    """Streamed /v1/chat/completions; a chunk brings tokens when it brings text (not a
    role-only opening chunk); the counters of ``spec_counters`` are kept in the record. Each
    request has its own connection (llama-server may close a kept-alive one under a request
    sent on it)."""

    def __init__(self, server: str, timeout: float) -> None:
        super().__init__(server, timeout, chat=True)

    async def __aenter__(self):
        import aiohttp

        self.http = aiohttp.ClientSession(
            self.server,
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
        )
        return self

    async def request(
        self, kwargs: dict, sp: dict, stream: bool, rec: serving.Record | None = None
    ) -> tuple[SpecRecord, str]:
        rec = rec if isinstance(rec, SpecRecord) else SpecRecord()
        text, t0 = [], time.perf_counter()
        last = t0
        async with self.http.post(self.path, json=self.body(kwargs, sp, True)) as resp:
            resp.raise_for_status()
            async for raw in resp.content:  # one SSE line at a time
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    raise RuntimeError(data["error"].get("message", data["error"]))
                now = time.perf_counter()
                piece = "".join(self.text_of(c) for c in data.get("choices") or ())
                if piece:
                    if text:
                        rec.itl.append(now - last)
                    else:
                        rec.ttft = now - t0
                    last = now
                    text.append(piece)
                if data.get("usage"):
                    self._usage(rec, data["usage"])
                rec.spec.update(spec_counters(data))
        return rec, "".join(text)

    @staticmethod
    def _usage(rec: serving.Record, usage: dict) -> None:
        rec.prompt_tokens, rec.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
        rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


class Sample(NamedTuple):
    rec: SpecRecord
    text: str


def sampling(p: Prompt, ignore_eos: bool) -> dict:
    return {"max_new_tokens": p.max_tokens, "temperature": 0.0, "ignore_eos": ignore_eos}


async def run_batch(
    backend: ChatBackend, prompts: list[Prompt], batch: int, ignore_eos: bool
) -> tuple[list[Sample], float]:
    """The prompts with at most ``batch`` in flight, in order; (samples, wall s)."""
    sem = asyncio.Semaphore(batch)
    t0 = time.perf_counter()

    async def one(p: Prompt) -> Sample:
        async with sem:
            kwargs = {"messages": p.messages}
            return Sample(*await serving.one_request(backend, kwargs, sampling(p, ignore_eos)))

    samples = await asyncio.gather(*(one(p) for p in prompts))
    return list(samples), time.perf_counter() - t0


# ---------------------------------------------------------------- targets


class Target:
    """A server configuration reached at ``url`` (set by ``start``)."""

    name = ""
    url = ""
    omits_zero_counters = False  # speculates, and sends no counters for a request with no draft

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def backend(self) -> ChatBackend:
        return ChatBackend(self.url, self.args.timeout)

    async def warm_up(self) -> None:
        async with self.backend() as b:
            p = Prompt([{"role": "system", "content": SYSTEM}, *WARM_UP], 4)
            rec, _ = await serving.one_request(b, {"messages": p.messages}, sampling(p, False))
        if rec.error:
            raise RuntimeError(f"{self.name}: the warm-up request failed: {rec.error}")

    def idle(self) -> None:
        """Between its runs (a server that starts afresh for each run stops here)."""

    async def run(self, wl: Workload, batch: int) -> tuple[list[Sample], float]:
        """The workload at ``batch``, from a cold cache (repeat_user: after its first pass)."""
        await self.prepare()
        try:
            async with self.backend() as b:
                if wl.first_pass:
                    n = len(wl.prompts)
                    first, _ = await run_batch(b, wl.prompts, n, self.args.ignore_eos)
                    bad = [s.rec.error for s in first if s.rec.error]
                    if bad:
                        raise RuntimeError(f"{wl.name}'s first pass failed: {bad[0]}")
                return await run_batch(b, wl.prompts, batch, self.args.ignore_eos)
        finally:
            self.idle()


class RadixrtTarget(Target):
    """``radixrt launch --model FILE`` plus ``--radixrt-args`` (and the speculative flags)."""

    def __init__(self, name: str, args: argparse.Namespace, extra: list[str]) -> None:
        super().__init__(args)
        self.name, self.extra = name, extra
        self.server: routing.Launched | None = None

    def start(self) -> None:
        shape = argparse.Namespace(dtype="auto", model=self.args.gguf)
        flags = [*shlex.split(self.args.radixrt_args), *self.extra]
        self.server = routing.Launched(shape, *flags)
        self.url = self.server.http

    async def prepare(self) -> None:
        await self.warm_up()
        httpx.post(self.url + "/flush_cache", timeout=60).raise_for_status()

    def info(self) -> dict:
        info = httpx.get(self.url + "/server_info", timeout=30).json()
        return {"flags": self.extra, **info.get("internal_states", [{}])[0]}

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


class LlamaTarget(Target):
    """llama-server on the same file (``peers.LlamaGroup``), restarted for every cold start."""

    def __init__(self, name: str, args: argparse.Namespace, extra: str, slots: int, ctx: int):
        super().__init__(args)
        self.name = name
        shape = argparse.Namespace(**{**vars(args), "llama_args": f"{args.llama_args} {extra}"})
        self.group = peers.LlamaGroup(args.gguf, shape, slots, ctx)
        self.group.name = self.group.label = name  # its log: peers_logs/<name>.log
        self.omits_zero_counters = name != LLAMA  # timings.draft_n only once it drafted

    def start(self) -> None:
        self.group.restart()
        self.url = self.group.url

    async def prepare(self) -> None:
        self.start()
        await self.warm_up()

    def info(self) -> dict:
        props = httpx.get(self.url + "/props", timeout=30).json()
        keys = ("build_info", "total_slots", "model_path")
        return {"flags": self.group.proc.cmd[1:]} | {k: props.get(k) for k in keys}

    def idle(self) -> None:
        self.group.stop()

    def stop(self) -> None:
        self.group.stop()


def radixrt_speculates() -> bool:
    """Whether this radixrt has ``--speculative-algorithm`` (EngineConfig's field)."""
    from radixrt.config import EngineConfig

    return any(f.name == "speculative_algorithm" for f in dataclasses.fields(EngineConfig))


def make_target(name: str, args: argparse.Namespace, slots: int, ctx: int) -> Target:
    if name == RADIXRT:
        return RadixrtTarget(name, args, [])
    if name == RADIXRT_SPEC:
        spec = ["--speculative-algorithm", "NGRAM"]
        if args.speculative_num_draft_tokens is not None:
            spec += ["--speculative-num-draft-tokens", str(args.speculative_num_draft_tokens)]
        return RadixrtTarget(name, args, spec + shlex.split(args.radixrt_spec_args))
    if name == LLAMA:
        return LlamaTarget(name, args, "", slots, ctx)
    spec_type = name.removeprefix(f"{LLAMA}-")
    return LlamaTarget(name, args, f"--spec-type {spec_type} {args.llama_spec_args}", slots, ctx)


def llama_context(workloads: list[Workload], lengths: dict[str, int], batch: int):
    """(slots, context) for llama-server: a slot per request in flight, each holding the
    longest prompt and its output."""
    per_slot = max(lengths[w.name] + max(p.max_tokens for p in w.prompts) for w in workloads)
    return batch, batch * (per_slot + 128)  # room for a draft past the output's end


def prompt_lengths(workloads: list[Workload], gguf: str) -> dict[str, int]:
    """The longest prompt of each workload in tokens (the model's chat template)."""
    from transformers import AutoTokenizer

    from radixrt.model.default_model import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path(gguf))

    def length(p: Prompt) -> int:
        text = tok.apply_chat_template(p.messages, tokenize=False, add_generation_prompt=True)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    return {w.name: max(map(length, w.prompts)) for w in workloads}


# ---------------------------------------------------------------- summaries


def summarize(samples: list[Sample], wall: float, omits_zero_counters: bool = False) -> dict:
    """One run's figures (s unless the name says ms); the speculative ones None where the
    server reported no counters (``omits_zero_counters``: no counters are zeros)."""
    pct = serving.percentile
    ok = [s for s in samples if s.rec.error is None]
    if omits_zero_counters:
        for s in ok:
            s.rec.spec = {"accepted": 0, "drafted": 0} | s.rec.spec
    out = sum(s.rec.output_tokens for s in ok)
    itl = [x for s in ok for x in s.rec.itl]
    chunks = sum(1 + len(s.rec.itl) for s in ok if s.rec.ttft)
    return {
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "first_error": next((s.rec.error for s in samples if s.rec.error), None),
        "wall_s": wall,
        "output_tokens": out,
        "output_tok_s": out / wall if wall else 0.0,
        "ttft_p50_s": pct([s.rec.ttft for s in ok if s.rec.ttft], 50),
        "itl_p50_ms": 1e3 * pct(itl, 50),
        "itl_p99_ms": 1e3 * pct(itl, 99),
        "tokens_per_chunk": out / chunks if chunks else None,
        "hit_rate": peers.ratio(sum(s.rec.cached_tokens for s in ok), prompt_tokens(ok)),
        **acceptance([s.rec for s in ok]),
    }


def prompt_tokens(samples: list[Sample]) -> int:
    return sum(s.rec.prompt_tokens for s in samples)


def copyable(prompt: str, output: str, n: int = COPY_GRAM) -> float | None:
    """The share of the output's word n-grams that occurred before them, in the prompt or
    earlier in the output: how much of it a draft from the request's own text could copy,
    whatever the server (None: an output shorter than n words)."""
    words = output.split()
    seen = {tuple(g) for g in grams(prompt.split(), n)}
    hits = total = 0
    for g in map(tuple, grams(words, n)):
        hits, total = hits + (g in seen), total + 1
        seen.add(g)
    return hits / total if total else None


def grams(words: list[str], n: int) -> list[list[str]]:
    return [words[i : i + n] for i in range(len(words) - n + 1)]


def copyable_share(wl: Workload, samples: list[Sample]) -> float | None:
    """``copyable`` over a run's outputs, weighted by their length in words."""
    parts = []
    for p, s in zip(wl.prompts, samples):
        share = copyable(" ".join(m["content"] for m in p.messages), s.text)
        if s.rec.error is None and share is not None:
            parts.append((share, len(s.text.split())))
    weight = sum(w for _, w in parts)
    return sum(x * w for x, w in parts) / weight if weight else None


def acceptance(recs: list[SpecRecord]) -> dict:
    """Speculation's figures over requests that reported counters: ``tokens_per_step``
    (1 + accepted draft tokens per decode step; every output token after the first comes
    from a decode step or is an accepted draft token), ``accept_len`` (SGLang's: tokens per
    verifying forward, its own plus the accepted ones) and ``accepted_share`` of drafts."""
    counted = [r for r in recs if r.spec]
    acc = sum(r.spec.get("accepted", 0) for r in counted)
    drafted = sum(r.spec.get("drafted", 0) for r in counted)
    verified = [r.spec["verify_ct"] for r in counted if "verify_ct" in r.spec]
    verify = sum(verified)
    steps = sum(max(0, r.output_tokens - 1 - r.spec.get("accepted", 0)) for r in counted)
    return {
        "spec_accepted": acc if counted else None,
        "spec_drafted": drafted if counted else None,
        "spec_verify_ct": verify if verified else None,
        "tokens_per_step": 1 + acc / steps if steps else None,
        "accept_len": (acc + verify) / verify if verify else None,
        "accepted_share": acc / drafted if drafted else None,
    }


def cell(workload: str, batch: int) -> str:
    return f"{workload}@{batch}"


class Book:
    """Every run's summary and texts, by target and cell (workload @ batch)."""

    def __init__(self) -> None:
        self.runs: dict[str, dict[str, list[dict]]] = {}
        self.texts: dict[str, dict[str, list[list[str | None]]]] = {}  # None: failed

    def add(self, target: Target, wl: Workload, batch: int, samples: list[Sample], wall: float):
        summary = summarize(samples, wall, target.omits_zero_counters)
        summary["copyable"] = copyable_share(wl, samples)
        self.runs.setdefault(target.name, {}).setdefault(cell(wl.name, batch), []).append(summary)
        texts = [None if s.rec.error else s.text for s in samples]
        self.texts.setdefault(target.name, {}).setdefault(cell(wl.name, batch), []).append(texts)
        return summary

    def best(self) -> dict[str, dict[str, dict]]:
        """Each target's shortest run of each cell."""
        return {
            t: {c: min(runs, key=lambda s: s["wall_s"]) for c, runs in per.items()}
            for t, per in self.runs.items()
        }

    def differing(self, spec: str, base: str) -> dict[str, list[int]]:
        """Per cell, the requests whose text was not the same in every run of both targets
        (the runs where a request failed left out)."""
        out = {}
        for c, runs in self.texts.get(spec, {}).items():
            base_runs = self.texts.get(base, {}).get(c)
            if base_runs:
                columns = enumerate(zip(*runs, *base_runs))
                out[c] = [i for i, texts in columns if len(set(texts) - {None}) > 1]
        return out

    def first_text(self, target: str, c: str, i: int) -> str | None:
        """Request ``i``'s text in the first run of ``c`` where it did not fail."""
        return next((run[i] for run in self.texts[target][c] if run[i] is not None), None)

    def first_outputs(self, targets: list[str]) -> dict[str, dict[str, list[str | None]]]:
        """The texts of each target's first run of each cell."""
        return {
            t: {c: runs[0] for c, runs in self.texts[t].items()} for t in targets if t in self.texts
        }

    def differences(self, spec: str, base: str, limit: int = 20) -> list[dict]:
        """The first ``limit`` differing requests' texts, with and without speculation."""
        found = [(c, i) for c, idx in self.differing(spec, base).items() for i in idx]
        return [
            {
                "cell": c,
                "index": i,
                "spec": self.first_text(spec, c, i),
                "plain": self.first_text(base, c, i),
            }
            for c, i in found[:limit]
        ]


# ------------------------------------------------------------------ checks


def geomean(xs: list[float]) -> float | None:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs and min(xs) > 0 else None


def tok_s_ratios(best: dict, a: str, b: str, workloads, batch: int) -> list[float]:
    """a's output tok/s over b's on each workload at ``batch`` both ran."""
    out = []
    for w in workloads:
        x, y = best.get(a, {}).get(cell(w, batch)), best.get(b, {}).get(cell(w, batch))
        if x and y and y["output_tok_s"] > 0:
            out.append(x["output_tok_s"] / y["output_tok_s"])
    return out


def best_llama_spec(best: dict, batches: list[int]) -> str | None:
    """The llama-server speculation type with the highest geometric-mean speedup over
    llama-server without it, on the repetitive workloads at every batch."""
    scores = {}
    for t in (f"{LLAMA}-{s}" for s in LLAMA_SPEC_TYPES if f"{LLAMA}-{s}" in best):
        ratios = [r for b in batches for r in tok_s_ratios(best, t, LLAMA, REPETITIVE, b)]
        if geomean(ratios) is not None:
            scores[t] = geomean(ratios)
    return max(scores, key=scores.get) if scores else None


def checks(book: Book, batches: list[int]) -> list[peers.Check]:
    """The issue's targets that this run can tell (a side missing: not checked)."""
    best, out = book.best(), []
    if RADIXRT_SPEC not in best or RADIXRT not in best:
        return out
    for b in batches:
        bound = BATCH1_SPEEDUP if b == 1 else BATCHED_SPEEDUP
        x = geomean(tok_s_ratios(best, RADIXRT_SPEC, RADIXRT, REPETITIVE, b))
        name = f"repetitive set, batch {b}: NGRAM / plain tok/s (geomean)"
        out.append(peers.Check(name, x, bound, True))
    for b in batches:
        (x,) = tok_s_ratios(best, RADIXRT_SPEC, RADIXRT, ["random"], b) or [None]
        out.append(peers.Check(f"random, batch {b}: NGRAM / plain tok/s", x, RANDOM_FLOOR, True))
    llama = best_llama_spec(best, batches)
    for b in batches if llama else ():
        x = geomean(tok_s_ratios(best, RADIXRT_SPEC, llama, REPETITIVE, b))
        name = f"repetitive set, batch {b}: radixrt NGRAM / {llama} tok/s (geomean)"
        out.append(peers.Check(name, x, 1.0, True))
    differing = sum(map(len, book.differing(RADIXRT_SPEC, RADIXRT).values()))
    out.append(peers.Check("radixrt requests differing with NGRAM", differing, 0, False))
    return out


# ------------------------------------------------------------------ report

COLUMNS = (
    ("tok/s", "output_tok_s", "{:.1f}"),
    ("tok/step", "tokens_per_step", "{:.2f}"),
    ("accept len", "accept_len", "{:.2f}"),
    ("accepted/drafted", "accepted_share", "{:.2f}"),
    ("TTFT p50 s", "ttft_p50_s", "{:.3f}"),
    ("ITL p50 ms", "itl_p50_ms", "{:.1f}"),
    ("ITL p99 ms", "itl_p99_ms", "{:.1f}"),
    ("tok/chunk", "tokens_per_chunk", "{:.2f}"),
    ("copyable", "copyable", "{:.2f}"),
)


def table(book: Book) -> str:
    """Each target's best run per workload and batch, as Markdown, with the speedup over the
    same server without speculation; the last column counts failed requests of every run."""
    best = book.best()
    head = ["workload", "batch", "target", COLUMNS[0][0], "x plain", *(c[0] for c in COLUMNS[1:])]
    lines = ["| " + " | ".join([*head, "errors"]) + " |", "|---" * (len(head) + 1) + "|"]
    cells = sorted({c for per in best.values() for c in per}, key=cell_order)
    for c in cells:
        for t in (t for t in TARGETS if c in best.get(t, {})):
            s, base = best[t][c], best.get(BASELINE.get(t, ""), {}).get(c)
            speedup = peers.ratio(s["output_tok_s"], base["output_tok_s"]) if base else None
            values = [fmt(s[k], f) for _, k, f in COLUMNS]
            errors = sum(r["errors"] for r in book.runs[t][c])
            w, b = c.split("@")
            row = [w, b, t, values[0], fmt(speedup, "{:.2f}"), *values[1:], str(errors)]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def cell_order(c: str) -> tuple[int, int]:
    w, b = c.split("@")
    return (WORKLOADS.index(w) if w in WORKLOADS else len(WORKLOADS), int(b))


def fmt(v: float | None, f: str) -> str:
    return "-" if v is None else f.format(v)


def report(result: dict) -> str:
    m, book = result["machine"], result["book"]
    lines = [
        f"CPU: {m['model_name']} ({', '.join(m['isa'])}); CPUs {m['cpus']}",
        f"command: {result['command']}",
        "longest prompt (tokens): " + ", ".join(f"{w} {n}" for w, n in result["lengths"].items()),
    ]
    lines += [f"{t}: {json.dumps(info)}" for t, info in result["infos"].items()]
    lines += ["", table(book), ""]
    for c in result["checks"]:
        op = ">=" if c.at_least else "<="
        value = fmt(c.value, "{:.3f}")
        lines.append(f"{'PASS' if c.passed else 'FAIL'}  {c.name}: {value} ({op} {c.bound})")
    if result["llama_best"]:
        lines.append(f"llama-server's best n-gram speculation here: {result['llama_best']}")
    for spec, diff in result["differing"].items():
        per = {c: len(idx) for c, idx in diff.items() if idx}
        total = sum(map(len, diff.values()))
        lines.append(f"requests differing with speculation, {spec}: {total} {per or ''}")
    lines += [f"NOTE    {t}: no speculative counters in its responses" for t in silent(book)]
    lines += [f"SKIPPED {t}: {why}" for t, why in result["skipped"].items()]
    lines += [f"FAILED  {t}: {e}" for t, e in result["failures"].items()]
    return "\n".join(lines)


def silent(book: Book) -> list[str]:
    """The speculative targets none of whose responses carried counters."""
    return [
        t
        for t in BASELINE
        if t in book.runs
        and all(s["spec_drafted"] is None for runs in book.runs[t].values() for s in runs)
    ]


def plot(book: Book, batches: list[int], path: Path) -> None:
    """Per batch: each speculative target's tok/s over its server's without, per workload."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    best = book.best()
    specs = [t for t in BASELINE if t in best]
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4), squeeze=False)
    for ax, b in zip(axes[0], batches):
        width = 0.8 / max(1, len(specs))
        for k, t in enumerate(specs):
            ys = [(tok_s_ratios(best, t, BASELINE[t], [w], b) or [0.0])[0] for w in WORKLOADS]
            ax.bar([i + width * k for i in range(len(WORKLOADS))], ys, width, label=t)
        ax.axhline(1.0, color="k", lw=1)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(WORKLOADS))], WORKLOADS)
        ax.tick_params(axis="x", rotation=20)
        ax.set_title(f"batch {b}: tok/s with / without speculation")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def write(out: Path, args: argparse.Namespace, result: dict) -> None:
    book = result["book"]
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "config": vars(args),
        "command": result["command"],
        "machine": result["machine"],
        "prompt_lengths": result["lengths"],
        "infos": result["infos"],
        "best": book.best(),
        "runs": book.runs,
        "checks": [c._asdict() | {"passed": c.passed} for c in result["checks"]],
        "llama_best_spec": result["llama_best"],
        "differing": result["differing"],
        "differing_texts": {t: book.differences(t, BASELINE[t]) for t in result["differing"]},
        "outputs": book.first_outputs([RADIXRT, LLAMA]),
        "skipped": result["skipped"],
        "failures": result["failures"],
    }
    out.write_text(json.dumps(data, indent=2) + "\n")


# --------------------------------------------------------------------- run


async def run_cell(target: Target, wl: Workload, batch: int, book: Book) -> None:
    samples, wall = await target.run(wl, batch)
    s = book.add(target, wl, batch, samples, wall)
    print(progress_line(target.name, wl.name, batch, s), flush=True)


def progress_line(target: str, workload: str, batch: int, s: dict) -> str:
    return (
        f"{target:>20} {workload:>11} @{batch}: {s['output_tok_s']:7.1f} tok/s, "
        f"{s['output_tokens']} tokens in {s['wall_s']:.2f} s, tok/step "
        f"{fmt(s['tokens_per_step'], '{:.2f}')}, TTFT p50 {s['ttft_p50_s']:.3f} s, "
        f"{s['errors']} errors"
    )


async def run_all(args: argparse.Namespace, wls: list[Workload], lengths: dict) -> dict:
    """The targets take turns on each workload and batch (a cell's runs close in time),
    ``--repeats`` times; a target that fails is reported and left out from then on."""
    book, infos, failures = Book(), {}, {}
    slots, ctx = llama_context(wls, lengths, max(args.batches))
    targets = [make_target(name, args, slots, ctx) for name in args.targets]
    try:
        live = [t for t in targets if started(t, infos, failures)]
        for _ in range(args.repeats):
            for wl, b in ((wl, b) for wl in wls for b in args.batches):
                for t in list(live):
                    try:
                        await run_cell(t, wl, b, book)
                    except Exception as e:  # noqa: BLE001 (reported; the others go on)
                        failed(t, e, failures)
                        live.remove(t)
    finally:
        for t in targets:
            t.stop()
    return {"book": book, "infos": infos, "failures": failures}


def started(target: Target, infos: dict, failures: dict) -> bool:
    """Start ``target`` and note its settings; False (and the failure noted) if it fails."""
    try:
        target.start()
        infos[target.name] = target.info()
        target.idle()
        return True
    except Exception as e:  # noqa: BLE001 (reported; the other targets run)
        failed(target, e, failures)
        return False


def failed(target: Target, e: Exception, failures: dict) -> None:
    failures[target.name] = f"{type(e).__name__}: {e}"
    print(f"{target.name} FAILED: {failures[target.name]}", file=sys.stderr, flush=True)
    target.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = ap.add_argument
    add("--targets", default=None, help="comma-separated (default: all): " + ", ".join(TARGETS))
    add("--workloads", default=",".join(WORKLOADS), help="comma-separated, run in this order")
    add("--batches", default="1,8", help="requests in flight at once, comma-separated")
    add("--prompts", type=int, default=8, help="distinct prompts per workload")
    add("--repeats", type=int, default=1, help="runs of each target (best kept)")
    add("--scale", type=float, default=1.0, help="multiplies --max-tokens (quick runs)")
    add("--max-tokens", type=int, default=MAX_TOKENS, help="output tokens per request, at most")
    add("--ignore-eos", action="store_true", help="every request runs to --max-tokens")
    add("--seed", type=int, default=0)
    add("--gguf", default=None, help=f"the GGUF file (default: {quantized.DEFAULT_GGUF_NAME})")
    add("--radixrt-args", default="", help="added to radixrt launch (--radixrt-args='--x y')")
    add("--speculative-num-draft-tokens", type=int, default=None, help="radixrt-ngram's")
    add("--radixrt-spec-args", default="", help="added to radixrt-ngram's launch")
    add("--llama-server", default=quantized.LLAMA_SERVER, help="the llama-server binary")
    add("--llama-args", default=None, help="added to llama-server (default: --no-repack on AMX)")
    add("--llama-spec-args", default="", help="added to the llama-<type> targets")
    add("--ready-timeout", type=float, default=900.0, help="s for llama-server to come up")
    add("--timeout", type=float, default=3600.0, help="s for one request")
    add("--out", default=None, help="JSON path (default bench/results/speculative.json)")
    args = ap.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.targets = list(TARGETS) if args.targets is None else args.targets.split(",")
    args.gguf = args.gguf or quantized.default_gguf()
    if args.llama_args is None:
        args.llama_args = "--no-repack" if "amx_tile" in peers.machine()["isa"] else ""
    bad = [w for w in args.workloads if w not in WORKLOADS]
    bad += [t for t in args.targets if t not in TARGETS]
    if bad:
        ap.error(f"unknown workloads or targets: {bad}")
    if args.repeats < 1 or args.scale <= 0 or args.prompts < 1 or min(args.batches) < 1:
        ap.error("--repeats, --prompts and --batches must be at least 1 and --scale above 0")
    if not Path(args.gguf).is_file():
        ap.error(f"no such GGUF file: {args.gguf}")
    return args


def drop_unavailable(args: argparse.Namespace) -> dict[str, str]:
    """Targets this machine cannot run, removed from ``args.targets``, with the reason."""
    skipped = {}
    if RADIXRT_SPEC in args.targets and not radixrt_speculates():
        skipped[RADIXRT_SPEC] = "this radixrt has no --speculative-algorithm"
    if not Path(args.llama_server).is_file():
        for t in (t for t in args.targets if t.startswith(LLAMA)):
            skipped[t] = f"no llama-server at {args.llama_server}"
    args.targets = [t for t in args.targets if t not in skipped]
    return skipped


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    skipped = drop_unavailable(args)
    for t, why in skipped.items():
        print(f"SKIPPED {t}: {why}", file=sys.stderr, flush=True)
    max_tokens = scaled_tokens(args.max_tokens, args.scale)
    wls = [make_workload(w, args.prompts, max_tokens, args.seed) for w in args.workloads]
    lengths = prompt_lengths(wls, args.gguf)
    result = asyncio.run(run_all(args, wls, lengths))
    book = result["book"]
    result |= {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "machine": peers.machine(),
        "lengths": lengths,
        "checks": checks(book, args.batches),
        "llama_best": best_llama_spec(book.best(), args.batches),
        "differing": {t: book.differing(t, BASELINE[t]) for t in BASELINE if t in book.runs},
        "skipped": skipped,
    }
    out = Path(args.out) if args.out else RESULTS / "speculative.json"
    write(out, args, result)
    plot(book, args.batches, out.with_suffix(".png"))
    print(report(result))
    print(f"wrote {out}")
    if result["failures"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
