"""Pass, PassResult and PassManager (in the manner of onnx-ir's pass infrastructure), with a time budget.

A pass does one thing to a ``DecoderIR`` and says what it did: ``call`` returns a ``PassResult`` (was the
IR modified, which plans it added, or why it was skipped). ``requires`` and ``ensures`` are the pass's
pre- and postconditions, checked around every call, so a pipeline that feeds a pass the wrong IR fails
at the pass that needs something, naming it, not three passes later.

A *tuning* pass may also publish, before it spends its time, an upper ``bound`` on the expected speedup
any plan it can add reaches, from cheap signals (``passes/budget.py``). The ``PassManager`` runs passes in
order and, when given a ``Budget``, skips a pass whose bound is below the incumbent (the best expected
speedup of the plans so far, or plain decoding's 1.0) or whose least time does not fit in what is left;
every decision goes into ``ir.tuning["passes"]`` and from there into the manifest and ``inspect``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .ir import DecoderIR


class PassError(RuntimeError):
    """A pass's pre- or postcondition failed: a pipeline bug, not a user error."""


@dataclass
class PassResult:
    ir: DecoderIR
    modified: bool = False
    added: list[str] = field(default_factory=list)  # plans added or replaced
    skipped: str | None = None  # why the pass did not run ("bound 1.08x < incumbent 1.29x")
    notes: dict[str, Any] = field(default_factory=dict)  # anything else worth the manifest

    @classmethod
    def after(cls, ir: DecoderIR, before: dict, **notes) -> "PassResult":
        """The result of a pass that may have added or replaced plans since ``before`` (a copy of ``ir.plans``)."""
        added = [name for name, plan in ir.plans.items() if before.get(name) is not plan]
        return cls(ir, modified=bool(added) or ir.plans.keys() != before.keys(), added=added, notes=notes)


class Pass:
    """A transformation of the IR. Subclasses implement ``call``; ``name`` shows in logs and the manifest.

    ``adds`` names the plans the pass may add (the pipeline table's data: ``ensures`` checks that a pass
    adds nothing else, and ``inspect`` shows it); ``needs`` names plans it builds on when they exist (a
    hybrid's model part). A tuning pass overrides ``bound`` (None: no bound, always worth running) and
    ``least_seconds`` (the least time it can do anything useful in) and honours ``deadline``."""

    name = "pass"
    adds: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    deadline: float | None = None  # perf_counter time by which a budgeted pass should be done

    def call(self, ir: DecoderIR) -> PassResult:
        raise NotImplementedError

    def requires(self, ir: DecoderIR) -> None:
        """Precondition; raise ``PassError`` naming what is missing."""

    def ensures(self, result: PassResult) -> None:
        """Postcondition: every added plan is in the IR, was declared in ``adds``, and carries its figures."""
        for name in result.added:
            plan = result.ir.plans.get(name)
            if plan is None:
                raise PassError(f"pass {self.name} reported plan {name!r} added, but the IR does not hold it")
            if self.adds and name not in self.adds:
                raise PassError(f"pass {self.name} added plan {name!r}, which it does not declare ({self.adds})")

    def bound(self, ir: DecoderIR) -> float | None:
        return None

    def least_seconds(self) -> float:
        return 0.0

    def seconds_left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.perf_counter()

    def __call__(self, ir: DecoderIR) -> PassResult:
        self.requires(ir)
        result = self.call(ir)
        if not isinstance(result, PassResult):
            raise PassError(f"pass {self.name} returned {type(result).__name__}, not a PassResult")
        self.ensures(result)
        return result

    def run(self, ir: DecoderIR) -> DecoderIR:
        """Run the pass alone (pre- and postconditions checked) and return the IR."""
        return self(ir).ir


def incumbent(ir: DecoderIR) -> float:
    """The best expected speedup of the IR's plans so far; plain decoding (1.0) is the floor."""
    return max([1.0] + [p.measured.get("expected_speedup") or 0.0 for p in ir.plans.values()])


BOUND_MARGIN = 0.05
"""A budgeted pass runs only if its bound beats the incumbent by more than this: confirmation on a 2-core machine
cannot tell plans within a few percent apart (``confirm.TIE``), so a pass that can at best add that much spends its
seconds on a plan that cannot win (measured: docs/history.md, 'Figures behind the code's constants')."""


class PassManager:
    """Runs passes in order and records what each did and how long it took (into ``ir.tuning["passes"]``).

    With a ``budget`` (``passes/budget.py``), a pass runs only if its bound beats the incumbent (by
    ``BOUND_MARGIN``) and its
    ``least_seconds`` fit in the budget's time left for tuning, and gets the tuning deadline; a pass named in
    ``budget.exempt`` (confirmation, choosing the default) always runs, by the deadline before the write."""

    def __init__(self, passes: list[Pass], log: Callable[[str], None] = lambda message: None, budget=None):
        self.passes, self.log, self.budget = passes, log, budget

    def decide(self, p: Pass, ir: DecoderIR) -> tuple[str | None, float | None, float]:
        """(why to skip or None, the pass's bound, the incumbent)."""
        best = incumbent(ir)
        if self.budget is None or p.name in self.budget.exempt:
            return None, None, best
        left = self.budget.tuning_left()
        # Time first (a bound can cost seconds to compute), but the first plan is made whatever the time:
        # a slow calibration must not leave the artifact without even its lookup plan.
        if ir.plans and (p.least_seconds() > left or left <= 0):
            return f"needs {p.least_seconds():.0f}s, {max(left, 0):.0f}s left", None, best
        p.deadline = self.budget.tuning_deadline()  # a bound may depend on the time the pass would have
        bound = p.bound(ir)
        if bound is not None and bound < best * (1 + BOUND_MARGIN):
            margin = f" + {BOUND_MARGIN:.0%}" if bound >= best else ""
            return f"bound {bound:.2f}x < incumbent {best:.2f}x{margin}", bound, best
        return None, bound, best

    def __call__(self, ir: DecoderIR) -> DecoderIR:
        history = ir.tuning.setdefault("passes", [])
        for p in self.passes:
            start = time.perf_counter()
            skipped, bound, best = self.decide(p, ir)
            entry = {
                "pass": p.name,
                **({"bound": round(bound, 4)} if bound is not None else {}),
                "incumbent": round(best, 4),
            }
            if skipped:
                history.append({**entry, "seconds": round(time.perf_counter() - start, 3), "skipped": skipped})
                self.log(f"pass {p.name}: skipped, {skipped}{self._left()}")
                continue
            if self.budget is not None:
                p.deadline = (
                    self.budget.final_deadline() if p.name in self.budget.exempt else self.budget.tuning_deadline()
                )
            shown = f" (bound {bound:.2f}x, incumbent {best:.2f}x)" if bound is not None else ""
            self.log(f"pass {p.name}{shown} ...{self._left()}")
            result = p(ir)
            ir = result.ir
            seconds = time.perf_counter() - start
            history.append(
                {
                    **entry,
                    "seconds": round(seconds, 3),
                    "modified": result.modified,
                    "added": result.added,
                    **({"skipped": result.skipped} if result.skipped else {}),
                    **result.notes,
                }
            )
            best_after = incumbent(ir)
            reached = [ir.plans[n].measured.get("expected_speedup") for n in result.added if n in ir.plans]
            if any(r is not None for r in reached):  # what the pass reached, next to its bound
                history[-1]["reached"] = round(max(r for r in reached if r is not None), 4)
            self.log(
                f"pass {p.name} done in {seconds:.1f}s"
                + (f": added {', '.join(result.added)}" if result.added else "")
                + (f", {result.skipped}" if result.skipped else "")
                + (f", incumbent {best_after:.2f}x" if self.budget is not None else "")
                + self._left()
            )
        return ir

    def _left(self) -> str:
        return "" if self.budget is None else f" [{self.budget.progress()}]"
