"""Confirm plans with real timed draft-and-verify runs, next to plain decoding of the same prompts.

The predicted speedup comes from a cost model; this measures the real one (time of the runtime's
speculative vs plain greedy decoding of the same prompts, on the backend that will run the artifact)
and writes it next to the prediction, with the prediction's error. A plan that does not beat plain
decoding in its own confirmation never becomes the default.
"""

from __future__ import annotations

import math
import time

from tqdm.auto import tqdm

from speccompile.runtime.artifact.manifest import DraftPlan
from speccompile.runtime.decoding.speculative import DecodeRequest, Stats, decode_all

from .budget import BudgetBar
from .ir import DecoderIR
from .pass_manager import Pass, PassResult

MIN_TURNS = 3  # a sequential confirmation times at least this many turns before it may stop
MAX_TURNS_PER_PROMPT = 4  # and at most this many turns per confirmation prompt
TIE = 0.03  # plans whose speedups are surely within 3% of each other are a tie: racing them on buys nothing
# two-sided 95% quantiles of Student's t for 1..12 degrees of freedom (beyond: the normal's 1.96 plus a tail term)
T_975 = (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18)


def interval(samples: list[float]) -> tuple[float, float, float]:
    """Mean and 95% t-interval of ``samples`` (log speedups of paired turns); infinitely wide below 2 samples."""
    n = len(samples)
    mean = sum(samples) / n if n else 0.0
    if n < 2:
        return mean, -math.inf, math.inf
    sd = math.sqrt(sum((x - mean) ** 2 for x in samples) / (n - 1))
    t = T_975[n - 2] if n - 2 < len(T_975) else 1.96 + 2.4 / (n - 1)
    return mean, mean - t * sd / math.sqrt(n), mean + t * sd / math.sqrt(n)


def _versus(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Interval of the paired per-turn differences of two plans' log speedups."""
    return interval([x - y for x, y in zip(a, b)])


def timed_decode(
    backend, prompt, new_tokens, plan, root=None, eos: frozenset[int] = frozenset()
) -> tuple[list[int], Stats]:
    return decode_all(backend, DecodeRequest(prompt, new_tokens, eos_ids=eos), plan, root)


class Confirmer:
    """Times plans against plain decoding on the same prompts.

    Plain and speculative runs are interleaved prompt by prompt and repeated, keeping each one's fastest
    run: interference from other work on the machine only ever adds time, so the minimum is the
    estimate of the undisturbed speed, and interleaving exposes both modes to the same conditions. The
    plain run of each prompt is repeated for every plan measured, and its fastest run so far is the
    reference, so later plans need one plain run per prompt instead of ``repeats``.
    """

    def __init__(
        self,
        backend,
        prompts: list[list[int]],
        new_tokens: int,
        repeats: int = 2,
        root=None,
        eos: frozenset[int] = frozenset(),
        decode=None,
    ):
        """``backend`` runs the plans (the runner's: torch or ONNX Runtime); ``root`` holds files plans
        read (a retrieval datastore); runs stop at an ``eos`` token, as generation does. ``decode(prompt,
        new_tokens, plan)`` -> (tokens, Stats) replaces the timed decode (tests give it a fake clock)."""
        self.backend, self.root, self.eos = backend, root, frozenset(eos)
        self.prompts, self.new_tokens, self.repeats = prompts, new_tokens, repeats
        self._plain: dict[int, tuple[list[int], Stats]] = {}  # prompt index -> fastest plain run so far
        self.decode = decode or (
            lambda prompt, new_tokens, plan: timed_decode(self.backend, prompt, new_tokens, plan, self.root, self.eos)
        )
        self.decode(prompts[0], 8, None)  # warm-up

    def _fastest(self, prompt, plan, repeats: int) -> tuple[list[int], Stats]:
        runs = [self.decode(prompt, self.new_tokens, plan) for _ in range(repeats)]
        return min(runs, key=lambda run: run[1].seconds)

    def _fastest_plain(self, i: int) -> tuple[list[int], Stats]:
        run = self._fastest(self.prompts[i], None, 1 if i in self._plain else self.repeats)
        if i not in self._plain or run[1].seconds < self._plain[i][1].seconds:
            self._plain[i] = run
        return self._plain[i]

    def measure(self, plan: DraftPlan) -> dict:
        plain_seconds = spec_seconds = tokens = rounds = accepted = 0
        identical = True
        mix: dict[str, int] = {}
        for i, prompt in enumerate(self.prompts):
            plain_out, plain = self._fastest_plain(i)
            spec_out, spec = self._fastest(prompt, plan, self.repeats)
            identical &= plain_out == spec_out
            plain_seconds += plain.seconds
            spec_seconds += spec.seconds
            tokens += spec.new_tokens
            rounds += spec.rounds
            accepted += spec.accepted
            for label, count in spec.source_mix.items():
                mix[label] = mix.get(label, 0) + count
        return {
            "confirmed_round_mix": {label: round(count / max(rounds, 1), 4) for label, count in sorted(mix.items())},
            "confirmed_speedup": round(plain_seconds / spec_seconds, 4),
            "confirmed_mean_accepted": round((accepted + rounds) / max(rounds, 1), 4),
            "confirmed_tokens_per_s": round(tokens / spec_seconds, 2),
            "plain_tokens_per_s": round(tokens / plain_seconds, 2),
            "confirmed_identical": identical,
        }

    def race(
        self,
        plans: list[DraftPlan],
        min_turns: int = MIN_TURNS,
        max_turns: int = 16,
        deadline: float | None = None,
        clock=time.perf_counter,
        progress=None,
    ) -> tuple[dict, dict]:
        """Time ``plans`` against plain decoding in turns until it is sure, not a fixed number of times.

        A turn decodes one prompt (the prompts in rotation) plainly and with every plan still racing, in an
        order that alternates from turn to turn; each plan's sample is log(plain seconds / its seconds) of
        that turn, so machine noise common to the turn cancels. After ``min_turns`` a plan leaves the race
        when its 95% interval against plain decoding lies below 1.0 (surely slower than plain), or below the
        leader's (paired per turn); the race ends when the leader's interval excludes 1.0 and every other
        plan has left or is surely within ``TIE`` of it, at ``max_turns``, or before a turn that would end
        past ``deadline`` (a ``clock`` time; the first turn always runs, and no plan leaves nor is the race
        sure before ``min_turns``, or one turn's noise would pick the plan). Returns each plan's figures and
        notes on how the race ended."""
        names = [plan.name for plan in plans]
        samples: dict[str, list[float]] = {name: [] for name in names}
        runs: dict[str, list[tuple[Stats, Stats]]] = {name: [] for name in names}  # (plain, plan) per turn
        identical = {name: True for name in names}
        left: dict[str, str] = {}  # plan -> why it left the race
        alive, turn, stopped = list(plans), 0, "max turns"
        began = clock()
        while turn < max_turns:
            # after the first turn, a turn starts only if one as long as the turns so far ends by the deadline
            # (the budget's reserve is sized for ``min_turns``; a machine slower than timed gets fewer)
            if turn and deadline is not None and clock() + (clock() - began) / turn >= deadline:
                stopped = "budget"
                break
            prompt = self.prompts[turn % len(self.prompts)]
            order = [None] + alive if turn % 2 == 0 else alive[::-1] + [None]
            outputs = {}
            for plan in order:
                outputs[plan.name if plan else None] = self.decode(prompt, self.new_tokens, plan)
            plain_out, plain = outputs[None]
            for plan in alive:
                out, stats = outputs[plan.name]
                identical[plan.name] &= out == plain_out
                runs[plan.name].append((plain, stats))
                samples[plan.name].append(math.log(plain.seconds / max(stats.seconds, 1e-9)))
            turn += 1
            if progress is not None:
                progress.update(1)
            if turn < min_turns:
                continue
            leader = max(alive, key=lambda p: interval(samples[p.name])[0])
            for plan in list(alive):
                if interval(samples[plan.name])[2] < 0:
                    left[plan.name] = "slower than plain"
                elif plan is not leader and _versus(samples[plan.name], samples[leader.name])[2] < 0:
                    left[plan.name] = f"slower than {leader.name}"
                else:
                    continue
                alive.remove(plan)
            if not alive:
                stopped = "every plan slower than plain"
                break
            ties = all(
                -TIE < _versus(samples[p.name], samples[leader.name])[1]
                and _versus(samples[p.name], samples[leader.name])[2] < TIE
                for p in alive
                if p is not leader
            )
            if leader in alive and interval(samples[leader.name])[1] > 0 and ties:
                stopped = "sure"
                break
        figures = {}
        for name in names:
            plain_s = sum(p.seconds for p, _ in runs[name])
            spec_s = sum(s.seconds for _, s in runs[name])
            tokens = sum(s.new_tokens for _, s in runs[name])
            rounds = sum(s.rounds for _, s in runs[name])
            mix: dict[str, int] = {}
            for _, s in runs[name]:
                for label, count in s.source_mix.items():
                    mix[label] = mix.get(label, 0) + count
            _, lo, hi = interval(samples[name])
            figures[name] = {
                "confirmed_round_mix": {label: round(c / max(rounds, 1), 4) for label, c in sorted(mix.items())},
                "confirmed_speedup": round(plain_s / spec_s, 4),
                "confirmed_interval": [
                    round(math.exp(lo), 4) if lo > -math.inf else None,
                    round(math.exp(hi), 4) if hi < math.inf else None,
                ],
                "confirmation_turns": len(runs[name]),
                "confirmation_stopped": left.get(name, stopped),
                "confirmed_mean_accepted": round((sum(s.accepted for _, s in runs[name]) + rounds) / max(rounds, 1), 4),
                "confirmed_tokens_per_s": round(tokens / spec_s, 2),
                "plain_tokens_per_s": round(tokens / plain_s, 2),
                "confirmed_identical": identical[name],
            }
        if len(names) > 1:  # each plan against the fastest, paired per turn: can the turns tell them apart?
            best = max(names, key=lambda name: figures[name]["confirmed_speedup"])
            for name in names:
                if name != best:
                    _, lo, hi = _versus(samples[name], samples[best])
                    figures[name]["confirmed_vs_best"] = {
                        "plan": best,
                        "interval": [
                            round(math.exp(lo), 4) if lo > -math.inf else None,
                            round(math.exp(hi), 4) if hi < math.inf else None,
                        ],
                    }
        return figures, {"confirmation_turns": turn, "confirmation_stopped": stopped}


def race_candidates(ranked: list[DraftPlan], top: int | None, close: float | None) -> list[DraftPlan]:
    """The plans worth timing, from ``ranked`` (highest expected speedup first): the first ``top``, and with
    ``close`` of those only the best and the ones predicted faster than plain decoding and within ``close``
    times the best prediction."""
    chosen = ranked[:top] if top else list(ranked)
    if close is None or not chosen:
        return chosen
    floor = max(1.0, close * (chosen[0].measured.get("expected_speedup") or 0.0))
    return [chosen[0]] + [p for p in chosen[1:] if (p.measured.get("expected_speedup") or 0.0) >= floor]


class ConfirmPlans(Pass):
    """Confirm plans not yet confirmed by timed runs, and record the prediction error.

    With ``top`` set, only the ``top`` plans with the highest expected speedup are timed (the others keep
    their prediction and ``confirmed_speedup`` None): on a 135M model each confirmation costs tens of
    seconds, and a plan predicted well below the best is not worth them. ``close`` also leaves out plans
    predicted slower than plain decoding or below ``close`` times the best prediction (a budgeted build's race:
    every plan in it adds a decode to each turn, and a plan predicted well below the leader can take a large share
    of the confirmation; measured: docs/history.md, 'Figures behind the code's constants'). With ``sequential`` the
    timed plans race in turns (``Confirmer.race``) until the leader is sure against plain decoding, or the deadline;
    otherwise each is timed a fixed number of times (``Confirmer.measure``)."""

    name = "confirm_plans"

    def __init__(
        self,
        context,
        show_progress: bool = True,
        top: int | None = None,
        sequential: bool = False,
        min_turns: int = MIN_TURNS,
        max_turns: int | None = None,
        close: float | None = None,
    ):
        self.context, self.show_progress, self.top, self.close = context, show_progress, top, close
        self.sequential, self.min_turns, self.max_turns = sequential, min_turns, max_turns

    def call(self, ir: DecoderIR) -> PassResult:
        confirmer = None
        c = self.context
        ranked = sorted(ir.plans.values(), key=lambda p: -(p.measured.get("expected_speedup") or 0.0))
        chosen = race_candidates(ranked, self.top, self.close)
        for plan in ranked[len(chosen) :]:
            plan.measured.setdefault("confirmed_speedup", None)
        todo = [plan for plan in chosen if plan.measured.get("confirmed_speedup") is None]
        timed = {}
        for plan in todo:
            timed[plan.name] = plan
            if (
                plan.option("retrieval", "datastore") and c.confirm_datastore
            ):  # never confirm on a datastore holding the prompts' answers
                timed[plan.name] = plan.with_options(retrieval={"datastore": c.confirm_datastore})
        notes = {}
        if todo:
            confirmer = Confirmer(
                c.runner.backend(ir.plans), c.confirm_prompts, c.confirm_tokens, root=c.workdir, eos=c.eos
            )
            desc = f"confirming plans on {c.runner.name}"
            if self.sequential:
                max_turns = self.max_turns or MAX_TURNS_PER_PROMPT * len(c.confirm_prompts)
                with BudgetBar(total=max_turns, desc=desc, disable=not self.show_progress, budget=c.budget) as bar:
                    figures, notes = confirmer.race(
                        list(timed.values()), self.min_turns, max_turns, self.deadline, progress=bar
                    )
                for plan in todo:
                    plan.measured.update(figures[timed[plan.name].name])
            else:
                for plan in tqdm(todo, desc=desc, disable=not self.show_progress):
                    plan.measured.update(confirmer.measure(timed[plan.name]))
        for plan in chosen:
            predicted = plan.measured.get("expected_speedup")
            if predicted and plan.measured.get("confirmed_speedup"):
                error = (predicted - plan.measured["confirmed_speedup"]) / plan.measured["confirmed_speedup"]
                plan.measured["prediction_error"] = round(error, 4)
        return PassResult(ir, modified=bool(todo), notes={"confirmed": [p.name for p in todo], **notes})


def tied_with_best(plan: DraftPlan, best: DraftPlan) -> bool:
    """Whether ``plan``'s race against the fastest plan ``best`` left it not surely slower (the paired interval of
    their speedups reaches 1.0), and the two were priced by the same estimator (``measured.method``): each has its
    own bias, which cancels only between plans priced alike (lookahead's run-based pricing over-predicts; settled
    against lookup's replay, it made a build ship the slower plan; measured: docs/history.md, 'Figures behind the
    code's constants')."""
    versus = plan.measured.get("confirmed_vs_best") or {}
    hi = (versus.get("interval") or [None, None])[1]
    return (
        versus.get("plan") == best.name
        and (hi is None or hi >= 1.0)
        and plan.measured.get("method") == best.measured.get("method")
    )


class ChooseDefaultPlan(Pass):
    """Make the plan with the highest confirmed speedup the artifact's default, but only if it beat
    plain decoding in its own confirmation: otherwise the artifact has no default plan and decodes
    plainly (``generate`` says so). With ``keep_only_default`` drop the other plans (``--method auto``
    keeps only the winner, recording the others' figures).

    When the race could not tell the fastest plan from another priced by the same estimator (``tied_with_best``),
    the one with the higher expected speedup wins: the estimate replays every calibration sequence, a budgeted
    race times three or four prompts. Why: a short race settled by 1% between two such plans shipped the one the
    benchmark prompts ran slower, which the estimate had ranked second (measured: docs/history.md, 'Figures
    behind the code's constants')."""

    name = "choose_default_plan"

    def __init__(self, keep_only_default: bool = False, min_speedup: float = 1.0):
        self.keep_only_default, self.min_speedup = keep_only_default, min_speedup

    def call(self, ir: DecoderIR) -> PassResult:
        if not ir.plans:
            ir.tuning["best_confirmed_speedup"] = 0.0
            ir.default_plan = None
            return PassResult(ir, notes={"default": None})
        fastest = max(ir.plans, key=lambda name: ir.plans[name].measured.get("confirmed_speedup") or 0.0)
        tied = [
            name
            for name, plan in ir.plans.items()
            if tied_with_best(plan, ir.plans[fastest])
            and (plan.measured.get("confirmed_speedup") or 0.0) > self.min_speedup
        ]
        best = max([fastest] + tied, key=lambda name: ir.plans[name].measured.get("expected_speedup") or 0.0)
        if best != fastest:
            ir.tuning["default_by_estimate"] = {
                "chosen": best,
                "over": fastest,
                "why": "timed runs could not tell them apart",
            }
        speedup = ir.plans[best].measured.get("confirmed_speedup") or 0.0
        ir.tuning["best_confirmed_speedup"] = speedup
        ir.default_plan = best if speedup > self.min_speedup else None
        if self.keep_only_default:
            winner = ir.plans[best]
            winner.measured["chosen_over"] = {
                name: plan.measured.get("confirmed_speedup") for name, plan in ir.plans.items() if name != winner.name
            }
            ir.plans = {winner.name: winner}
        return PassResult(ir, modified=True, notes={"default": ir.default_plan})
