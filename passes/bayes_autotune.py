"""Bayesian search over layer-skip plans with optuna, scored by the same objective as cosine.

Draft & Verify's search times a real generation per trial (hours). Here a trial costs one parallel
draft forward per calibration sequence (the acceptance estimator) plus arithmetic on a cost model
timed once, so hundreds of trials take minutes.

- Space: one 0/1 parameter per attention and per MLP sublayer. The draft-length policy (max draft,
  confidence threshold) is not sampled: for a given skip set it is optimised exactly by replaying the
  rounds for every (k, threshold) pair (``best_policy``), which costs microseconds, so spending trials
  on it would only slow the search down. The chosen k and threshold are stored on every trial.
- Sampler: GPSampler up to ``GP_MAX_TRIALS`` trials, multivariate TPE beyond.
- Seeds: the cosine ranking's "skip the n most similar" plans, best first, via ``enqueue_trial``.
- Storage: an optuna study in a SQLite file; rerunning with the same file continues the study.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import optuna
from tqdm.auto import tqdm

from speccompile.runtime.artifact.manifest import DraftPlan
from speccompile.runtime.drafting import read_plan
from speccompile.runtime.errors import SpeccompileError

from .autotune import cosine_ranking, skip_plan, skip_units
from .ir import DecoderIR
from .pass_manager import Pass, PassError, PassResult
from .plans import LayerSkipPlan
from .tuning import TuningContext

GP_MAX_TRIALS = 300
STUDY_NAME = "speccompile-layer-skip"


def _params(plan: DraftPlan, units: list[tuple[str, int]]) -> dict[str, int]:
    skipped = {"attn": plan.skip_attn, "mlp": plan.skip_mlp, "block": plan.skip_attn}
    return {f"{kind}_{i}": int(i in skipped[kind]) for kind, i in units}


def _plan(params: dict[str, int], units: list[tuple[str, int]], name: str = "bayes") -> DraftPlan:
    on = [(kind, i) for kind, i in units if params[f"{kind}_{i}"]]
    return DraftPlan.of(
        name=name,
        skip_attn=sorted(i for kind, i in on if kind in ("attn", "block")),
        skip_mlp=sorted(i for kind, i in on if kind in ("mlp", "block")),
    )


def open_study(path: str | None, trials: int, seed: int, num_layers: int, model_type: str) -> optuna.Study:
    sampler = (
        optuna.samplers.GPSampler(seed=seed)
        if trials <= GP_MAX_TRIALS
        else optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True)
    )
    storage = f"sqlite:///{Path(path).resolve()}" if path else None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        storage=storage, sampler=sampler, study_name=STUDY_NAME, direction="maximize", load_if_exists=True
    )
    geometry = {"num_layers": num_layers, "model_type": model_type}
    stored = {k: study.user_attrs.get(k) for k in geometry}
    if any(v is not None for v in stored.values()) and stored != geometry:
        raise SpeccompileError(
            f"study file '{path}' belongs to another model ({stored}); pass a new --study file for this one"
        )
    for key, value in geometry.items():
        study.set_user_attr(key, value)
    return study


@dataclass
class SearchTrace:
    """What the search did, for the progress bar, the manifest and the plot."""

    values: list[float] = field(default_factory=list)
    seeded: list[bool] = field(default_factory=list)
    seconds: float = 0.0


class BayesAutotune(Pass):
    name = "bayes_autotune"

    def __init__(
        self,
        context: TuningContext,
        trials: int = 200,
        time_budget: float | None = None,
        study_path: str | None = None,
        seed: int = 0,
        candidates: int = 3,
        plan_name: str = "bayes",
        show_progress: bool = True,
    ):
        self.context, self.trials, self.time_budget = context, trials, time_budget
        self.study_path, self.seed, self.candidates = study_path, seed, candidates
        self.plan_name, self.show_progress = plan_name, show_progress
        self.adds = (plan_name, "layer-skip")  # the cosine plan's confirmed figures are updated too
        self.trace = SearchTrace()
        self.study: optuna.Study | None = None

    def objective(self, trial: optuna.Trial) -> float:
        units = skip_units(self.context)
        params = {f"{kind}_{i}": trial.suggest_int(f"{kind}_{i}", 0, 1) for kind, i in units}
        plan = _plan(params, units)
        if not plan.skip_attn and not plan.skip_mlp:
            # Skipping nothing makes the draft the target itself: never a speedup, so never a candidate.
            trial.set_user_attr("degenerate", "skips nothing")
            for key in ("max_draft", "threshold", "acceptance_rate", "mean_accepted"):
                trial.set_user_attr(key, 1 if key == "max_draft" else 0.0)
            return 0.0
        estimate = self.context.score(plan)
        trial.set_user_attr("max_draft", estimate.max_draft)
        trial.set_user_attr("threshold", estimate.threshold)
        trial.set_user_attr("acceptance_rate", estimate.acceptance_rate)
        trial.set_user_attr("mean_accepted", estimate.tokens_per_round)
        return estimate.expected_speedup

    def _seed(self, study: optuna.Study, L: int) -> None:
        """Enqueue the cosine ranking's plans (best expected speedup first) into a new study, at most half
        the trial budget so that the sampler gets the other half."""
        ranking = cosine_ranking(self.context)
        by_count = self.context.cosine_scores
        counts = sorted(range(1, len(ranking)), key=lambda n: -by_count.get(n, 0.0))[: max(1, self.trials // 2)]
        for n in counts:
            study.enqueue_trial(
                _params(skip_plan(ranking, n), skip_units(self.context)), user_attrs={"seed": f"cosine-{n}"}
            )

    def requires(self, ir: DecoderIR) -> None:
        if "layer-skip" not in ir.plans:
            raise PassError("bayes_autotune is seeded with the cosine plans: run cosine_autotune first")

    def call(self, ir: DecoderIR) -> PassResult:
        before = dict(ir.plans)
        L = ir.config.num_layers
        start = time.perf_counter()
        study = self.study = open_study(self.study_path, self.trials, self.seed, L, ir.config.model_type)
        done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        if not study.trials:
            self._seed(study, L)
        remaining = max(self.trials - len(done), 0)
        best = max((t.value for t in done), default=float("-inf"))
        with tqdm(total=remaining, desc="bayes: searching", disable=not self.show_progress) as bar:

            def report(study_, trial):
                nonlocal best
                if trial.value is not None:
                    best = max(best, trial.value)
                bar.update(1)
                bar.set_postfix(best=f"{best:.3f}x")

            if remaining:
                study.optimize(self.objective, n_trials=remaining, timeout=self.time_budget, callbacks=[report])
        complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        if not complete:
            raise SpeccompileError("the Bayesian search ran no trial; raise --time-budget or --trials")
        self.trace = SearchTrace(
            values=[t.value for t in complete],
            seeded=["seed" in t.user_attrs for t in complete],
            seconds=time.perf_counter() - start,
        )

        # The few best distinct plans by prediction, and the cosine plan, are timed by one Confirmer (same
        # conditions for all); the best confirmed wins, so the search never ends below the cosine plan.
        ranked, seen = [], set()
        for t in sorted(complete, key=lambda t: -t.value):
            key = tuple(sorted(t.params.items()))
            if key not in seen and len(ranked) < self.candidates:
                seen.add(key)
                ranked.append(t)
        cosine = ir.plans.get("layer-skip")
        cosine_key = tuple(sorted(_params(cosine, skip_units(self.context)).items())) if cosine is not None else None
        if cosine_key is not None and cosine_key not in seen:
            ranked += [t for t in complete if tuple(sorted(t.params.items())) == cosine_key][:1]
        from .confirm import Confirmer

        candidates = []
        for n, t in enumerate(ranked):
            if tuple(sorted(t.params.items())) == cosine_key:
                # The cosine plan keeps its own tuned policy; it is timed once and the figure shared.
                plan = cosine
            else:
                plan = _plan(t.params, skip_units(self.context), f"{self.plan_name}-candidate-{n}")
                plan.set_option("model", "max_draft", t.user_attrs["max_draft"])
                plan.set_option("model", "threshold", t.user_attrs["threshold"])
            candidates.append((t, plan))
        backend = self.context.runner.backend({**ir.plans, **{plan.name: plan for _, plan in candidates}})
        confirmer = Confirmer(backend, self.context.confirm_prompts, self.context.confirm_tokens, eos=self.context.eos)
        scored = []
        for t, plan in candidates:
            if plan is cosine:
                cosine.measured.update(confirmer.measure(cosine))
                scored.append(
                    (
                        dict(
                            (k, v)
                            for k, v in cosine.measured.items()
                            if k.startswith("confirmed_") or k == "plain_tokens_per_s"
                        ),
                        t,
                        plan,
                    )
                )
            else:
                scored.append((confirmer.measure(plan), t, plan))
        confirmed, trial, plan = max(scored, key=lambda s: s[0]["confirmed_speedup"])
        measured = self.context.record(
            "bayes",
            _estimate_from(trial),
            tuning_seconds=round(self.trace.seconds, 2),
            trials=len(complete),
            sampler="GPSampler" if self.trials <= GP_MAX_TRIALS else "TPESampler(multivariate)",
            best_trial=trial.number,
            seeded_from=trial.user_attrs.get("seed", "search"),
            candidates_confirmed=len(scored),
            **confirmed,
        )
        LayerSkipPlan(
            plan.skip_attn,
            plan.skip_mlp,
            read_plan(plan).model.max_draft,
            read_plan(plan).model.threshold,
            self.plan_name,
            measured,
        ).run(ir)
        return PassResult.after(ir, before, trials=len(complete))


def _estimate_from(trial: optuna.trial.FrozenTrial):
    from .acceptance_estimate import RoundEstimate

    a = trial.user_attrs
    return RoundEstimate(
        tokens_per_round=a["mean_accepted"],
        drafted_per_round=0.0,
        acceptance_rate=a["acceptance_rate"],
        expected_speedup=trial.value,
        max_draft=a["max_draft"],
        threshold=a["threshold"],
    )
