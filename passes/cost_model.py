"""Cost of a draft plan from timings on this backend and device, not from parameter counts.

Timed once per build: one attention sublayer, one MLP sublayer, the embedding and the head, each for
1..k+1 tokens at a realistic context length. All blocks share shapes, so a sublayer's cost is the mean
over the blocks. Any plan's draft step and verify step is then a sum, which makes scoring hundreds of
candidate plans free.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from speccompile.runtime.artifact.manifest import DraftPlan
from speccompile.runtime.backends.torch.decoder import Decoder, Positions
from speccompile.runtime.drafting import read_plan
from speccompile.runtime.machine import cpu_model_name
from speccompile.runtime.segments import Segment, full_model


@dataclass
class CostModel:
    """Seconds per call; list index t-1 holds the cost for t tokens."""

    embed: list[float]
    attn: list[float]
    mlp: list[float]
    head: list[float]
    num_layers: int
    device: str = "cpu"
    vocab_size: int = 0  # rows of the lm_head timed in ``head`` (0: unknown, reduced draft heads not priced)

    def _blocks(self, t: int, n_attn: float, n_mlp: float) -> float:
        return n_attn * self.attn[t - 1] + n_mlp * self.mlp[t - 1]

    def plain_step(self) -> float:
        return self.segment(full_model(self.num_layers), 1)

    def segment(self, segment: Segment, t: int) -> float:
        """One call of ``segment`` on ``t`` tokens: the embedding when it starts from tokens, the sublayers
        it runs, the head when it has one."""
        n_attn = sum(1 for i in range(segment.start, segment.stop) if i not in segment.skip_attn)
        n_mlp = sum(1 for i in range(segment.start, segment.stop) if i not in segment.skip_mlp)
        return (
            (self.embed[t - 1] if segment.from_tokens else 0.0)
            + self._blocks(t, n_attn, n_mlp)
            + (self.head[t - 1] if segment.head is not None else 0.0)
        )

    def draft_step(self, plan: DraftPlan) -> float:
        kind = read_plan(plan, self.num_layers).kind
        return sum(self.segment(segment, t) for segment, t in kind.draft_calls())

    def draft_head_extra(self, plan: DraftPlan) -> float:
        """What a plan's draft head adds to one draft step over the shared head
        (``runtime/drafting/kinds/draft_head.py``)."""
        return read_plan(plan, self.num_layers).kind.head_extra(self)

    def verify(self, plan: DraftPlan | None, t: int, reuse: int | None = None) -> float:
        """Cost of verifying ``t`` tokens (the round's input token plus t-1 drafts), ``reuse`` of them
        (default t-1) already through the plan's prefix."""
        if plan is None:
            return self.segment(full_model(self.num_layers), t)
        calls = read_plan(plan, self.num_layers).kind.verify_calls(t, t - 1 if reuse is None else reuse)
        return sum(self.segment(segment, n) for segment, n in calls if n > 0)

    def as_dict(self) -> dict:
        return asdict(self)


def _best_seconds(fn, sync=None) -> float:
    """Seconds one call of ``fn`` takes; ``sync`` (torch.cuda.synchronize on a GPU) waits for queued work
    before and after, or asynchronous kernel launches would be timed instead of the kernels."""
    if sync is not None:
        sync()
    start = time.perf_counter()
    fn()
    if sync is not None:
        sync()
    return time.perf_counter() - start


def device_name(device: str = "cpu") -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"{cpu_model_name()} ({torch.get_num_threads()} threads)"


MIN_ROUNDS = 2  # timings repeat at least this many interleaved rounds (after a warm-up), whatever their allotment


def _enough(round_done: int, start: float, seconds: float | None) -> bool:
    """Whether a timing given ``seconds`` (None: no allotment) may stop after ``round_done`` rounds."""
    return seconds is not None and round_done >= MIN_ROUNDS and time.perf_counter() - start >= seconds


@torch.inference_mode()
def measure_costs(
    decoder: Decoder, max_tokens: int, context: int = 128, rounds: int = 9, seconds: float | None = None
) -> CostModel:
    """Time each kind of sublayer for 1..max_tokens tokens after ``context`` cached positions.

    Timings on a shared machine are noisy upwards only (interference adds time, never removes it), so
    every measurement is repeated in ``rounds`` interleaved passes over all token counts and the minimum
    is kept (fewer, at least ``MIN_ROUNDS``, once ``seconds`` are spent: a budgeted build's allotment). A
    step over more tokens can never be cheaper than one over fewer, so the costs are finally made
    non-decreasing in the token count.
    """
    config = decoder.config
    device = decoder.embed.weight.device
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    cache = decoder.new_cache(context + max_tokens, dtype=decoder.embed.weight.dtype, device=device)
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, config.vocab_size, (1, context), generator=generator).to(device)
    decoder(prefix, 0, cache)
    L = config.num_layers
    jobs = []  # per token count: (embed, attention, mlp, head) callables
    whole_blocks = getattr(decoder, "whole_blocks", False)  # the generic path: blocks are timed whole
    for t in range(1, max_tokens + 1):
        ids = torch.randint(0, config.vocab_size, (1, t), generator=generator).to(device)
        h = decoder.embed_tokens(ids, context)
        if whole_blocks:
            h = decoder.run_blocks(h, context, cache, 0, 1)
            jobs.append(
                (
                    lambda: None,  # the embedding runs inside every call of the model's forward
                    lambda h=h: [decoder.run_blocks(h, context, cache, i, i + 1) for i in range(L)],
                    lambda: None,  # a block's cost is all booked to its first sublayer row (attn)
                    lambda h=h: decoder.head(h),
                )
            )
            continue
        where = Positions.of(context, t, device, cache)
        rope = decoder.rope_at(where)
        mask = decoder.attention_mask(where, config.sliding_window)  # timing only
        jobs.append(
            (
                lambda ids=ids: decoder.embed_tokens(ids, context),
                lambda h=h, rope=rope, mask=mask, where=where: [
                    decoder.attention_sublayer(i, h, where, cache, rope, mask) for i in range(L)
                ],
                lambda h=h: [decoder.mlp_sublayer(i, h) for i in range(L)],
                lambda h=h: decoder.head(h),
            )
        )
    for job in jobs:  # warm-up
        for fn in job:
            fn()
    best = np.full((max_tokens, 4), np.inf)
    start = time.perf_counter()
    for done in range(rounds):
        if _enough(done, start, seconds):
            break
        for t, job in enumerate(jobs):
            for k, fn in enumerate(job):
                best[t, k] = min(best[t, k], _best_seconds(fn, sync))
    best[:, 1:3] /= L  # attention and MLP were timed over all blocks
    best = np.maximum.accumulate(best, axis=0)
    embed, attn, mlp, head = (best[:, k].tolist() for k in range(4))
    return CostModel(
        embed=embed, attn=attn, mlp=mlp, head=head, num_layers=L, device=str(device), vocab_size=config.vocab_size
    )


@dataclass
class StepCosts:
    """What a round costs on the backend that will run the artifact (docs/design.md section 5).

    ``forward[t-1]`` is one timed ``Backend.forward`` of ``t`` tokens after a realistic context, on that
    backend (torch or ONNX Runtime): verify steps differ most between backends (what an 8-token verify costs in
    steps differs between ORT and torch; measured: docs/history.md, 'Figures behind the code's constants'), so they
    are measured there. A model draft step costs the plan's share of the full model, taken from the torch sublayer
    timings (``sublayers``), of one measured step, plus the per-call overhead of turning logits into a draft token
    (``draft_overhead``). ``lookup`` is one n-gram / retrieval lookup. Same interface as ``CostModel``
    (``plain_step``, ``draft_step``, ``verify``), so every estimator works with either.
    """

    forward: list[float]
    sublayers: CostModel
    draft_overhead: float
    lookup: float
    backend: str
    # Timed in rounds (``measure_draft_rounds``), by the draft segment's key (``segment_key``): one draft step's
    # seconds, and what a verify right after the draft's steps costs relative to ``full`` (back-to-back).
    # A draft whose weights are not the verifier's (a precision draft) is priced by these, not by its share.
    draft_steps: dict = field(default_factory=dict)
    verify_after_draft: dict = field(default_factory=dict)

    def full(self, t: int) -> float:
        if t <= len(self.forward):
            return self.forward[t - 1]
        slope = self.forward[-1] - self.forward[-2] if len(self.forward) > 1 else self.forward[-1]
        return self.forward[-1] + slope * (t - len(self.forward))

    def plain_step(self) -> float:
        return self.forward[0]

    def _share(self, segment: Segment) -> float:
        """The part of a full-model step that ``segment`` is, by the sublayer timings."""
        return self.sublayers.segment(segment, 1) / self.sublayers.plain_step()

    def draft_step(self, plan: DraftPlan) -> float:
        kind = read_plan(plan, self.sublayers.num_layers).kind
        timed = [self.draft_steps.get(segment_key(segment)) for segment, _ in kind.draft_calls()]
        if timed and all(t is not None for t in timed):
            return sum(timed) + self.draft_overhead
        share = sum(self._share(segment) for segment, _ in kind.draft_calls())
        share += kind.head_extra(self.sublayers) / self.sublayers.plain_step()
        return self.forward[0] * share + self.draft_overhead

    def verify(self, plan: DraftPlan | None, t: int, reuse: int | None = None) -> float:
        """Verifying ``t`` tokens, ``reuse`` of them (default t-1) already through the plan's prefix: each
        call of the plan's verify costs its share of a full-model call of as many tokens."""
        if plan is None:
            return self.full(t)
        kind = read_plan(plan, self.sublayers.num_layers).kind
        calls = kind.verify_calls(t, t - 1 if reuse is None else reuse)
        after = self.verify_after_draft.get(segment_key(kind.draft_segment)) if kind.has_model_part else None
        return sum(self.full(n) * self._share(segment) for segment, n in calls if n > 0) * (after or 1.0)

    def as_dict(self) -> dict:
        return {
            "backend": self.backend,
            "forward": self.forward,
            "draft_overhead": self.draft_overhead,
            "lookup": self.lookup,
            "sublayers": self.sublayers.as_dict(),
            **(
                {"draft_steps": self.draft_steps, "verify_after_draft": self.verify_after_draft}
                if self.draft_steps
                else {}
            ),
        }


def segment_key(segment: Segment) -> str:
    """A segment's key in ``StepCosts.draft_steps`` / ``verify_after_draft`` (JSON-safe)."""
    return repr(segment.blocks_key + (segment.head,))


def measure_draft_rounds(
    backend, costs: StepCosts, plan: DraftPlan, draft_tokens: int, context: int = 128, rounds: int = 6
) -> tuple[float, float]:
    """Time ``plan``'s draft steps and the verify after them, alternating as a round runs them (``draft_tokens``
    steps, then a verify of one more token), after ``context`` cached positions; record them in ``costs``.
    Returns (seconds of one draft step, the verify's cost relative to ``costs.full`` back-to-back), medians
    over ``rounds`` rounds after a warm-up round."""
    config = backend.config
    plan = read_plan(plan, config.num_layers)
    context = max(1, min(context, config.max_position_embeddings - draft_tokens - 2))
    backend.reserve(context + draft_tokens + 2)
    rng = np.random.default_rng(1)
    backend.forward(rng.integers(0, config.vocab_size, context).tolist(), 0)
    ids = rng.integers(0, config.vocab_size, draft_tokens + 1).tolist()
    drafts, verifies = [], []
    for r in range(rounds + 1):
        for j in range(draft_tokens):
            seconds = _best_seconds(lambda: backend.draft(plan, ids[j], context + j), None)
            if r:
                drafts.append(seconds)
        seconds = _best_seconds(lambda: backend.verify(plan, ids, context), None)
        if r:
            verifies.append(seconds)
    draft, verify = float(np.median(drafts)), float(np.median(verifies))
    key = segment_key(plan.kind.draft_segment)
    costs.draft_steps[key] = draft
    costs.verify_after_draft[key] = max(verify / costs.full(draft_tokens + 1), 1.0)
    return draft, costs.verify_after_draft[key]


def measure_step_costs(
    backend, sublayers: CostModel, max_tokens: int, context: int = 128, rounds: int = 7, seconds: float | None = None
) -> StepCosts:
    """Time ``backend.forward`` of 1..max_tokens tokens after ``context`` cached positions (minimum over
    interleaved repeats, made non-decreasing, with ``seconds`` as in ``measure_costs``), plus the draft-token
    overhead and one lookup, through the Backend protocol only."""
    from speccompile.runtime.drafting.drafter import RoundContext
    from speccompile.runtime.drafting.ngram import NgramDrafter
    from speccompile.runtime.sampling import SamplingParams, softmax

    config = backend.config
    context = max(1, min(context, config.max_position_embeddings - max_tokens - 1))
    backend.reserve(context + max_tokens)
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, config.vocab_size, context).tolist()
    backend.forward(prefix, 0)
    # A verify's cost grows with its token count, partly in steps: ONNX Runtime's MLAS products take rows in
    # blocks of 6 on AVX-512, so 7 tokens cost about what 12 do (benchmarks/verify_curve.py; measured:
    # docs/history.md, 'Figures behind the code's constants'). Time both sides of those edges and a few counts
    # between, interpolate the rest.
    sizes = sorted({t for t in (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 13, 16, 24, 32) if t <= max_tokens} | {max_tokens})
    inputs = [rng.integers(0, config.vocab_size, t).tolist() for t in sizes]
    for ids in inputs:  # warm-up
        backend.forward(ids, context)
    timed = np.full(len(sizes), np.inf)
    start = time.perf_counter()
    for done in range(rounds):
        if _enough(done, start, seconds):
            break
        for k, ids in enumerate(inputs):
            timed[k] = min(timed[k], _best_seconds(lambda: backend.forward(ids, context)))
    best = np.maximum.accumulate(np.interp(np.arange(1, max_tokens + 1), sizes, np.maximum.accumulate(timed)))
    logits = rng.standard_normal(config.vocab_size).astype(np.float32)
    overhead = min(_best_seconds(lambda: softmax(logits)[int(np.argmax(logits))]) for _ in range(20))
    history = (prefix * 4)[: 4 * context]
    drafter = NgramDrafter(1, 4, 8)
    drafter.start(history)
    ctx = RoundContext(history=history, pos=len(history) - 1, limit=8, params=SamplingParams(), rng=rng)
    drafter.propose(ctx)  # indexes the history once
    lookup = min(_best_seconds(lambda: drafter.propose(ctx)) for _ in range(20))
    return StepCosts(
        forward=best.tolist(),
        sublayers=sublayers,
        draft_overhead=overhead,
        lookup=lookup,
        backend=getattr(backend, "name", type(backend).__name__),
    )
