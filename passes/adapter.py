"""Trained exit adapters and reduced-vocabulary draft heads (Kangaroo / EESD style; the target stays frozen).

An early exit through the shared final norm and lm_head drafts poorly on a model never trained for it.
This pass trains only a small *draft head* on the hidden state after block E (``runtime/artifact/draft_head_file.py``:
a gated MLP of the model's width, added to the residual stream, then the model's own final norm and
lm_head), and picks the draft vocabulary:

1. **Data, teacher-forced.** The full model's own logits are the targets at every position, so any text
   works with one parallel forward per chunk (far cheaper than generating): the calibration prompts
   with the target's greedy continuations, then an offline default corpus, the Python standard
   library's sources and docstrings (on every machine). One forward per chunk keeps, per position, the
   hidden state at each candidate exit and the teacher's top-k log-probabilities, so training never
   runs the model again.
2. **Training.** AdamW on the adapter only, over a training vocabulary (the tokens the target predicts
   most often, capped at ``TRAIN_VOCAB`` rows so a 49k-row head stays affordable on a CPU), with
   ``kl`` (KL divergence from the teacher's top-k distribution) or ``top1`` (cross-entropy against its argmax),
   until the data's epochs or the time budget run out; the budget ends training cleanly between steps.
   The adapter's ``down`` starts at zero: before training the draft *is* the shared-head exit.
3. **Choice.** ``--exit-layer auto`` trains briefly at a few exits and continues with the one of best
   expected speedup; then the draft vocabulary N (the N tokens the target produces most often, or the
   full vocabulary) is chosen by the same objective (acceptance from the calibration continuations,
   cost from the backend's timings, ``StepCosts``). The verifier always uses the full head.

``DraftVocabTune`` gives other model plans (layer skip, shared-head early exit) a reduced vocabulary
when that pays, with a draft head file holding only the ids.
"""

from __future__ import annotations

import math
import sysconfig
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from speccompile.runtime.artifact.draft_head_file import DraftHead
from speccompile.runtime.artifact.manifest import DraftPlan
from speccompile.runtime.backends.torch.backend import TorchDraftHead
from speccompile.runtime.drafting import has_model_part
from speccompile.runtime.errors import SpeccompileError

from .budget import ADAPTER_GAIN, PERFECT, RATE_SLACK, agreement_seconds, exit_agreements, model_draft_bound, needed
from .cost_model import _best_seconds
from .ir import DecoderIR
from .pass_manager import BOUND_MARGIN, Pass, PassResult, incumbent
from .plans import tuned_target
from .tuning import TuningContext

DRAFT_HEADS_DIR = "draft_heads"
MAX_DEFAULT_TOKENS = 32768  # teacher-forced training positions (calibration + continuations first, then the corpus)
TOKENS_PER_WIDTH = 64  # default data: 64 positions per hidden unit (the adapter has ~3 d^2 .. 8 d^2 weights), capped
DEFAULT_TIME_BUDGET = 300.0  # seconds for the whole pass: teacher pass, training, choices
LEAST_SECONDS = 10.0  # a budgeted build trains an adapter only with at least this long left
DEFAULT_LOSS = "kl"
LOSSES = ("kl", "top1")
TRAIN_VOCAB = 16384  # rows of the head the adapter is trained against (all of them on smaller vocabularies)
TEACHER_TOP_K = 16
CHUNK = 256  # tokens per teacher-forced sequence
BATCH = 512
LEARNING_RATE = 2e-3
MAX_EPOCHS = 6
HOLDOUT = 0.1  # share of the corpus chunks kept out of training to measure exit agreement
VOCAB_CANDIDATES = (512, 1024, 2048, 4096, 8192, 16384)


# -- data -------------------------------------------------------------------------------------------
def stdlib_corpus(max_chars: int) -> list[str]:
    """Python standard library sources (code and docstrings), spread over the library, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in root.rglob("*.py")
        if not {"test", "tests", "idle_test", "site-packages", "__pycache__"} & set(p.relative_to(root).parts)
    )
    texts, total = [], 0
    if not files:
        return texts
    stride = max(1, len(files) // 400)  # about 400 files from all over the library, not the first few packages
    for path in files[::stride]:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        text = text[:8000]
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return texts


def default_tokens(hidden_size: int) -> int:
    """Training positions when ``--adapter-tokens`` is not given: in proportion to the model's width (a tiny
    test model needs a few thousand; from 512 wide, the cap)."""
    return int(min(MAX_DEFAULT_TOKENS, max(2048, TOKENS_PER_WIDTH * hidden_size)))


def chunked(sequences: list[list[int]], length: int) -> list[list[int]]:
    out = []
    for seq in sequences:
        out += [seq[i : i + length] for i in range(0, len(seq), length) if len(seq[i : i + length]) > 1]
    return out


@dataclass
class TeacherData:
    """Per teacher-forced position: the hidden state after each candidate exit and the full model's top-k."""

    hidden: dict[int, torch.Tensor]  # exit layer -> [N, d]
    top_ids: torch.Tensor  # [N, k] int64, best first
    top_logprobs: torch.Tensor  # [N, k]
    train: torch.Tensor  # [N] bool: used for training (else held out)
    seconds: float = 0.0

    @property
    def argmax(self) -> torch.Tensor:
        return self.top_ids[:, 0]


@torch.no_grad()
def teacher_data(
    decoder,
    chunks: list[list[int]],
    exits: list[int],
    holdout: set[int],
    top_k: int = TEACHER_TOP_K,
    show_progress: bool = True,
) -> TeacherData:
    """One full-model forward per chunk, keeping the hidden state at each exit and the teacher's top-k."""
    start = time.perf_counter()
    device = decoder.embed.weight.device
    hidden: dict[int, list] = {e: [] for e in exits}
    ids, logprobs, train = [], [], []
    for c, chunk in enumerate(tqdm(chunks, desc="adapter: teacher pass", disable=not show_progress)):
        h = decoder.embed_tokens(torch.tensor([chunk], device=device), 0)
        for i in range(decoder.config.num_layers):
            h = decoder.run_blocks(h, 0, None, i, i + 1)
            if i + 1 in hidden:
                hidden[i + 1].append(h[0].clone())
        logits = decoder.head(h)[0].float()
        top = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1)
        ids.append(top.indices)
        logprobs.append(top.values - torch.logsumexp(logits, dim=-1, keepdim=True))
        train.append(torch.full((len(chunk),), c not in holdout, dtype=torch.bool))
    return TeacherData(
        hidden={e: torch.cat(v) for e, v in hidden.items()},
        top_ids=torch.cat(ids),
        top_logprobs=torch.cat(logprobs),
        train=torch.cat(train),
        seconds=time.perf_counter() - start,
    )


def vocab_ranking(counts_first: list[list[int]], counts_then: torch.Tensor, vocab_size: int) -> np.ndarray:
    """Token ids by how often the target produces them: its calibration continuations first (what a real run
    verifies), ties and the rest ordered by its argmax over the training text; tokens it never produced last."""
    first = np.bincount(
        np.concatenate([np.asarray(s, dtype=np.int64) for s in counts_first] or [np.zeros(0, np.int64)]),
        minlength=vocab_size,
    )[:vocab_size]
    then = np.bincount(counts_then.cpu().numpy(), minlength=vocab_size)[:vocab_size]
    score = first.astype(np.float64) * (then.sum() + 1) + then
    order = np.argsort(-score, kind="stable")
    return order[: int((score > 0).sum())]


# -- training ---------------------------------------------------------------------------------------
@dataclass
class TrainLog:
    steps: int = 0
    samples: int = 0
    seconds: float = 0.0
    first_loss: float | None = None
    final_loss: float | None = None
    stopped_by: str = "epochs"
    losses: list[float] = field(default_factory=list)


class AdapterTrainer:
    """Trains one exit adapter at ``exit_layer`` against the teacher data; resumable (``train`` again with
    more time continues from the current weights and optimizer state)."""

    def __init__(
        self,
        decoder,
        data: TeacherData,
        exit_layer: int,
        train_vocab: np.ndarray | None,
        loss: str = DEFAULT_LOSS,
        width: int | None = None,
        seed: int = 0,
    ):
        if loss not in LOSSES:
            raise ValueError(f"unknown adapter loss {loss!r}; choose one of {LOSSES}")
        torch.manual_seed(seed)
        for p in decoder.parameters():  # the target is frozen: no gradient ever reaches it
            p.requires_grad_(False)
        self.decoder, self.data, self.exit_layer, self.loss = decoder, data, exit_layer, loss
        self.kernel = TorchDraftHead(decoder, width or decoder.config.intermediate_size, train_vocab)
        V = decoder.config.vocab_size
        index = torch.full((V,), -1, dtype=torch.long)
        index[torch.as_tensor(train_vocab if train_vocab is not None else np.arange(V))] = torch.arange(
            len(train_vocab) if train_vocab is not None else V
        )
        self.target_index = index[data.top_ids]  # [N, k]: the teacher's top-k in training-vocabulary rows (-1: absent)
        self.positions = torch.nonzero(data.train).flatten()
        self.optimizer = torch.optim.AdamW(
            [p for p in self.kernel.parameters() if p.requires_grad], lr=LEARNING_RATE, weight_decay=0.0
        )
        self.generator = torch.Generator().manual_seed(seed)
        self.log = TrainLog()

    def batch_loss(self, rows: torch.Tensor) -> torch.Tensor:
        h = self.data.hidden[self.exit_layer][rows]
        logq = F.log_softmax(self.kernel(h).float(), dim=-1)
        index = self.target_index[rows]
        present = index >= 0
        if self.loss == "top1":
            return F.nll_loss(logq, index[:, 0].clamp(min=0), reduction="none")[present[:, 0]].mean()
        p = self.data.top_logprobs[rows].exp() * present
        p = p / p.sum(-1, keepdim=True).clamp(min=1e-9)  # the teacher's top-k, renormalised over the training rows
        return (torch.special.xlogy(p, p) - p * logq.gather(1, index.clamp(min=0))).sum(-1).mean()  # KL(p || q)

    def train(
        self,
        seconds: float,
        max_epochs: float = MAX_EPOCHS,
        batch: int = BATCH,
        show_progress: bool = True,
        desc: str = "adapter: training",
    ) -> TrainLog:
        """Train for at most ``seconds`` (ends cleanly between steps) or ``max_epochs`` passes over the data."""
        log, n = self.log, len(self.positions)
        if n == 0:
            return log
        total_steps = max(1, math.ceil(max_epochs * n / batch))
        start = time.perf_counter()
        self.kernel.train()
        with tqdm(total=total_steps, desc=desc, disable=not show_progress) as bar:
            for step in range(total_steps):
                elapsed = time.perf_counter() - start
                if elapsed >= seconds:
                    log.stopped_by = "time budget"
                    break
                progress = max(step / total_steps, elapsed / seconds)
                for group in self.optimizer.param_groups:  # cosine decay to 10% over the run (steps or time)
                    group["lr"] = LEARNING_RATE * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))
                rows = self.positions[torch.randint(0, n, (min(batch, n),), generator=self.generator)]
                loss = self.batch_loss(rows)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
                value = float(loss.detach())
                log.losses.append(value)
                log.first_loss = value if log.first_loss is None else log.first_loss
                log.steps += 1
                log.samples += len(rows)
                bar.update(1)
                bar.set_postfix(loss=f"{value:.3f}")
            else:
                log.stopped_by = "epochs"
        log.seconds += time.perf_counter() - start
        recent = log.losses[-max(1, min(20, len(log.losses) // 5)) :]
        log.final_loss = float(np.mean(recent)) if recent else None
        self.kernel.eval()
        return log

    @torch.no_grad()
    def distillation_loss(self, rows: torch.Tensor | None = None) -> float:
        """Mean training loss over ``rows`` (default: the held-out positions); nan over no rows."""
        rows = torch.nonzero(~self.data.train).flatten() if rows is None else rows
        return float(self.batch_loss(rows)) if len(rows) else float("nan")

    def draft_head(self, vocab: np.ndarray | None) -> DraftHead:
        return DraftHead(adapter=self.kernel.adapter_arrays(), vocab=vocab, exit_layer=self.exit_layer)


@torch.no_grad()
def exit_agreement(decoder, data: TeacherData, exit_layer: int, head: DraftHead | None, rows: torch.Tensor) -> float:
    """Share of ``rows`` where the draft's argmax (shared head when ``head`` is None) is the target's."""
    if len(rows) == 0:
        return float("nan")
    h = data.hidden[exit_layer][rows]
    kernel = TorchDraftHead.from_draft_head(decoder, head) if head is not None else None
    hits = 0
    for part in torch.split(torch.arange(len(rows)), 1024):
        logits = decoder.head(h[part]) if kernel is None else kernel.full_logits(h[part])
        hits += int((logits.argmax(-1) == data.argmax[rows[part]]).sum())
    return hits / len(rows)


def time_heads(decoder, vocab: int, repeats: int = 30) -> float:
    """Measured cost ratio full head / reduced head of ``vocab`` rows for one token (min over repeats)."""
    h = torch.randn(
        1, 1, decoder.config.hidden_size, dtype=decoder.embed.weight.dtype, device=decoder.embed.weight.device
    )
    reduced = TorchDraftHead(decoder, None, np.arange(vocab))

    def best(fn) -> float:
        fn()  # warm-up
        return min(_best_seconds(fn) for _ in range(repeats))

    with torch.inference_mode():
        return best(lambda: decoder.head(h)) / best(lambda: reduced(h))


# -- the passes -------------------------------------------------------------------------------------
def write_head(context: TuningContext, name: str, head: DraftHead) -> str:
    """Save ``head`` in the tuning run's folder; its artifact-relative path."""
    relative = f"{DRAFT_HEADS_DIR}/{name}.safetensors"
    head.save(context.workdir / relative)
    return relative


def candidate_exits(num_layers: int) -> list[int]:
    """A few exit layers to try: a quarter, a third and half of the depth."""
    return sorted({max(1, min(num_layers - 1, round(num_layers * f))) for f in (0.25, 1 / 3, 0.5)})


def vocab_candidates(ranking: np.ndarray, vocab_size: int) -> list[int | None]:
    """Draft vocabulary sizes to score: powers of two below the vocabulary the target was seen to produce,
    and the full vocabulary (None)."""
    return [n for n in VOCAB_CANDIDATES if n <= len(ranking) and n < vocab_size] + [None]


class AdapterAutotune(Pass):
    """Train an exit adapter (``--method adapter``) and add plan ``adapter`` with its tuned draft vocabulary."""

    name = "adapter_autotune"

    def __init__(
        self,
        context: TuningContext,
        encode: Callable[[str], list[int]] | None = None,
        exit_layer: int | None = None,
        tokens: int | None = None,
        time_budget: float | None = None,
        loss: str = DEFAULT_LOSS,
        plan_name: str = "adapter",
        show_progress: bool = True,
        corpus: list[str] | None = None,
    ):
        self.context, self.encode, self.exit_layer, self.tokens = context, encode, exit_layer, tokens
        self.time_budget = time_budget or DEFAULT_TIME_BUDGET
        self.loss, self.plan_name, self.show_progress, self.corpus = loss, plan_name, show_progress, corpus
        self.adds = (plan_name,)

    def exits(self, num_layers: int) -> list[int]:
        return [self.exit_layer] if self.exit_layer is not None else candidate_exits(num_layers)

    def gain(self) -> float:
        """The share of the shared head's disagreements an adapter may fix in the time it has: ``ADAPTER_GAIN``
        with the full default time, less with less (by the square root of the share of it: training gains most
        in its first steps): a bound computed as if a short training had its full time promised far more than
        the training reached (measured: docs/history.md, 'Figures behind the code's constants')."""
        left = self.seconds_left()
        share = 1.0 if left is None else min(max(left, 0.0) / DEFAULT_TIME_BUDGET, 1.0)
        return ADAPTER_GAIN * share**0.5

    def bound(self, ir: DecoderIR) -> float:
        """At each exit it may train at: the shared-head agreement with ``gain`` of the rest closed, the draft step
        with the adapter and the smallest draft vocabulary (``passes/budget.py``); the agreement only at exits
        where perfect drafts could beat the incumbent."""
        vocab = VOCAB_CANDIDATES[0] if ir.config.vocab_size > VOCAB_CANDIDATES[0] else None
        plans = {
            e: DraftPlan.of(name="bound", exit_layer=e, head=f"adapter:{e}", draft_vocab=vocab, draft_head_file="x")
            for e in self.exits(ir.config.num_layers)
        }
        bounds = {e: model_draft_bound(self.context, plan, PERFECT) for e, plan in plans.items()}
        gain = self.gain()
        for e, agreement in exit_agreements(self.context, needed(bounds, incumbent(ir) * (1 + BOUND_MARGIN))).items():
            rate = agreement + gain * (1 - agreement) + RATE_SLACK
            bounds[e] = min(bounds[e], model_draft_bound(self.context, plans[e], rate))
        return max(bounds.values())

    def least_seconds(self) -> float:
        """Some training (``LEAST_SECONDS``), after the exit agreements its bound reads, where no bound read them
        yet (``agreement_seconds``)."""
        return LEAST_SECONDS + agreement_seconds(self.context)

    def _chunks(self, length: int) -> tuple[list[list[int]], set[int]]:
        """Calibration prompts + the target's continuations (not the confirmation prompts'), then the
        corpus; indexes of held-out corpus chunks."""
        own = chunked([ref.tokens[0].tolist() for ref in self.context.training_references], length)
        tokens = self.tokens or default_tokens(self.context.ir.config.hidden_size)
        if self.tokens is None and self.time_budget < DEFAULT_TIME_BUDGET:  # less time: less teacher data to make
            tokens = max(2048, round(tokens * self.time_budget / DEFAULT_TIME_BUDGET))
        budget = max(0, tokens - sum(map(len, own)))
        corpus: list[list[int]] = []
        if budget and self.encode is not None:
            texts = self.corpus if self.corpus is not None else stdlib_corpus(max_chars=budget * 6)
            for piece in chunked([self.encode(t) for t in texts], length):
                corpus.append(piece)
                budget -= len(piece)
                if budget <= 0:
                    break
        step = max(2, round(1 / HOLDOUT))
        holdout = {len(own) + i for i in range(len(corpus)) if i % step == step - 1}
        return own + corpus, holdout

    def call(self, ir: DecoderIR) -> PassResult:
        start, before = time.perf_counter(), dict(ir.plans)
        left = self.seconds_left()
        if left is not None:  # budgeted: the pass's own budget is what is left of the build's
            self.time_budget = max(min(self.time_budget, left), 1.0)
        context, decoder, L = self.context, ir.decoder(), ir.config.num_layers
        if self.exit_layer is not None and not 1 <= self.exit_layer < L:
            raise SpeccompileError(
                f"--exit-layer {self.exit_layer} is outside 1..{L - 1} for this {L}-block model; "
                "pick an exit inside the model or pass auto"
            )
        exits = self.exits(L)
        length = min(CHUNK, ir.config.max_position_embeddings)
        chunks, holdout = self._chunks(length)
        data = teacher_data(decoder, chunks, exits, holdout, show_progress=self.show_progress)
        continuations = [ref.targets.tolist() for ref in context.training_references]
        ranking = vocab_ranking(continuations, data.argmax[data.train], ir.config.vocab_size)
        train_vocab = ranking[:TRAIN_VOCAB] if ir.config.vocab_size > TRAIN_VOCAB else None
        remaining = lambda: self.time_budget - (time.perf_counter() - start)  # noqa: E731

        trainers, exit_scores = {}, {}
        if len(exits) > 1:  # a short run at each candidate exit, then the best continues
            share = max(remaining(), 1.0) * 0.4 / len(exits)
            for e in exits:
                trainers[e] = AdapterTrainer(decoder, data, e, train_vocab, self.loss)
                trainers[e].train(
                    share, max_epochs=1, show_progress=self.show_progress, desc=f"adapter: trying exit {e}"
                )
                plan = self._plan(
                    e,
                    write_head(context, f"candidate-{e}", trainers[e].draft_head(train_vocab)),
                    len(train_vocab) if train_vocab is not None else None,
                )
                exit_scores[e] = context.score(plan).expected_speedup
            exit_layer = max(exit_scores, key=exit_scores.get)
        else:
            exit_layer = exits[0]
            trainers[exit_layer] = AdapterTrainer(decoder, data, exit_layer, train_vocab, self.loss)
        trainer = trainers[exit_layer]
        held = torch.nonzero(~data.train).flatten()  # empty without a corpus: held-out figures are then None
        loss_before = AdapterTrainer(decoder, data, exit_layer, train_vocab, self.loss).distillation_loss(held)
        trainer.train(
            max(remaining() * 0.85, 1.0), show_progress=self.show_progress, desc=f"adapter: training exit {exit_layer}"
        )
        log = trainer.log

        # The draft vocabulary, by the objective; the chosen file is the plan's draft head.
        best = None
        vocab_scores = {}
        for n in vocab_candidates(ranking, ir.config.vocab_size):
            vocab = ranking[:n] if n is not None else None
            relative = write_head(context, f"{self.plan_name}-vocab-{n or 'full'}", trainer.draft_head(vocab))
            plan = self._plan(exit_layer, relative, n)
            estimate = context.score(plan)
            vocab_scores[str(n or "full")] = round(estimate.expected_speedup, 4)
            if best is None or estimate.expected_speedup > best[1].expected_speedup:
                best = (plan, estimate, vocab)
        plan, estimate, vocab = best
        final = trainer.draft_head(vocab)
        relative = write_head(context, self.plan_name, final)
        shared_plan = DraftPlan.of(name="shared", exit_layer=exit_layer)
        measured = context.record(
            "adapter",
            estimate,
            tuning_seconds=round(time.perf_counter() - start, 2),
            adapter={
                "exit_layer": exit_layer,
                "width": trainer.kernel.gate.out_features,
                "parameters": int(sum(a.size for a in final.adapter.values())),
                "loss": self.loss,
                "tokens": int(data.train.sum()),
                "held_out_tokens": int((~data.train).sum()),
                "confirmation_held_out": context.confirmation_held_out,
                "teacher_seconds": round(data.seconds, 2),
                "train_seconds": round(log.seconds, 2),
                "steps": log.steps,
                "epochs": round(log.samples / max(int(data.train.sum()), 1), 2),
                "stopped_by": log.stopped_by,
                "first_loss": _round(log.first_loss),
                "final_loss": _round(log.final_loss),
                "held_out_loss_before": _round(loss_before),
                "held_out_loss_after": _round(trainer.distillation_loss()),
                "held_out_agreement_before": _round(exit_agreement(decoder, data, exit_layer, None, held)),
                "held_out_agreement_after": _round(exit_agreement(decoder, data, exit_layer, final, held)),
                "exit_agreement_before": round(context.profile(shared_plan).match_rate, 4),
                "exit_agreement_after": round(
                    context.profile(plan.with_params(draft_head_file=relative)).match_rate, 4
                ),
                "exit_layer_scores": {str(e): round(s, 4) for e, s in exit_scores.items()},
            },
            draft_vocab_scores=vocab_scores,
            **head_cost_figures(context, decoder, plan.draft_vocab),
        )
        plan = replace(
            plan.with_options(model={"max_draft": estimate.max_draft, "threshold": estimate.threshold}).with_params(
                draft_head_file=relative
            ),
            name=self.plan_name,
            measured=measured,
        )
        plan.set_option("model", "target_acceptance", tuned_target(measured))
        ir.add_plan(plan)
        ir.extra_files[relative] = context.workdir / relative
        return PassResult.after(ir, before, seconds_budget=round(self.time_budget, 1))

    def _plan(self, exit_layer: int, relative: str, vocab: int | None) -> DraftPlan:
        return DraftPlan.of(
            name="candidate",
            exit_layer=exit_layer,
            head=f"adapter:{exit_layer}",
            draft_vocab=vocab,
            draft_head_file=relative,
        )


def head_cost_figures(context: TuningContext, decoder, vocab: int | None) -> dict:
    """The draft head's cost against the full head's: from the cost model, and timed here."""
    if vocab is None:
        return {}
    cost = context.cost
    modeled = cost.head[0] / max(
        cost.head[0]
        + cost.draft_head_extra(DraftPlan.of(name="x", exit_layer=1, draft_vocab=vocab, draft_head_file="x")),
        1e-12,
    )
    return {"head_cost_ratio": round(modeled, 2), "head_cost_ratio_timed": round(time_heads(decoder, vocab), 2)}


def _round(x: float | None) -> float | None:
    return None if x is None or x != x else round(float(x), 4)


class DraftVocabTune(Pass):
    """Give the named model plans (layer skip, shared-head early exit) a reduced draft vocabulary when it pays:
    the N tokens the target produced most often in its calibration continuations, N by the objective."""

    name = "draft_vocab_tune"

    def __init__(self, context: TuningContext, plan_names: tuple[str, ...]):
        self.context, self.plan_names = context, plan_names
        self.adds = self.needs = tuple(plan_names)

    def _plans(self, ir: DecoderIR) -> list[DraftPlan]:
        return [
            p
            for p in (ir.plans.get(name) for name in self.plan_names)
            if p is not None and has_model_part(p) and p.draft_head_file is None
        ]

    def bound(self, ir: DecoderIR) -> float:
        """Each model plan's measured acceptance (plus slack) at the draft step of the smallest vocabulary."""
        vocab = VOCAB_CANDIDATES[0] if ir.config.vocab_size > VOCAB_CANDIDATES[0] else None
        return max(
            [
                model_draft_bound(
                    self.context,
                    p.with_params(draft_vocab=vocab, draft_head_file="x"),
                    p.measured.get("acceptance_rate", 1.0) + RATE_SLACK,
                )
                for p in self._plans(ir)
            ],
            default=0.0,
        )

    def call(self, ir: DecoderIR) -> PassResult:
        before = dict(ir.plans)
        context = self.context
        references = context.training_references  # the confirmation prompts' text stays unseen
        continuations = [ref.targets.tolist() for ref in references]
        prompts = torch.as_tensor(np.concatenate([ref.tokens[0, : ref.prompt_len].cpu().numpy() for ref in references]))
        ranking = vocab_ranking(continuations, prompts, ir.config.vocab_size)
        for plan in self._plans(ir):
            name = plan.name
            start = time.perf_counter()
            base = context.score(plan)
            best, scores = None, {}
            for n in vocab_candidates(ranking, ir.config.vocab_size)[:-1]:
                relative = write_head(
                    context, f"{name}-vocab-{n}", DraftHead(vocab=ranking[:n], exit_layer=plan.exit_layer)
                )
                candidate = plan.with_params(draft_vocab=n, draft_head_file=relative)
                estimate = context.score(candidate)
                scores[str(n)] = round(estimate.expected_speedup, 4)
                if estimate.expected_speedup > (best[1].expected_speedup if best else base.expected_speedup):
                    best = (candidate, estimate)
            plan.measured["draft_vocab_scores"] = {**scores, "full": round(base.expected_speedup, 4)}
            if best is None:
                continue
            candidate, estimate = best
            relative = write_head(
                context, name, DraftHead(vocab=ranking[: candidate.draft_vocab], exit_layer=plan.exit_layer)
            )
            candidate = candidate.with_options(
                model={"max_draft": estimate.max_draft, "threshold": estimate.threshold}
            ).with_params(draft_head_file=relative)
            candidate.measured = {
                **plan.measured,
                **context.record(plan.measured.get("method", name), estimate),
                "draft_vocab_seconds": round(time.perf_counter() - start, 2),
                **head_cost_figures(context, ir.decoder(), candidate.draft_vocab),
            }
            ir.plans[name] = candidate
            ir.extra_files[relative] = context.workdir / relative
        return PassResult.after(ir, before)


__all__ = [
    "AdapterAutotune",
    "AdapterTrainer",
    "DraftVocabTune",
    "TeacherData",
    "exit_agreement",
    "stdlib_corpus",
    "teacher_data",
    "vocab_ranking",
]
