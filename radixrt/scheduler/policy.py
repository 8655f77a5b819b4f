"""Order of the waiting queue.

- ``fcfs``: arrival order.
- ``lpm``: longest cached prefix first (falls back to fcfs past
  ``LPM_MAX_QUEUE`` waiting requests, where matching each one costs too much).
- ``dfs-weight``: walk the radix tree depth-first, children with more waiting
  requests below them first, so requests under one prefix run together.

Prefix matches are made under each request's ``params.cache_salt`` (through
``KVManager`` and the tree), so a salt's requests only count hits in their
own namespace; namespaces are subtrees of the root, so dfs-weight also keeps
one salt's requests together.
"""

from __future__ import annotations

from collections import defaultdict

from radixrt.scheduler.kv import KVManager
from radixrt.scheduler.req import Req

POLICIES = ("lpm", "fcfs", "dfs-weight")
LPM_MAX_QUEUE = 128


def order_waiting(policy: str, waiting: list[Req], kv: KVManager) -> list[Req]:
    if policy == "fcfs" or kv.disabled or len(waiting) > LPM_MAX_QUEUE:
        return list(waiting)
    if policy == "lpm":
        hits = {id(r): kv.prefix_len_hint(r) for r in waiting}
        return sorted(waiting, key=lambda r: -hits[id(r)])  # stable: ties stay fcfs
    if policy == "dfs-weight":
        return _dfs_weight(waiting, kv)
    raise ValueError(f"unknown schedule_policy {policy!r}; expected one of {POLICIES}")


def _dfs_weight(waiting: list[Req], kv: KVManager) -> list[Req]:
    tree = kv.tree
    at_node: dict[int, list[Req]] = defaultdict(list)
    weight: dict[int, int] = defaultdict(int)
    # Peeks change nothing: ordering the queue neither splits nodes nor counts as an access.
    nodes = [
        tree.peek_prefix(r.fill_ids[: r.fill_len - 1], r.params.cache_salt).last_node
        for r in waiting
    ]
    for req, node in zip(waiting, nodes):
        at_node[node.id].append(req)
        while node is not None:
            weight[node.id] += 1
            node = node.parent
    order: list[Req] = []
    stack = [tree.root]
    while stack:
        node = stack.pop()
        order.extend(at_node.get(node.id, ()))
        children = [c for c in node.children.values() if weight.get(c.id)]
        stack.extend(sorted(children, key=lambda c: weight[c.id]))  # heaviest popped first
    return order
