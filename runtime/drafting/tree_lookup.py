"""Token trees from the lookup sources (SuffixDecoding, SGLang's n-gram trees): several continuations at once.

A chain plan drafts the first continuation its first source with a hit finds. A tree plan
(``DraftPlan.lookup_branches > 1``) asks every source of the plan for up to ``lookup_branches``
continuations (n-gram lookup: several earlier occurrences, longest match and most recent first;
retrieval: the majority path, then the other tokens that followed the match), takes them in turn (each
source's best first, in the plan's order, then each source's second, ...), and merges them into one
trie of at most ``tree_nodes`` tokens (``runtime/tree.py``). The verifier checks every branch in one call
and keeps the longest accepted path, so the tree always holds the chain plan's draft as its first branch.
Whether the extra rows pay is the backend's verify-cost curve's business: the tuner prices trees with it
(``passes/lookup_autotune.tree_grid``).
"""

from __future__ import annotations

from typing import Sequence

from ..tree import TokenTrie
from .drafter import Composite, Draft, LookupSource, RoundContext


class TreeLookupDrafter(Composite):
    name = "tree"
    drafts_trees = True

    def __init__(self, lookups: list[LookupSource], branches: int, tree_nodes: int):
        self.lookups, self.branches, self.tree_nodes = lookups, branches, tree_nodes

    def start(self, prompt: Sequence[int]) -> None:
        for source in self.lookups:
            source.start(prompt)

    def propose(self, ctx: RoundContext) -> Draft:
        per_source = [
            (source.name, source.continuations(ctx.history, ctx.limit, self.branches)) for source in self.lookups
        ]
        trie = TokenTrie(min(self.tree_nodes, ctx.limit))
        for rank in range(self.branches):
            for name, found in per_source:
                if rank < len(found) and not trie.full:
                    trie.add(found[rank], name)
        return Draft(tokens=trie.tokens, q=[None] * len(trie), sources=trie.sources, parents=trie.parents)

    def feedback(self, draft: Draft, accepted: int) -> None:
        pass


__all__ = ["TreeLookupDrafter"]
