"""A request's draft: candidate next tokens as a tree.

Contract:
- ``tokens[i]`` is a proposed token; ``parents[i]`` is the index of its parent in
  ``tokens`` (always < i), or -1 for a token that would follow the request's last token.
- A root-to-leaf path is one candidate continuation; siblings hold different tokens.
- ``branches()`` lists the paths as index lists, in the order the proposer ranked their
  leaves (the first is the most likely continuation).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class DraftTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError("a draft tree needs one parent per token")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"draft token {i} has parent {p}: parents come first")

    def __len__(self) -> int:
        return len(self.tokens)

    def branches(self) -> list[list[int]]:
        """Root-to-leaf index paths, leaves in tree order."""
        has_child = {p for p in self.parents if p >= 0}
        paths = []
        for leaf in range(len(self.tokens)):
            if leaf in has_child:
                continue
            path, node = [], leaf
            while node >= 0:
                path.append(node)
                node = self.parents[node]
            paths.append(path[::-1])
        return paths

    @classmethod
    def chain(cls, tokens: list[int]) -> DraftTree:
        """One branch: each token follows the one before it."""
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    def pruned(self, max_tokens: int, max_depth: int) -> DraftTree:
        """The tree cut to its first ``max_tokens`` tokens of depth at most ``max_depth`` (a
        token following the request's last token has depth 1); parents stay before children."""
        depth: list[int] = []
        keep: dict[int, int] = {}  # old index -> new index
        tokens, parents = [], []
        for i, (token, p) in enumerate(zip(self.tokens, self.parents)):
            depth.append(1 if p < 0 else depth[p] + 1)
            if len(tokens) == max_tokens:
                break
            if depth[i] <= max_depth and (p < 0 or p in keep):
                keep[i] = len(tokens)
                tokens.append(token)
                parents.append(-1 if p < 0 else keep[p])
        return DraftTree(tokens, parents)
