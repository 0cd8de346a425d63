"""Draft-and-verify decoding of a batch of sequences: one round over every sequence, written once.

A sequence alone is a batch of one (``speculative.decode``); a server's concurrent requests are a batch that
sequences join and leave between rounds (``BatchDecoder.add`` / ``remove``). Each sequence owns a cache
slot of the backend (``Backend.run_rows``; backends without slots run a batch on replicas,
``backends/slots.py``), its own drafter, sampling parameters, random generator and statistics.

One ``step`` is one verify round over the running sequences with the joining sequences' prompt chunks beside it:
1. each running sequence's drafter proposes (lookups first, on the host; a model draft only where ``load.py`` finds
   it pays under the current load), and the load policy cuts each draft to the length that maximises the batch's
   tokens per second;
2. one ``run_rows`` of the full model takes every running sequence's input token and draft (an early exit's
   verify that reuses its prefix runs per sequence) *and* the joining sequences' next prompt chunks: the weights
   are read once for both (vLLM's and OpenVINO's chunked prefill). Prompt tokens per step: at most
   ``prefill_chunk``, and within ``token_budget`` (the step's tokens in all, rows of steps and verifies first,
   as vLLM's ``max_num_batched_tokens``), so that running sequences keep their pace while a long prompt is read;
3. the acceptance rule (``runtime/acceptance.py``) commits each verified row's tokens; a sequence whose prompt is
   read emits its first token.

A joining sequence whose prompt begins like a prompt the batch has read (a chat template's system prompt, a
shared document, the earlier turns of a conversation) copies that prefix's KV from a spare slot instead of
computing it again (``prompt_cache.py``).

Every committed token is the verifier's, whatever the batch or the draft lengths, so each sequence decodes
exactly what it decodes alone (up to floating-point near-ties where a backend's kernels round a row in a
batch differently from the same row alone: docs/design.md section 6, ``tests/test_batched_rows.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..acceptance import accept, pick
from ..artifact.manifest import DraftPlan
from ..backends.base import Backend
from ..backends.slots import SlotView, batch_of
from ..drafting.drafter import Draft, RoundContext
from ..drafting.plan import ReadPlan, read_plan
from ..errors import InputError
from ..segments import Row, full_model
from ..tree import depths, kv_moves
from .load import PRIOR_ACCEPTANCE, CallCosts, Choice, best_draft_length, choose_lengths, draft_pays
from .prompt_cache import PromptCache
from .request import DecodeRequest, Stats, backend_drafter, cache_length

ACCEPTANCE_MEMORY = 0.8  # weight of a sequence's earlier rounds in its running acceptance
PRIOR_WEIGHT = 2.0  # the prior acceptance counts as this many judged tokens


@dataclass
class Sequence:
    """One request in the batch: its slot and everything it decodes with."""

    request: DecodeRequest
    drafter: object | None
    stats: Stats
    view: SlotView
    rng: np.random.Generator
    history: list[int] = field(default_factory=list)
    pos: int = 0  # position of history[-1], whose KV is not written yet (while decoding)
    prefilled: int = 0  # prompt tokens whose KV is written
    reused: int = 0  # of them, copied from an earlier prompt's KV (a shared prefix)
    finished: bool = False
    acceptance: float = PRIOR_ACCEPTANCE  # the chance that a drafted token is accepted after the ones before it
    tested: float = PRIOR_WEIGHT  # drafted tokens the verifier judged, earlier rounds discounted
    passed: float = PRIOR_WEIGHT * PRIOR_ACCEPTANCE  # of those, the accepted ones
    longest_draft: int = 0  # the most tokens its plan drafts in a round (what the load policy prices)
    device_round: object | None = None
    started: float = field(default_factory=time.perf_counter)

    def observe_acceptance(self, accepted: int, depth: int) -> None:
        """A round that accepted ``accepted`` of a draft ``depth`` tokens deep. The load policy reads
        ``acceptance`` as a per-token chance (``expected_tokens``: a draft of k brings 1 + a + .. + a^k), so it
        is estimated as one: the tokens accepted over the tokens judged, a round judging its accepted tokens
        and the first rejected one, none after it. (Accepted over drafted, a rate, reads a sequence that accepts
        each token with chance 0.85 from drafts of 8 as 0.5, and the policy then prices the 8th token at 0.5^8
        of a token where it brings 0.85^8.)"""
        tested = accepted + (1 if accepted < depth else 0)
        self.tested = ACCEPTANCE_MEMORY * self.tested + tested
        self.passed = ACCEPTANCE_MEMORY * self.passed + accepted
        self.acceptance = self.passed / self.tested

    @property
    def slot(self) -> int:
        return self.view.slot

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.request.prompt_ids) and not self.finished

    @property
    def kv_length(self) -> int:
        """Cache positions holding this sequence's KV (what moving its slot must copy)."""
        return self.pos if self.prefilled == len(self.request.prompt_ids) else self.prefilled


class BatchDecoder:
    """Decodes up to ``max_batch`` sequences on ``backend``, one ``step`` (a round) at a time. The backend's cache
    slots are this decoder's (its sequences' and its kept prompts'): another batch needs a replica.

    ``costs``: the measured call costs that let the load policy choose draft lengths (None: every sequence
    drafts as its own drafter proposes, which is right for a sequence alone). ``prefill_chunk``: prompt tokens
    read per step (None: whole prompts). ``token_budget``: tokens per step in all (None: no cap beyond
    ``prefill_chunk``); verify rows come first, prompt chunks take what is left. ``keep_prompts``: prompts whose KV is kept for later prompts that begin
    alike (``prompt_cache.py``; None: as many as ``max_batch`` where slots copy and the batch has more than one
    place, else none)."""

    def __init__(
        self,
        backend: Backend,
        max_batch: int = 1,
        costs: CallCosts | None = None,
        prefill_chunk: int | None = None,
        root: Path | None = None,
        keep_prompts: int | None = None,
        token_budget: int | None = None,
    ):
        if max_batch < 1:
            raise InputError(f"max_batch must be at least 1 (got {max_batch})")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise InputError(f"prefill_chunk must be at least 1 token (got {prefill_chunk})")
        if token_budget is not None and token_budget < 1:
            raise InputError(f"token_budget must be at least 1 token (got {token_budget})")
        self.backend = batch_of(backend) if max_batch > 1 else backend
        self.max_batch, self.costs, self.prefill_chunk, self.root = max_batch, costs, prefill_chunk, root
        self.token_budget = token_budget
        self.full = full_model(backend.config.num_layers)
        self.sequences: list[Sequence] = []  # sequence i sits in slot i
        # prompts read, kept in spare slots for later prompts that begin alike: in a decoder that serves one
        # request after another (not a request alone), on backends whose slots copy; as many as the batch has places
        if keep_prompts is None:
            keep_prompts = max_batch if max_batch > 1 and self.backend.slots_copy else 0
        if keep_prompts and not self.backend.slots_copy:
            raise InputError(f"the {self.backend.name} backend cannot keep prompts: its slots do not copy")
        self.prompts = PromptCache(self.backend, keep_prompts)
        self.last_round: dict = {}  # what the last step did (rows, draft lengths): the server's metrics

    # -- joining and leaving ---------------------------------------------------------------------------
    def add(
        self,
        request: DecodeRequest,
        plan: DraftPlan | ReadPlan | None = None,
        max_draft: int | None = None,
        reserve: int = 0,
        drafter=None,
        stats: Stats | None = None,
    ) -> Sequence:
        """A new sequence in the next free slot; its prompt is read by the next steps. ``plan``: its draft plan
        (None: plain decoding), unless ``drafter`` is given already built (for slot 0: a request alone).
        ``reserve``: cache positions to hold at least (a batch that expects longer requests reserves once)."""
        if len(self.sequences) >= self.max_batch:
            raise InputError(f"the batch is full ({self.max_batch} sequences); wait for one to finish")
        slot = len(self.sequences)
        plan = None if plan is None else read_plan(plan, self.backend.config.num_layers)  # read once, used below
        needed = max(cache_length(self.backend, request, plan, max_draft), reserve)
        slots = max(self.backend.slots, 1)
        if needed > self.backend.max_len or slot >= slots:
            self.backend.reserve(max(needed, self.backend.max_len), slots=max(slot + 1, slots))
        self.prompts.vacate(slot, busy=slot)  # a kept prompt in this slot moves up, out of the sequence's way
        view = SlotView(self.backend, slot)
        if drafter is None:
            drafter = backend_drafter(view, plan, self.root, max_draft)
        stats = stats if stats is not None else Stats()
        sequence = Sequence(request, drafter, stats, view, np.random.default_rng(request.seed))
        sequence.longest_draft = plan.longest_draft if plan is not None else 0
        sequence.stats.speculative = drafter is not None
        source, shared = self.prompts.match(request.prompt_ids)
        if shared:
            self.backend.move_slot(source, slot, shared)
            sequence.prefilled = sequence.reused = shared
            sequence.stats.reused_prompt_tokens = shared
        if len(self.sequences) == 0 and self.max_batch == 1:
            # a sequence alone: a backend may keep its rounds, or its plain steps (no drafter), on its device
            # (token trees and drafters that read the verifier's outputs run the host round)
            if drafter is None or not (drafter.drafts_trees or drafter.observes):
                sequence.device_round = view.device_round(drafter, request.seed)
        self.sequences.append(sequence)
        return sequence

    def remove(self, sequence: Sequence) -> None:
        """Free ``sequence``'s slot (between steps); the last sequence moves into it, so the batch keeps its
        first slots and its rows stay consecutive (one call)."""
        index = self.sequences.index(sequence)
        last = self.sequences.pop()
        if last is not sequence:
            self.backend.move_slot(last.slot, sequence.slot, last.kv_length)
            last.view.slot = sequence.slot
            self.sequences[index] = last
        sequence.finished = True

    # -- one step --------------------------------------------------------------------------------------
    def step(self) -> list[tuple[Sequence, list[int]]]:
        """One verify round with prompt chunks beside it: (sequence, its new tokens) for every sequence that produced
        some. A sequence whose ``finished`` turns True has stopped (``stats.stop_reason`` says why)."""
        running = [s for s in self.sequences if s.decoding]
        joining = sum(1 for s in self.sequences if not s.finished and s.prefilled < len(s.request.prompt_ids))
        produced: list[tuple[Sequence, list[int]]] = []
        prompts_read = False
        if running:
            produced, prompts_read = self._round(running, joining)
        if not prompts_read:  # no verify call this step to ride in (nothing running, or a lone device round)
            rows, owners = self._prompt_rows(0)
            if rows:
                start = time.perf_counter()
                outs = self.backend.run_rows(self.full, rows)
                produced = self._read_prompts(owners, rows, outs, time.perf_counter() - start) + produced
        return produced

    def _prompt_rows(self, spent: int) -> tuple[list[Row], list[Sequence]]:
        """The joining sequences' next prompt chunks, in order of joining: ``prefill_chunk`` tokens in all, within
        what ``token_budget`` leaves after the step's ``spent`` tokens of running rows."""
        rows, owners = [], []
        budget = self.prefill_chunk
        if self.token_budget is not None:
            left = max(self.token_budget - spent, 0)
            budget = left if budget is None else min(budget, left)
        for s in self.sequences:
            prompt = s.request.prompt_ids
            if s.prefilled >= len(prompt) or s.finished:
                continue
            take = len(prompt) - s.prefilled if budget is None else min(budget, len(prompt) - s.prefilled)
            if take <= 0:
                break
            rows.append(Row(s.slot, s.prefilled, list(prompt[s.prefilled : s.prefilled + take]), last_only=True))
            owners.append(s)
            if budget is not None:
                budget -= take
        return rows, owners

    def _read_prompts(
        self, owners: list[Sequence], rows: list[Row], outs, seconds: float
    ) -> list[tuple[Sequence, list[int]]]:
        """The prompt chunks' logits: a sequence whose prompt is read picks its first token. ``seconds``: the
        chunks' share of the call that read them, split among them by tokens."""
        produced = []
        tokens = sum(row.width for row in rows) or 1
        for s, row, logits in zip(owners, rows, outs):
            s.prefilled += row.width
            s.stats.prefill_seconds += seconds * row.width / tokens
            if s.prefilled < len(s.request.prompt_ids):
                continue
            prompt = list(s.request.prompt_ids)
            self.prompts.remember(s.slot, prompt, busy=len(self.sequences))
            token = pick(logits[-1], s.request.params, s.rng)
            s.history, s.pos = prompt + [token], len(prompt)
            if s.drafter is not None:
                s.drafter.start(prompt)
            produced.append((s, self._emit(s, [token])))
        return produced

    def _round(self, running: list[Sequence], joining: int = 0) -> tuple[list[tuple[Sequence, list[int]]], bool]:
        """One verify round of the ``running`` sequences, with the prompt chunks of the ``joining`` ones in its call
        (the load policy prices drafts as if those were in the round: see ``_propose``): what it produced, and
        whether the prompt chunks were read (not when no verify call ran: a lone device round, or none live)."""
        produced = []
        live = []
        for s in running:
            budget = self._budget(s)
            if budget <= 0:
                s.stats.stop_reason = "length" if s.stats.new_tokens >= s.request.max_new_tokens else "context"
                s.finished = True
                produced.append((s, []))
            else:
                live.append((s, budget))
        if not live:
            return produced, False
        if len(live) == 1 and live[0][0].device_round is not None and (live[0][1] > 1 or live[0][0].drafter is None):
            s, budget = live[0]
            ctx = RoundContext(history=s.history, pos=s.pos, limit=budget - 1, params=s.request.params, rng=s.rng)
            return produced + [(s, self._commit(s, s.device_round(ctx, s.stats)))], False
        drafts = self._propose(live, joining)
        rows, verified = [], {}
        for (s, _), draft in zip(live, drafts):
            tokens = [s.history[-1]] + ([] if draft is None else draft.tokens)
            if draft is not None and draft.verify_plan is not None and draft.reuse > 0:
                # an early exit's verify that reuses its draft's prefix: this sequence's own calls
                verified[id(s)] = s.view.verify(draft.verify_plan, tokens, s.pos, draft.reuse)
            else:
                tree = draft is not None and draft.is_tree
                rows.append((s, Row(s.slot, s.pos, tokens, parents=draft.parents if tree else None)))
        spent = sum(len(d.tokens) + 1 if d is not None else 1 for d in drafts)
        prompt_rows, owners = self._prompt_rows(spent)
        start = time.perf_counter()
        outs = self.backend.run_rows(self.full, [row for _, row in rows] + prompt_rows) if rows or prompt_rows else []
        seconds = time.perf_counter() - start
        for (s, _), logits in zip(rows, outs):
            verified[id(s)] = logits
        prompt_tokens = sum(row.width for row in prompt_rows)
        prompts = self._read_prompts(
            owners, prompt_rows, outs[len(rows) :], seconds * prompt_tokens / max(prompt_tokens + spent, 1)
        )
        drafted = [0 if d is None else len(d.tokens) for d in drafts]
        self.last_round = {
            "sequences": len(live),
            "rows": len(live) + sum(drafted),
            "drafted": drafted,
            "prompt_tokens": prompt_tokens,
        }
        for (s, _), draft in zip(live, drafts):
            logits = verified[id(s)]
            if draft is None:
                committed, path = [pick(logits[-1], s.request.params, s.rng)], None
            else:
                committed, path = accept(draft, logits, s.request.params, s.rng)
                if path is not None:
                    s.view.keep_rows(s.pos, kv_moves(path))
                self._finish_round(s, draft, logits, committed, path)
            produced.append((s, self._commit(s, committed)))
        return prompts + produced, True

    def _propose(self, live: list[tuple[Sequence, int]], joining: int = 0) -> list[Draft | None]:
        """Every live sequence's draft for this round (None: a plain step), cut by the load policy. Model draft
        steps of all sequences run together: step j of every sequence still drafting is one call.

        The policy prices a draft against the batch this round is part of: the live sequences and the ``joining``
        ones, whose prompt chunks share each step with the round. Why: when many requests arrive at once, the
        first to finish its prompt would otherwise decode alone, where drafting pays, and its longer rounds
        would hold back the prefill of all the others (a later first token than plain batching gives; measured:
        docs/history.md, 'Figures behind the code's constants'). Those are priced as one-token rows that each
        bring a token."""
        batch = len(live) + joining
        drafts: list[Draft | None] = [None] * len(live)
        stepping: dict[int, tuple] = {}  # index -> (its drafting generator, (token, pos) asked, ctx)
        proposing = [i for i, (s, budget) in enumerate(live) if self._proposes(s, budget, batch)]
        models = {
            i: (live[i][0].acceptance, min(live[i][0].drafter.model_part.policy.max_draft, live[i][1] - 1))
            for i in proposing
            if live[i][0].drafter.model_part is not None
        }
        steps = self._model_steps(models, batch)
        for i in proposing:
            s, budget = live[i]
            ctx = RoundContext(s.history, s.pos, budget - 1, s.request.params, s.rng, model_steps=steps.get(i))
            drafting = s.drafter.drafting(ctx)
            try:
                stepping[i] = (drafting, next(drafting), ctx)
            except StopIteration as done:
                drafts[i] = done.value
        while stepping:
            by_segment: dict = {}
            for i in stepping:
                by_segment.setdefault(live[i][0].drafter.model_part.step.kind.draft_segment, []).append(i)
            for segment, members in by_segment.items():
                rows = [Row(live[i][0].slot, stepping[i][1][1], [stepping[i][1][0]]) for i in members]
                for i, logits in zip(members, self.backend.run_rows(segment, rows)):
                    drafting, _, ctx = stepping[i]
                    step = live[i][0].drafter.model_part.step
                    try:
                        stepping[i] = (drafting, drafting.send(step.from_logits(logits[-1], ctx)), ctx)
                    except StopIteration as done:
                        drafts[i] = done.value
                        del stepping[i]
        for i, (s, _) in enumerate(live):
            draft = drafts[i]
            if draft is not None and draft.is_tree and not s.view.tree_fits(s.pos, len(draft.tokens) + 1):
                drafts[i] = draft.first_branch()  # a call this backend cannot make exactly: the first branch
        if self.costs is None or batch == 1:
            return drafts
        available = [0 if d is None else len(d.tokens) for d in drafts]
        choices = [Choice(s.acceptance, n) for (s, _), n in zip(live, available)]
        lengths = choose_lengths(self.costs, choices + [Choice(0.0, 0)] * joining)[: len(live)]
        return [d if d is None or k == len(d.tokens) else _cut(d, k) for d, k in zip(drafts, lengths)]

    def _proposes(self, s: Sequence, budget: int, batch: int) -> bool:
        """Whether ``s`` drafts at all this round: not when it has no drafter or room for one token only, nor when no
        draft up to its longest would pay against its share of the batch's plain step (its lookups cost host time
        too)."""
        if s.drafter is None or budget == 1:
            return False
        if self.costs is not None and batch > 1 and s.longest_draft:
            best = min(s.longest_draft, budget - 1)
            return draft_pays(self.costs, s.acceptance, best, 0.0, batch)
        return True

    def _model_steps(self, models: dict[int, tuple[float, int]], batch: int) -> dict[int, int]:
        """How many model draft steps each sequence may run this round (``models``: index -> (acceptance, the
        most its drafter would draft); 0: none). One batched draft step serves every sequence that drafts, so
        each is charged its share of that step (``CallCosts.draft_step``) and drafts the length that pays best
        at that share; a sequence for which none pays leaves the group, which raises the others' shares, until
        the group is stable."""
        steps = {i: length for i, (_, length) in models.items()}
        if self.costs is None or batch == 1:
            return steps
        while group := [i for i, k in steps.items() if k > 0]:
            share = self.costs.draft_step(len(group)) / len(group)
            fresh = {i: best_draft_length(self.costs, models[i][0], models[i][1], share, batch) for i in group}
            steps.update(fresh)
            if all(fresh.values()):
                break
        return steps

    def _finish_round(self, s: Sequence, draft: Draft, logits, committed: list[int], path) -> None:
        """The round's statistics, the drafter's feedback and, for drafters that learn from the verifier's
        rows, those rows; the sequence's running acceptance for the load policy."""
        accepted = len(committed) - 1
        s.stats.record(draft, accepted, path)
        s.drafter.feedback(draft, accepted)
        if s.drafter.observes:
            ctx = RoundContext(s.history, s.pos, len(draft.tokens), s.request.params, s.rng)
            s.drafter.observe(draft, logits, committed, ctx)
        if draft.tokens:
            s.observe_acceptance(accepted, max(depths(draft.tree_parents)))

    def _commit(self, s: Sequence, new: list[int]) -> list[int]:
        s.pos += len(new)
        s.history.extend(new)
        return self._emit(s, new)

    def _emit(self, s: Sequence, new: list[int]) -> list[int]:
        """Cut ``new`` at the first EOS (kept, as transformers does); count it; mark a finished sequence."""
        for i, token in enumerate(new):
            if token in s.request.eos_ids:
                s.stats.stop_reason = "eos"
                new = new[: i + 1]
                s.finished = True
                break
        s.stats.new_tokens += len(new)
        if not s.finished and self._budget(s) <= 0:
            s.stats.stop_reason = "length" if s.stats.new_tokens >= s.request.max_new_tokens else "context"
            s.finished = True
        if s.finished:
            s.stats.seconds = time.perf_counter() - s.started
        return new

    def _budget(self, s: Sequence) -> int:
        """How many more tokens ``s`` may produce: its own limit and the context (the slot's length)."""
        return min(s.request.max_new_tokens - s.stats.new_tokens, s.view.max_len - s.pos)


def _cut(draft: Draft, length: int) -> Draft:
    """The first ``length`` tokens of a chain draft; a tree's first branch cut likewise (0: a plain step)."""
    chain = draft.first_branch()
    n = min(length, len(chain.tokens))
    return Draft(
        chain.tokens[:n], chain.q[:n], chain.sources[:n], min(chain.reuse, n), chain.verify_plan if n else None
    )


__all__ = ["BatchDecoder", "Sequence"]
