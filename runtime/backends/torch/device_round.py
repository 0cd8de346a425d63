"""A speculative round that stays on the torch backend's device (gpt-fast's ``generate.py`` is the model).

The host round (``runtime/decoding/batch.py``, ``BatchDecoder._round``) copies the logits of every draft step
and of the verify to numpy and decides there: on a GPU that is one host sync per drafted token and per
verify call. Here drafted tokens, draft distributions, the verifier's argmax or sampled token, the
acceptance test and the accepted count stay tensors on the device, and each round reads one small
tensor back (``[drafted..., bonus, accepted, kept]``, one ``.tolist()``) to emit tokens, check stops,
update the stats and the draft policy. Positions are host ints: a round drafts a number of tokens fixed
before it starts, so every position is known without reading the device.

- **Model drafts**: each draft step's token is the previous step's output tensor, fed to the segment
  without leaving the device (``TensorCalls``: the backend as the plan's draft kind calls it, tokens in
  and logits out as device tensors; ``TorchBackend.run_tensor``). With CUDA graphs on, draft steps and the
  verify replay their graphs (``StaticSteps``, one per (segment, token count)).
- **Draft length**: the adaptive threshold (``DraftPolicy``) needs each draft token's confidence, which
  lives on the device. A round therefore drafts ``min(max_draft, limit)`` tokens, verifies them all, and
  cuts on the device at the first token the policy would have stopped after (confidence below the
  threshold): a drafted token past the cut is never accepted. So a round commits exactly what the host
  round commits (greedy: the same tokens, round log and threshold updates, up to floating-point
  near-ties of a longer verify), and the estimator's acceptance replay (``passes/replay.py``) describes
  it; what it does not describe is the cost on a device, where every round pays ``max_draft`` draft
  steps and a verify of ``max_draft + 1`` tokens (gpt-fast's fixed k). With a threshold of 0 nothing is
  cut.
- **Lookups** (n-gram, retrieval) run on the host before the round (their tokens are uploaded, which
  waits for nothing: the device is idle after the previous round's read). A hit drafts the round, as in
  ``HybridDrafter``. One difference from the host round, on every device: a model draft is *not*
  extended by a lookup continuation (that lookup needs the model's tokens on the host: a second sync).
- **The rule**: the acceptance test and the token after the accepted ones are the host round's own
  (``runtime/acceptance.accept_chain``, array code that runs on these tensors as on the host's numpy
  arrays): greedy match, or Leviathan/Chen rejection with the draft's q (one-hot for lookup tokens); the
  distributions are ``sampling.probabilities`` (float64, the same temperature, top-k and top-p rules), and
  tokens come by inverse CDF (``sampling.sample_at``) from one ``torch.rand`` per round on a generator seeded
  from the request's seed (so a seed gives other tokens than the host round's numpy generator, from the
  same distribution). What is the device round's own is only what keeps the host away: fixed-length
  drafting with the policy's cut applied afterwards, and the one read at the end.

Imported only by the torch backend (``TorchBackend.device_round``); on CPU tensors the same code runs
(the lossless tests force it), and only its speed needs a GPU.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from ...acceptance import accept_chain
from ...sampling import probabilities, sample_at
from ...segments import Segment, full_model


class TensorCalls:
    """The backend as draft kinds call it (``run``, ``forward``, ``reuses_prefix``), on device tensors:
    token ids arrive as tensors (or lists of them, as kinds pass one token) and logits stay on the device."""

    def __init__(self, backend):
        self.backend, self.config = backend, backend.config

    @property
    def reuses_prefix(self) -> bool:
        return self.backend.reuses_prefix

    def run(
        self, segment: Segment, pos: int, tokens: Tensor | Sequence[Tensor] | None = None, count: int = 0
    ) -> Tensor | None:
        ids = None
        if segment.from_tokens:
            ids = tokens if isinstance(tokens, Tensor) else torch.cat([t.reshape(-1) for t in tokens])
        return self.backend.run_tensor(segment, pos, ids, count)

    def forward(self, tokens: Tensor, pos: int) -> Tensor:
        return self.run(full_model(self.config.num_layers), pos, tokens)


class DeviceRound:
    """``round(ctx, stats)``: one draft-and-verify round of ``drafter`` (a ``ModelDrafter``, or a hybrid of
    lookups and an optional model part) on a torch backend; the tokens it commits (see the module docstring).
    ``None`` from ``for_drafter`` when the drafter is of another shape (the host round runs it)."""

    def __init__(self, backend, drafter, lookups: list, model, seed: int | None):
        self.backend, self.drafter, self.lookups, self.model = backend, drafter, lookups, model
        self.calls = TensorCalls(backend)
        self.kind = model.kind if model is not None else None  # the plan's kind, read for this backend
        self.device = torch.device(backend.device)
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    @classmethod
    def for_drafter(cls, backend, drafter, seed: int | None) -> "DeviceRound | None":
        model, lookups = drafter.model_part, list(drafter.lookup_part)
        if model is not None and not model.steps_on_device or (model is None and not lookups):
            return None  # a model part this round does not know how to run, or nothing to draft with
        return cls(backend, drafter, lookups, model, seed)

    @torch.inference_mode()
    def __call__(self, ctx, stats) -> list[int]:
        """One round in the drafter's ``RoundContext`` ``ctx``; its draft and acceptance recorded in ``stats``."""
        params = ctx.params
        token = torch.full((1,), int(ctx.history[-1]), dtype=torch.long, device=self.device)
        draft = self._lookup(ctx)
        hit = draft is not None and bool(draft.tokens)
        n = len(draft.tokens) if hit or self.model is None else min(self.model.policy.max_draft, ctx.limit)
        u = (
            None
            if params.greedy
            else torch.rand(2 * n + 1, generator=self.generator, dtype=torch.float64, device=self.device)
        )  # draft samples, acceptance tests, the last token
        q = None
        if hit or self.model is None:  # a lookup hit (one-hot q), or a plain step
            drafted = torch.tensor(draft.tokens, dtype=torch.long).to(
                self.device, non_blocking=True
            )  # waits for nothing
            kept = torch.ones(n, dtype=torch.bool, device=self.device)
            logits = self.calls.forward(torch.cat([token, drafted]), ctx.pos)
        else:
            drafted, kept, q = self._model_draft(token, ctx, n, u)
            logits = self.kind.verify(self.calls, torch.cat([token, drafted]), ctx.pos, self.kind.reuse(n))
        accepted, bonus = accept_chain(logits, drafted, params, u=None if u is None else u[n:], q=q, kept=kept)
        out = torch.cat([drafted, bonus, accepted.view(1), kept.sum().view(1)]).tolist()  # the round's one sync
        tokens, bonus, accepted, kept = out[:n], out[n], out[n + 1], out[n + 2]
        if not hit and self.model is not None:
            draft = self.model.chain(tokens[:kept])
        stats.record(draft, accepted)
        self.drafter.feedback(draft, accepted)
        return tokens[:accepted] + [bonus]

    def _lookup(self, ctx):
        """The first lookup source's hit, on the host (``HybridDrafter``'s order); else the last source's empty
        draft, or None without lookup sources."""
        draft = None
        for source in self.lookups:
            draft = source.propose(ctx)
            if draft.tokens:
                return draft
        return draft

    def _model_draft(self, token: Tensor, ctx, n: int, u: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
        """``n`` draft steps, each fed the previous step's token tensor: the drafted tokens ``[n]``, which
        of them the policy keeps (those up to its first confidence below the threshold) and, when sampling,
        the draft distributions ``[n, vocab]``."""
        params, tokens, confidences, qs = ctx.params, [], [], []
        current = token
        for j in range(n):
            logits = self.kind.draft(self.calls, current, ctx.pos + j).reshape(1, -1)
            if params.greedy:
                current = logits.argmax(-1)
                confidences.append(torch.softmax(logits.double(), -1).amax(-1))
            else:
                q = probabilities(logits, params)
                current = sample_at(q[0], u[j])
                confidences.append(q.amax(-1))
                qs.append(q)
            tokens.append(current)
        low = torch.cat(confidences) < self.model.policy.threshold
        kept = low.cumsum(0) - low.long() == 0  # no low-confidence token before this one
        return torch.cat(tokens), kept, torch.cat(qs) if qs else None


__all__ = ["DeviceRound", "TensorCalls"]
