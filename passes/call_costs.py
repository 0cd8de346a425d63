"""The build times the batched calls the load policy prices drafts with, and stores them in the manifest.

Why: a server that batches sequences chooses each round's draft lengths from the cost of a call of n one-token
rows and of a row of w tokens (``runtime/decoding/load.py``). Timed at every start, that is seconds of a
server's start-up, and ``inspect`` could not show the curve. The build has the backend open on the machine it
tuned on, so it times them once (``tuning["call_costs"]``, with the machine they describe); a server on the
same machine reuses them, elsewhere it times its own (``runtime/decoding/load.call_costs``).
"""

from __future__ import annotations

from typing import Callable

from speccompile.runtime.decoding.load import CallCosts, draft_step_segment, longest_draft
from speccompile.runtime.drafting.plan import read_plan

CALL_COST_ROWS = 16  # one-token rows timed in one call: serve's batches up to 16 reuse them without extrapolating
REPEATS = 3  # each point: the best of this many calls after a warm-up (as ``CallCosts.measure``)


def estimated_seconds(step_seconds: float, rows: int, width: int, draft: bool = False) -> float:
    """About what ``CallCosts.measure`` takes, from the plain step's seconds: a call of n rows costs about a step
    up to a few rows and grows with n past them (measured: docs/history.md, 'Figures behind the code's constants');
    with ``draft``, the draft step's calls too, priced as plain ones (a draft runs a part of the model)."""
    batched = sum(max(1.0, n / 4) for n in CallCosts.row_counts(rows))
    calls = batched * (2 if draft else 1) + 1.5 * max(width - 1, 0)
    return step_seconds * ((REPEATS + 1) * calls + 3)


def time_call_costs(runner, ir, seconds_left: float | None, step_seconds: float, log: Callable[[str], None]) -> None:
    """Time the call costs of the IR's default plan on the runner's backend into ``ir.tuning["call_costs"]``
    when ``seconds_left`` (None: no budget) allows; a log line either way."""
    ir.tuning.pop("call_costs", None)
    plan = ir.plans.get(ir.default_plan) if ir.default_plan else None
    if plan is None:
        return  # decodes plainly by default: batches price nothing
    backend = runner.plain_backend()
    if not getattr(backend, "batched", False):
        return
    width = longest_draft(plan) + 1
    # the draft step's curve too, where this backend has the plan's draft graphs open (else a server times it)
    draft = draft_step_segment(read_plan(plan, ir.config.num_layers))
    if draft is not None and backend.unsupported(draft) is not None:
        draft = None
    needed = estimated_seconds(step_seconds, CALL_COST_ROWS, width, draft is not None)
    if seconds_left is not None and needed > seconds_left:
        log(
            f"batched call costs not timed (about {needed:.0f}s needed, {max(seconds_left, 0):.0f}s of the budget "
            "left): a server times them at start"
        )
        return
    if draft is not None:
        backend.prepare(draft)
    costs = CallCosts.measure(backend, max_rows=CALL_COST_ROWS, max_width=width, repeats=REPEATS, draft=draft)
    ir.tuning["call_costs"] = costs.as_dict()
    one, many = costs.batched[1], costs.batched[CALL_COST_ROWS]
    drafts = (
        f", a draft step of 1 / {CALL_COST_ROWS} rows {costs.draft[1] * 1e3:.1f} / {costs.draft[CALL_COST_ROWS] * 1e3:.1f} ms"
        if costs.draft
        else ""
    )
    log(
        f"batched call costs: 1 row {one * 1e3:.1f} ms, {CALL_COST_ROWS} rows {many * 1e3:.1f} ms "
        f"({many / one:.2f}x), a row of {width} tokens {costs.alone[width] * 1e3:.1f} ms{drafts} (stored for serve)"
    )


__all__ = ["CALL_COST_ROWS", "estimated_seconds", "time_call_costs"]
