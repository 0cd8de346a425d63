"""A speculative round that stays on the torch backend's device (gpt-fast's ``generate.py`` is the model).

The host round (``runtime/decoding/batch.py``, ``BatchDecoder._round``) copies the logits of every draft step
and of the verify to numpy and decides there: on a GPU that is one host sync per drafted token and per
verify call. Here the sequence's committed tokens live in a device buffer, and the round is one function of
device tensors: the draft (a lookup's tokens, or the draft steps of a model draft, each fed the previous
step's token tensor), the verify, the acceptance rule, the commit of the round's tokens into the buffer and
the length update, then the n-gram lookup of the *next* round's draft over the buffer
(``device_lookup.py``). The host reads one small tensor back per round (``[drafted..., bonus, accepted,
kept, next count, next draft...]``, one ``.tolist()``) to emit tokens, check stops, update the stats and
the draft policy, and to choose the next round's shape from the lookup's count.

- **Captured**: with the backend's static cache (CUDA graphs on a GPU), the whole round is captured once per
  shape (lookup verify of n tokens, model draft of n tokens, plain step; and the sampling parameters) and
  replayed: no launch per kernel, positions read from the device buffer's length. Without it (CUDA graphs
  off, CPU) the same function runs eagerly with host positions.
- **Draft length**: the adaptive threshold (``DraftPolicy``) needs each draft token's confidence, which
  lives on the device. A model round therefore drafts ``min(max_draft, limit)`` tokens, verifies them all, and
  cuts on the device at the first token the policy would have stopped after (confidence below the
  threshold, a device scalar written before the replay): a drafted token past the cut is never accepted.
  So a round commits exactly what the host round commits (greedy: the same tokens, round log and threshold
  updates, up to floating-point near-ties of a longer verify).
- **Lookups**: n-gram sources look up on the device, at the end of the round before (the first round of a
  sequence, and any round after the host's tokens changed under the buffer, looks up on the host, which
  proposes the same). Other lookup sources (retrieval, ...) look up on the host and upload their tokens,
  which waits for nothing. A hit drafts the round, as in ``HybridDrafter``; a model draft is *not* extended
  by a lookup continuation. A lookup whose proposals keep failing stops being verified (``LookupGate``):
  a verify of several tokens costs more than a plain step, and the host round's batch policy, which
  prices that, does not run for a sequence alone.
- **The rule**: the acceptance test and the token after the accepted ones are the host round's own
  (``runtime/acceptance.accept_chain``): greedy match, or Leviathan/Chen rejection with the draft's q
  (one-hot for lookup tokens); tokens come by inverse CDF (``sampling.sample_at``) from uniforms drawn per
  round on a device generator seeded from the request's seed (so a seed gives other tokens than the host
  round's numpy generator, from the same distribution).

Imported only by the torch backend (``TorchBackend.device_round``); on CPU tensors the same code runs
(the lossless tests force it, eagerly and through ``graphs.eager_capture``), and only its speed needs a GPU.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from ...acceptance import accept_chain
from ...sampling import probabilities, sample_at
from ...segments import Segment, full_model
from .decoder import run_segment
from .device_lookup import ngram_continuation
from .device_plain import device_generator, params_key


class TensorCalls:
    """The backend as draft kinds call it (``run``, ``forward``, ``reuses_prefix``), on device tensors:
    token ids arrive as tensors (or lists of them, as kinds pass one token) and logits stay on the device.
    ``pos`` a host int runs each call through the backend (eagerly); a 0-d device tensor runs the segments
    directly over the static cache with positions computed on the device (inside a captured round)."""

    def __init__(self, backend):
        self.backend, self.config = backend, backend.config

    @property
    def reuses_prefix(self) -> bool:
        return self.backend.reuses_prefix

    def run(
        self, segment: Segment, pos, tokens: Tensor | Sequence[Tensor] | None = None, count: int = 0
    ) -> Tensor | None:
        ids = None
        if segment.from_tokens:
            ids = tokens if isinstance(tokens, Tensor) else torch.cat([t.reshape(-1) for t in tokens])
        if not isinstance(pos, Tensor):
            return self.backend.run_tensor(segment, pos, ids, count)
        backend, static = self.backend, self.backend.static
        t = ids.shape[0] if ids is not None else count
        positions = pos + torch.arange(t, device=pos.device)
        decoder, head = backend.decoder_and_head(segment)
        ids = None if ids is None else ids.view(1, -1)
        out = run_segment(decoder, segment, ids, positions, static.cache, static.hidden, head, count)
        return None if out is None else out[0]

    def forward(self, tokens: Tensor, pos) -> Tensor:
        return self.run(full_model(self.config.num_layers), pos, tokens)


class LookupGate:
    """Whether a lookup's proposal is worth its verify, for a sequence alone: off once the running acceptance
    of its tokens falls below ``floor``, with one probe every ``probe_every`` rounds to notice when it pays
    again. At acceptance 0 a round that verifies ``k`` wrong tokens commits the one token a plain step would
    at a dearer call; with the gate those rounds are plain steps, bar the probes."""

    def __init__(self, floor: float = 0.1, memory: float = 0.8, probe_every: int = 16):
        self.floor, self.memory, self.probe_every = floor, memory, probe_every
        self.acceptance, self.closed_rounds = 1.0, 0

    def open(self) -> bool:
        if self.acceptance >= self.floor:
            return True
        self.closed_rounds += 1
        if self.closed_rounds >= self.probe_every:
            self.closed_rounds = 0
            return True
        return False

    def update(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.acceptance = self.memory * self.acceptance + (1.0 - self.memory) * accepted / drafted


def device_ngram(lookups: list) -> tuple[int, int, int, int] | None:
    """The n-gram sizes of the one lookup source when it is prompt lookup (its device form exists), else None."""
    return lookups[0].ngram_sizes if len(lookups) == 1 else None


class DeviceRound:
    """``round(ctx, stats)``: one draft-and-verify round of ``drafter`` (a ``ModelDrafter``, or a hybrid of
    lookups and an optional model part) on a torch backend; the tokens it commits (see the module docstring).
    ``None`` from ``for_drafter`` when the drafter is of another shape (the host round runs it)."""

    def __init__(self, backend, drafter, lookups: list, model, seed: int | None):
        self.backend, self.drafter, self.lookups, self.model = backend, drafter, lookups, model
        self.calls = TensorCalls(backend)
        self.kind = model.kind if model is not None else None  # the plan's kind, read for this backend
        self.device = torch.device(backend.device)
        self.generator = device_generator(self.device, seed)
        self.ngram = device_ngram(lookups)
        self.gate = LookupGate()
        self.longest = max(self.ngram[2] if self.ngram else 0, model.policy.max_draft if model else 0, 1)
        self.synced = -1  # tokens the device buffer holds, as the host knows them (-1: none)
        self.next: list[int] | None = None  # the device lookup's proposal for the next round, read last round
        self.graphs: dict[tuple, object] = {}
        self.static = None  # the backend's StaticSteps the graphs were captured over
        self.tokens = self.length = self.draft = self.u = self.threshold = None

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
        self._sync(ctx.history)
        lookup = self._lookup(ctx)
        if lookup is not None and len(lookup.tokens) > self.longest:  # a host source's longer draft: room for it
            self.longest = len(lookup.tokens)
            self._sync(ctx.history)
        hit = lookup is not None and bool(lookup.tokens) and self.gate.open()
        if hit:
            mode, n = "lookup", len(lookup.tokens)
        elif self.model is not None:
            mode, n = "model", min(self.model.policy.max_draft, ctx.limit)
        else:
            mode, n = "plain", 0
        if mode == "lookup" and not lookup.on_device:
            self.draft[:n].copy_(torch.tensor(lookup.tokens, dtype=torch.long), non_blocking=True)  # waits for nothing
        if mode == "model":
            self.threshold.fill_(self.model.policy.threshold_at(ctx.pos))
        if not params.greedy:
            torch.rand(
                2 * n + 1, generator=self.generator, dtype=torch.float64, device=self.device, out=self.u[: 2 * n + 1]
            )
        out = self._run(mode, n, params, ctx.pos).tolist()  # the round's one read
        tokens, bonus, accepted, kept = out[:n], out[n], out[n + 1], out[n + 2]
        self.synced = ctx.pos + accepted + 2
        if self.ngram is not None:
            count = out[n + 3]
            self.next = out[n + 4 : n + 4 + count]
        if mode == "model":
            draft = self.model.chain(tokens[:kept])
        elif mode == "lookup":
            draft = lookup.draft
            self.gate.update(n, accepted)
        else:
            draft = self.lookups[0].draft_of([])  # a plain step: an empty draft
        stats.record(draft, accepted)
        self.drafter.feedback(draft, accepted)
        return tokens[:accepted] + [bonus]

    # -- the device buffers ----------------------------------------------------------------------------
    def _sync(self, history: Sequence[int]) -> None:
        """Make the device buffer hold ``history`` (the first round; or the host's tokens are not the ones the
        last round left there): an upload, and the next lookup on the host."""
        capacity = self.backend.max_len + self.longest + 2
        if self.tokens is None or self.tokens.shape[0] < capacity or self.draft.shape[0] < self.longest:
            self.tokens = torch.zeros(capacity, dtype=torch.long, device=self.device)
            self.length = torch.zeros((), dtype=torch.long, device=self.device)
            self.draft = torch.zeros(self.longest, dtype=torch.long, device=self.device)
            self.u = torch.zeros(2 * self.longest + 1, dtype=torch.float64, device=self.device)
            self.threshold = torch.zeros((), dtype=torch.float64, device=self.device)
            self.graphs, self.synced = {}, -1
        if self.synced == len(history):
            return
        self.tokens[: len(history)].copy_(torch.tensor(list(history), dtype=torch.long))
        self.length.fill_(len(history))
        self.synced, self.next = len(history), None

    def _lookup(self, ctx) -> "_Lookup | None":
        """This round's lookup: the device lookup's proposal read last round, else the host sources' (the first
        source with a hit, ``HybridDrafter``'s order); None without lookup sources."""
        if not self.lookups:
            return None
        if self.next is not None:
            tokens = self.next[: ctx.limit]
            return _Lookup(tokens, True, self.lookups[0].draft_of(tokens))
        draft = None
        for source in self.lookups:
            draft = source.propose(ctx)
            if draft.tokens:
                break
        return _Lookup(list(draft.tokens), False, draft)

    # -- the round ---------------------------------------------------------------------------------------
    def _run(self, mode: str, n: int, params, pos: int) -> Tensor:
        static = self.backend.static
        if static is None:
            return self._body(mode, n, params, pos)
        static.check_room(pos, n + 1)
        if static is not self.static:  # a new static cache (the backend grew it): new graphs
            self.static, self.graphs = static, {}
        key = (mode, n, params_key(params))
        replay = self.graphs.get(key)
        if replay is None:
            state = (self.tokens, self.length, self.draft)
            saved = [t.clone() for t in state]
            replay = self.graphs[key] = static.capture(lambda: self._body(mode, n, params, None))
            static.captures += 1
            for t, before in zip(state, saved):  # a capture's warm-up ran the round: undo what it committed
                t.copy_(before)
        return replay()

    def _body(self, mode: str, n: int, params, pos: int | None) -> Tensor:
        """The round over the device buffers; ``pos`` the input token's position (None: read from the buffer's
        length, in a captured round). Fixed shapes throughout: what it returns is what the host reads."""
        device = self.device
        at = self.length - 1 if pos is None else pos
        token = self.tokens.index_select(0, (self.length - 1).view(1))
        u = None if params.greedy else self.u[: 2 * n + 1]
        q = None
        kept = torch.ones(n, dtype=torch.bool, device=device)
        if mode == "model":
            drafted, kept, q = self._model_draft(token, at, n, u, params)
            logits = self.kind.verify(self.calls, torch.cat([token, drafted]), at, self.kind.reuse(n))
        else:
            drafted = self.draft[:n].clone()  # the buffer takes the next round's lookup below
            logits = self.calls.forward(torch.cat([token, drafted]), at)
        accepted, bonus = accept_chain(logits, drafted, params, u=None if u is None else u[n:], q=q, kept=kept)
        steps = torch.arange(n + 1, device=device)
        committed = torch.where(steps < accepted, torch.cat([drafted, bonus]), bonus)
        self.tokens.index_copy_(0, self.length + steps, committed)
        self.length.add_(accepted + 1)
        parts = [drafted, bonus, accepted.view(1), kept.sum().view(1)]
        if self.ngram is not None:
            min_n, max_n, limit, short = self.ngram
            following, count = ngram_continuation(self.tokens, self.length, min_n, max_n, limit, short)
            self.draft[:limit].copy_(following)
            parts += [count.view(1), following]
        return torch.cat(parts)

    def _model_draft(
        self, token: Tensor, pos, n: int, u: Tensor | None, params
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """``n`` draft steps, each fed the previous step's token tensor: the drafted tokens ``[n]``, which
        of them the policy keeps (those up to its first confidence below the threshold) and, when sampling,
        the draft distributions ``[n, vocab]``."""
        tokens, confidences, qs = [], [], []
        current = token
        for j in range(n):
            logits = self.kind.draft(self.calls, current, pos + j).reshape(1, -1)
            if params.greedy:
                current = logits.argmax(-1)
                confidences.append(torch.softmax(logits.double(), -1).amax(-1))
            else:
                q = probabilities(logits, params)
                current = sample_at(q[0], u[j])
                confidences.append(q.amax(-1))
                qs.append(q)
            tokens.append(current)
        low = torch.cat(confidences) < self.threshold
        kept = low.cumsum(0) - low.long() == 0  # no low-confidence token before this one
        return torch.cat(tokens), kept, torch.cat(qs) if qs else None


class _Lookup:
    """A round's lookup: its tokens (cut to the round's limit), whether they are in the device's draft buffer
    already, and the ``Draft`` the stats and the drafter's feedback see."""

    def __init__(self, tokens: list[int], on_device: bool, draft):
        self.tokens, self.on_device, self.draft = tokens, on_device, draft


__all__ = ["DeviceRound", "LookupGate", "TensorCalls"]
