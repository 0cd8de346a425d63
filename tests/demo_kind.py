"""A draft kind written outside the runtime, for ``tests/test_draft_kinds.py``: what adding a kind costs.

The first ``params["blocks"]`` blocks and the shared head, with no prefix reuse (the verify runs the
full model). This file plus one ``KINDS`` entry is all of it: no backend, cost model, estimator or
exporter learns about it. (``DraftKind`` runs, prices and estimates a kind's ``draft_segment``.)
"""

from speccompile.runtime.drafting.kinds.draft_kind import DraftKind
from speccompile.runtime.segments import Segment


class ShallowDraft(DraftKind):
    name = "shallow"

    @property
    def draft_segment(self) -> Segment:
        return Segment(0, int(self.plan.params["blocks"]), head=self.head)

    def describe(self) -> str:
        return f"the first {self.plan.params['blocks']} blocks, no prefix reuse"
