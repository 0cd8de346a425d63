"""What every autotuner shares: calibration references, the costs, the backend runner, and plan scoring.

Built once per build (or tune) so that cosine ranking, exit-layer choice, Bayesian search and the
lookup / hybrid tuner score plans with the same acceptance estimator and the same measured costs, and
are comparable. Costs and confirmation runs go through the *runner*: the backend that will run the
artifact (torch here by default; ``speccompile`` supplies an ONNX Runtime runner for ONNX artifacts).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from speccompile.runtime.artifact.manifest import DraftPlan

from .acceptance_estimate import (
    MIN_CONTINUATIONS,
    Reference,
    RoundEstimate,
    best_policy,
    greedy_continuations,
    profile_plan,
    reference_pass,
)
from .budget import CALIBRATION_SHARE, REFERENCE_SHARE, TIMING_SHARE, BudgetBar
from .cost_model import CostModel, StepCosts, device_name, measure_costs, measure_step_costs
from .ir import DecoderIR

LOOKUP_MAX_DRAFT = 12  # longest lookup draft the tuner considers (the verify step costs are timed up to it)


class Runner(Protocol):
    """Makes the backend that runs the artifact, for timing: ``backend(plans)`` must be able to run
    ``plans`` (an ONNX runner exports their graphs first)."""

    name: str

    def backend(self, plans: dict[str, DraftPlan] | None = None): ...

    def plain_backend(self):
        """A backend whose full model runs plain and batched calls, without exporting anything new."""

    def release(self) -> None:
        """Drop the backend made last (the next ``backend`` makes one again): frees its memory meanwhile."""


class TorchRunner:
    name = "torch"

    def __init__(self, ir: DecoderIR, workdir: Path | None = None):
        """``workdir``: the tuning run's scratch folder (runners that export files write there; this one writes
        nothing)."""
        self.ir = ir

    def backend(self, plans: dict[str, DraftPlan] | None = None):
        from speccompile.runtime.backends.torch.backend import TorchBackend

        return TorchBackend(self.ir.decoder(), device=self.ir.device)

    def plain_backend(self):
        """A backend whose full model runs plain and batched calls (the call costs' timing)."""
        return self.backend()

    def release(self) -> None:
        """Nothing to drop: the torch backend runs the IR's own decoder."""


@dataclass
class TuningContext:
    ir: DecoderIR
    references: list[Reference]
    cosine: np.ndarray  # [2, L]: mean cos(h_in, h_out) of attention (row 0) and MLP (row 1) sublayers
    cost: CostModel  # torch sublayer timings: the relative cost of any plan's subgraph
    costs: StepCosts  # measured on the runner's backend: what every estimate uses
    max_draft: int
    device: str
    runner: Runner = None
    workdir: Path = None  # scratch files of this tuning run (exports, datastores)
    confirm_prompts: list[list[int]] = field(default_factory=list)
    confirm_tokens: int = 48
    cosine_scores: dict[int, float] = field(default_factory=dict)  # skip count -> expected speedup
    confirm_datastore: str | None = None  # datastore for confirming retrieval plans, without the confirm prompts
    eos: frozenset[int] = frozenset()  # calibration continuations and confirmation runs stop here, as generation does
    signals: dict = field(
        default_factory=dict
    )  # cheap signals shared by passes' bounds (exit agreements, lookup rounds)
    timings: dict = field(default_factory=dict)  # seconds per calibration phase
    trees: bool = False  # whether the runner's backend verifies token trees (runtime/tree.py)
    budget: object = None  # a budgeted build's Budget (passes/budget.py): progress bars show what is left
    scratch: object = field(default=None, repr=False)  # the TemporaryDirectory behind workdir when prepare made it

    @classmethod
    def prepare(
        cls,
        ir: DecoderIR,
        prompts: list[list[int]],
        new_tokens: int,
        max_draft: int,
        show_progress: bool = True,
        confirm_prompts: int = 4,
        confirm_tokens: int = 48,
        runner: Runner | None = None,
        workdir: Path | None = None,
        eos: frozenset[int] = frozenset(),
        trees: bool = True,
        budget=None,
    ) -> "TuningContext":
        """Greedy-decode the calibration prompts with the full model, store its K/V, time the sublayers
        and the runner's backend. ``trees``: whether plans may draft token trees (``--no-trees``: chains
        only), where the runner's backend verifies them. ``budget`` (a budgeted build's): the continuations
        stop at ``CALIBRATION_SHARE`` of it (fewer, shorter ones on a big model), the reference pass at
        ``REFERENCE_SHARE`` (fewer sequences), and each timing takes about ``TIMING_SHARE`` of it."""
        decoder = ir.decoder()
        timings, clock = {}, time.perf_counter()
        share = (lambda fraction: budget.share(fraction)) if budget is not None else (lambda fraction: None)

        def lap(phase: str) -> None:
            nonlocal clock
            timings[phase] = round(time.perf_counter() - clock, 2)
            clock = time.perf_counter()

        seconds = share(CALIBRATION_SHARE)
        deadline = None if seconds is None else time.perf_counter() + seconds
        with BudgetBar(
            total=len(prompts), desc="calibration: target continuations", disable=not show_progress, budget=budget
        ) as bar:
            continuations = greedy_continuations(decoder, prompts, new_tokens, bar, eos, deadline=deadline)
        prompts = prompts[: len(continuations)]
        lap("continuations")
        cosine = np.zeros((2, ir.config.num_layers))
        references = []
        seconds = share(REFERENCE_SHARE)
        deadline = None if seconds is None else time.perf_counter() + seconds
        for prompt, continuation in BudgetBar(
            list(zip(prompts, continuations)),
            desc="calibration: reference pass",
            disable=not show_progress,
            budget=budget,
        ):
            if deadline is not None and len(references) >= MIN_CONTINUATIONS and time.perf_counter() >= deadline:
                break  # the sequences left are not scored on (a model too big for the budget)
            references.append(reference_pass(decoder, prompt + continuation, len(prompt), cosine))
        prompts = prompts[: len(references)]
        cosine /= max(len(references), 1)
        lap("reference_pass")
        cost = measure_costs(decoder, max_draft + 1, seconds=share(TIMING_SHARE))
        lap("sublayer_costs")
        runner = runner or TorchRunner(ir)
        scratch = None
        if workdir is None:  # a folder of its own, removed with the context (or when the process exits)
            scratch = tempfile.TemporaryDirectory(prefix="speccompile-tune-")
            workdir = scratch.name
        workdir = Path(workdir)
        backend = runner.backend({})
        lap("runner_backend")
        costs = measure_step_costs(backend, cost, max_draft + LOOKUP_MAX_DRAFT + 1, seconds=share(TIMING_SHARE))
        lap("step_costs")
        return cls(
            ir=ir,
            references=references,
            cosine=cosine,
            cost=cost,
            costs=costs,
            max_draft=max_draft,
            device=f"{device_name(cost.device)}, {runner.name}",
            confirm_prompts=prompts[:confirm_prompts],
            confirm_tokens=confirm_tokens,
            runner=runner,
            workdir=workdir,
            scratch=scratch,
            eos=frozenset(eos),
            timings=timings,
            trees=trees and backend.tree_unsupported() is None,
            budget=budget,
        )

    @property
    def training_references(self) -> list[Reference]:
        """The calibration sequences a trained draft (adapter, draft vocabulary) may learn from: all but the
        confirmation prompts', so confirmation measures the draft on text it never saw (an adapter trained on them
        confirms far above what it runs at; measured: docs/history.md, 'Figures behind the code's constants'). With
        no other sequences (a calibration of only the confirmation prompts), all of them."""
        return self.references[len(self.confirm_prompts) :] or self.references

    @property
    def confirmation_held_out(self) -> bool:
        return len(self.references) > len(self.confirm_prompts)

    def score(self, plan: DraftPlan, references: list[Reference] | None = None) -> RoundEstimate:
        """Best draft-length policy for ``plan`` and its expected speedup over plain decoding (on
        ``references``, default all)."""
        return best_policy(self.profile(plan, references), plan, self.costs, self.max_draft)

    def profile(self, plan: DraftPlan, references: list[Reference] | None = None):
        """``plan``'s draft against the calibration continuations, on the torch decoder. The runner's sessions are
        released first: the torch side reads its weights again, and ONNX Runtime's packed copy beside them would
        make a second copy (measured: docs/history.md, 'Figures behind the code's constants'); the next
        ``runner.backend`` opens them again."""
        if self.runner is not None:
            self.runner.release()
        return profile_plan(
            self.draft_decoder(plan), plan, self.references if references is None else references, self.draft_head(plan)
        )

    def draft_decoder(self, plan: DraftPlan):
        """The torch decoder whose blocks and head compute ``plan``'s draft: the model's, or for a precision
        draft its stand-in on the runner's backend (``passes/precision_estimate.py``)."""
        from speccompile.runtime.drafting import read_plan

        decoder = self.ir.decoder()
        kind = read_plan(plan, self.ir.config.num_layers).kind
        precision = kind.draft_segment.precision if kind.has_model_part else None
        if precision is None:
            return decoder
        from .precision_estimate import estimation_twin

        return estimation_twin(decoder, precision, self.runner.name if self.runner is not None else "torch")

    def sample(self, share: float) -> list[Reference]:
        """About ``share`` of the calibration sequences, spread over them (cheap scoring where a ranking holds)."""
        n = max(2, round(len(self.references) * share))
        if n >= len(self.references):
            return self.references
        return [self.references[round(i * (len(self.references) - 1) / (n - 1))] for i in range(n)]

    def draft_head(self, plan: DraftPlan):
        """The torch kernel of ``plan``'s draft head (exit adapter / reduced vocabulary, ``passes/adapter.py``),
        read from this tuning run's files; None for the shared head."""
        if plan.draft_head_file is None:
            return None
        from speccompile.runtime.artifact.draft_head_file import load_draft_head
        from speccompile.runtime.backends.torch.backend import TorchDraftHead

        c = self.ir.config
        return TorchDraftHead.from_draft_head(
            self.ir.decoder(), load_draft_head(self.workdir / plan.draft_head_file, c.hidden_size, c.vocab_size)
        )

    def record(self, method: str, estimate: RoundEstimate, **extra) -> dict:
        """The 'measured' block of a plan in the manifest."""
        return {
            "method": method,
            "acceptance_rate": round(estimate.acceptance_rate, 4),
            "mean_accepted": round(estimate.tokens_per_round, 4),
            "expected_speedup": round(estimate.expected_speedup, 4),
            "device": self.device,
            "calibration_sequences": len(self.references),
            **extra,
        }
