"""Acceptance of a draft plan without a generation loop (docs/design.md section 5).

1. The target (full model) greedily continues each calibration prompt: these are the tokens a real
   run would verify.
2. One parallel forward of the full model over each sequence stores its K/V at every layer
   (``Reference``) and the cosine similarity of every sublayer's input and output.
3. One parallel forward of the draft plan over the sequence gives the draft's argmax and confidence
   at every position. Its attention reads the *full model's* K/V for earlier positions and its own
   K/V only on the diagonal: that is exactly what a real draft sees for the first token of a round
   (earlier positions were written by the verifier). Later tokens of a round would see their own
   round's draft K/V; the estimate treats them the same way, an approximation whose error the tests
   measure against the real loop. For early-exit plans the prefix is the full model's own, so the
   estimate is exact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from speccompile.runtime.artifact.manifest import DraftPlan
from speccompile.runtime.backends.torch.backend import TorchBackend
from speccompile.runtime.backends.torch.decoder import Decoder, KVCache
from speccompile.runtime.decoding.speculative import DecodeRequest, decode_all
from speccompile.runtime.drafting import read_plan


@dataclass
class Reference:
    """One calibration sequence (prompt + the target's greedy continuation) and the full model's K/V."""

    tokens: torch.Tensor  # [1, N]
    prompt_len: int
    cache: KVCache
    exits: list[torch.Tensor] | None = None  # exits[E]: hidden state after block E-1, positions prompt_len..N-2

    @property
    def targets(self) -> np.ndarray:
        """The token each position should predict, for positions prompt_len..N-2."""
        return self.tokens[0, self.prompt_len + 1 :].cpu().numpy()


@dataclass
class Profile:
    """Per calibration sequence: did the draft's argmax match the target, and how sure was it."""

    matches: list[np.ndarray]
    confidences: list[np.ndarray]
    tops: list[np.ndarray] | None = None  # the draft's argmax at every position (for replaying drafters)
    # the draft's next-best tokens [n, RUNNER_UPS] and their probabilities at every position (model-draft trees)
    runner_ups: list[np.ndarray] | None = None
    runner_up_probs: list[np.ndarray] | None = None

    def subset(self, indices: list[int]) -> "Profile":
        """The profile of the sequences ``indices`` (a fold of the calibration set)."""
        pick = lambda values: None if values is None else [values[i] for i in indices]  # noqa: E731
        return Profile(
            pick(self.matches),
            pick(self.confidences),
            pick(self.tops),
            pick(self.runner_ups),
            pick(self.runner_up_probs),
        )

    @property
    def match_rate(self) -> float:
        total = sum(len(m) for m in self.matches)
        return float(sum(m.sum() for m in self.matches) / total) if total else 0.0


def greedy_continuations(
    decoder: Decoder,
    prompts: list[list[int]],
    new_tokens: int,
    progress=None,
    eos: frozenset[int] = frozenset(),
    batch: int = 16,
    deadline: float | None = None,
) -> list[list[int]]:
    """The target's own greedy continuation of each prompt, up to and including an ``eos`` token.

    Batched when the decoder allows it (``batches_left_padded``): a calibration build spends most of its time here,
    and on a memory-bound CPU step twelve rows cost about twice one row, so one batch takes a fraction of the
    prompt-at-a-time time (measured: docs/history.md, 'Figures behind the code's constants'). Otherwise through the
    runtime's plain decoding loop.

    ``deadline`` (a ``time.perf_counter`` time; a budgeted build's): a batch stops growing its continuations
    there (at least ``MIN_CONTINUATION`` tokens each), and no further prompt starts after it, so the list
    returned may be shorter than ``prompts`` (at least ``MIN_CONTINUATIONS`` of them): fewer, shorter
    continuations on a model too big for the budget."""
    outputs: list[list[int]] = []

    def more() -> bool:
        return deadline is None or len(outputs) < MIN_CONTINUATIONS or time.perf_counter() < deadline

    if batch > 1 and len(prompts) > 1 and batches_left_padded(decoder):
        for first in range(0, len(prompts), batch):
            if not more():
                break
            group = prompts[first : first + batch]
            outputs += _batched_greedy(decoder, group, new_tokens, eos, deadline)
            if progress is not None:
                progress.update(len(group))
        return outputs
    backend = TorchBackend(decoder)
    for prompt in prompts:
        if not more():
            break
        outputs.append(decode_all(backend, DecodeRequest(prompt, new_tokens, eos_ids=frozenset(eos)))[0])
        if progress is not None:
            progress.update(1)
    return outputs


MIN_CONTINUATIONS = 2  # a deadline never leaves fewer calibration continuations than this ...
MIN_CONTINUATION = 16  # ... nor a batch's continuations shorter than this many tokens


def batches_left_padded(decoder) -> bool:
    """Whether left-padded rows decode as they would alone: the canonical decoder, with rotary (or no)
    positions, whose attention depends only on how far apart a query and a key are, so a row shifted right
    by its padding computes the same function (learned absolute positions do not)."""
    return isinstance(decoder, Decoder) and decoder.config.positions == "rotary"


@torch.inference_mode()
def _batched_greedy(
    decoder: Decoder, prompts: list[list[int]], new_tokens: int, eos: frozenset[int], deadline: float | None = None
) -> list[list[int]]:
    """Greedy continuations of several prompts at once, each left-padded to the longest. Padding keys are
    masked out through the decoder's ``keys_values`` hook, which also builds the causal (and window) mask
    over the whole cache (a padding query sees only itself, so no row of attention is empty); the cache is
    a batched static cache written at the call's positions."""
    weight = decoder.embed.weight
    longest = max(len(p) for p in prompts)
    pads = torch.tensor([longest - len(p) for p in prompts], device=weight.device)
    ids = torch.tensor([[0] * (longest - len(p)) + list(p) for p in prompts], device=weight.device)
    cache = KVCache(decoder.config, longest + new_tokens, batch=len(prompts), dtype=weight.dtype, device=weight.device)
    state = {"pos": 0}

    def padded_keys_values(i, k, v, mask):
        pos, t = state["pos"], k.shape[2]
        cache.k[i, :, :, pos : pos + t], cache.v[i, :, :, pos : pos + t] = k, v
        keys = torch.arange(pos + t, device=k.device)
        queries = torch.arange(pos, pos + t, device=k.device)
        causal = keys[None, :] <= queries[:, None]
        window = decoder.config.window_of(i)
        if window is not None:
            causal &= keys[None, :] > queries[:, None] - window
        real = keys[None, None, :] >= pads[:, None, None]  # [B, 1, keys]
        own = keys[None, None, :] == queries[None, :, None]  # [1, T, keys]: a padding query sees itself
        return cache.k[i, :, :, : pos + t], cache.v[i, :, :, : pos + t], (causal & (real | own))[:, None]

    outputs: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    tokens = ids
    for step in range(new_tokens):
        if deadline is not None and step >= MIN_CONTINUATION and time.perf_counter() >= deadline:
            break
        h = decoder.run_blocks(
            decoder.embed_tokens(tokens, state["pos"]), state["pos"], None, keys_values=padded_keys_values
        )
        state["pos"] += tokens.shape[1]
        tokens = decoder.head(h[:, -1:]).argmax(-1)
        for row, token in enumerate(tokens[:, 0].tolist()):
            if not done[row]:
                outputs[row].append(token)
                done[row] = token in eos
        if all(done):
            break
    return outputs


@torch.inference_mode()
def reference_pass(decoder: Decoder, tokens: list[int], prompt_len: int, cosine: np.ndarray | None = None) -> Reference:
    """Full-model forward that keeps every layer's K/V; optionally accumulates sublayer cosines.

    ``cosine`` is a ``[2, L]`` array (attention, MLP) to which this sequence's mean cos(h_in, h_out)
    over its positions is added.
    """
    weight = decoder.embed.weight  # the device and dtype of the weights, everywhere (CPU or CUDA)
    ids = torch.tensor([tokens], device=weight.device)
    cache = decoder.new_cache(len(tokens), dtype=weight.dtype, device=weight.device)
    hooks, observe = [], None
    if cosine is not None and getattr(decoder, "whole_blocks", False):  # the generic path: one cosine per block
        inputs: dict = {}
        for i, block in enumerate(decoder.layers):
            hooks += [
                block.register_forward_pre_hook(_keep_block_input(inputs, i), with_kwargs=True),
                block.register_forward_hook(_add_block_cosine(inputs, cosine, i)),
            ]
    elif cosine is not None:
        observe = _sublayer_cosine(cosine)
    exits = [None]
    try:
        # Block by block, keeping the hidden state at every exit: an early-exit draft at E is exactly the
        # full model's state after block E-1, so scoring every exit layer needs only the head.
        h = decoder.embed_tokens(ids, 0)
        for i in range(decoder.config.num_layers):
            h = decoder.run_blocks(h, 0, cache, i, i + 1, **({"observe": observe} if observe else {}))
            exits.append(h[:, prompt_len:-1])
    finally:
        for hook in hooks:
            hook.remove()
    return Reference(tokens=ids, prompt_len=prompt_len, cache=cache, exits=exits)


def _sublayer_cosine(cosine: np.ndarray):
    """``run_blocks``' observer adding each sublayer's mean cos(h_in, h_in + branch) to ``cosine``."""

    def observe(kind, i, h_in, branch):
        similarity = torch.nn.functional.cosine_similarity(h_in, h_in + branch, dim=-1).mean().item()
        cosine[0 if kind == "attn" else 1, i] += similarity

    return observe


def _keep_block_input(inputs: dict, layer: int):
    def hook(module, args, kwargs):
        inputs[("block", layer)] = args[0] if args else kwargs["hidden_states"]

    return hook


def _add_block_cosine(inputs: dict, cosine: np.ndarray, layer: int):
    def hook(module, args, kwargs_or_output, output=None):
        out = output if output is not None else kwargs_or_output
        out = out[0] if isinstance(out, (tuple, list)) else out
        value = torch.nn.functional.cosine_similarity(inputs[("block", layer)], out, dim=-1).mean().item()
        cosine[:, layer] += value

    return hook


def _mixed_keys_values(decoder: Decoder, ref: Reference):
    """The decoder's ``keys_values`` hook for a draft's parallel pass: each query sees the reference's
    (the verifier's) K/V at earlier positions and its own K/V on the diagonal, what the first token of
    a real round sees (docs/design.md section 5). The attention itself is the decoder's."""
    config = decoder.config

    def keys_values(i, k_own, v_own, mask):
        n = k_own.shape[2]
        keys = torch.cat((ref.cache.k[i, :, :, :n], k_own), dim=2)
        values = torch.cat((ref.cache.v[i, :, :, :n], v_own), dim=2)
        q_pos = torch.arange(n, device=k_own.device)[:, None]
        k_pos = torch.arange(n, device=k_own.device)[None, :]
        earlier = k_pos < q_pos
        window = config.window_of(i)
        if window is not None:
            earlier &= k_pos > q_pos - window
        return keys, values, torch.cat((earlier, k_pos == q_pos), dim=1)

    return keys_values


class DraftEstimator:
    """What a draft kind's ``estimate_hidden`` asks for, over one calibration sequence."""

    def __init__(self, decoder: Decoder, ref: Reference):
        self.decoder, self.ref = decoder, ref

    def reference_hidden(self, layer: int) -> torch.Tensor:
        """The full model's own hidden states after block ``layer - 1`` (exact for an early exit's prefix)."""
        if self.ref.exits is not None:
            return self.ref.exits[layer]
        d = self.decoder
        return d.run_blocks(d.embed_tokens(self.ref.tokens, 0), 0, None, 0, layer)[:, self.ref.prompt_len : -1]

    def mixed(self, segment) -> torch.Tensor:
        """``segment``'s blocks over the sequence with mixed attention. The generic path has no attention
        of its own to mix: its draft reads its own K/V at every position (docs/design.md section 5's plain
        parallel estimate)."""
        d = self.decoder
        hook = None if getattr(d, "whole_blocks", False) else _mixed_keys_values(d, self.ref)
        h = d.run_blocks(
            d.embed_tokens(self.ref.tokens, 0),
            0,
            None,
            segment.start,
            segment.stop,
            segment.skip_attn,
            segment.skip_mlp,
            keys_values=hook,
        )
        return h[:, self.ref.prompt_len : -1]


@torch.inference_mode()
def draft_logits(decoder: Decoder, plan: DraftPlan, ref: Reference, head=None) -> torch.Tensor:
    """The draft plan's logits at the continuation's positions (prompt_len..N-2), in one forward. ``head``
    (a ``TorchDraftHead``: exit adapter and/or reduced vocabulary) replaces the shared head; its logits
    are ``-inf`` outside the draft vocabulary."""
    h = read_plan(plan, decoder.config.num_layers).kind.estimate_hidden(DraftEstimator(decoder, ref))
    return (decoder.head(h) if head is None else head.full_logits(h))[0]


RUNNER_UPS = 3  # next-best draft tokens a profile keeps per position: model-draft trees up to 4 branches


def profile_plan(decoder: Decoder, plan: DraftPlan, references: list[Reference], head=None) -> Profile:
    matches, confidences, tops, runners, runner_probs = [], [], [], [], []
    for ref in references:
        logits = draft_logits(decoder, plan, ref, head)
        probs = torch.softmax(logits.float(), dim=-1)
        best, order = probs.topk(RUNNER_UPS + 1, dim=-1)
        conf, top = best[:, 0], order[:, 0]
        matches.append(top.cpu().numpy() == ref.targets)
        confidences.append(conf.cpu().numpy())
        tops.append(top.cpu().numpy())
        runners.append(order[:, 1:].cpu().numpy())
        runner_probs.append(best[:, 1:].cpu().numpy())
    return Profile(
        matches=matches, confidences=confidences, tops=tops, runner_ups=runners, runner_up_probs=runner_probs
    )


@dataclass
class RoundEstimate:
    tokens_per_round: float
    drafted_per_round: float
    acceptance_rate: float
    expected_speedup: float
    max_draft: int
    threshold: float


def simulate_rounds(profile: Profile, max_draft: int, threshold: float) -> list[tuple[int, int]]:
    """Replay draft-and-verify rounds along each calibration continuation: (drafted, accepted) per round.

    Mirrors ``runtime.decoding.speculative.decode`` step for step: a round starting at position i drafts while
    the draft is confident, at most ``max_draft`` tokens and never past the token budget (one slot is
    kept for the verifier's token); it accepts the run of matches from i; the next round starts after
    the verifier's token. With a budget of one token left, the loop takes a plain step instead.
    """
    rounds = []
    for matches, confidences in zip(profile.matches, profile.confidences):
        n, i = len(matches), 0
        while i < n:
            limit = min(max_draft, n - i - 1)
            if limit <= 0:
                i += 1
                continue
            drafted, accepted, alive = 0, 0, True
            while drafted < limit:
                j = i + drafted
                drafted += 1
                if alive and matches[j]:
                    accepted += 1
                else:
                    alive = False
                if confidences[j] < threshold:
                    break
            rounds.append((drafted, accepted))
            i += accepted + 1
    return rounds


def estimate(profile: Profile, plan: DraftPlan, cost, max_draft: int, threshold: float) -> RoundEstimate:
    """Expected speedup = E[tokens per round] / E[cost per round], relative to one plain decode step."""
    rounds = simulate_rounds(profile, max_draft, threshold)
    if not rounds:
        return RoundEstimate(1.0, 0.0, 0.0, 0.0, max_draft, threshold)
    drafted = np.array([d for d, _ in rounds], dtype=float)
    accepted = np.array([a for _, a in rounds], dtype=float)
    draft_step = cost.draft_step(plan)
    round_cost = np.array([d * draft_step + cost.verify(plan, int(d) + 1) for d in drafted])
    tokens = accepted + 1
    speedup = tokens.sum() / round_cost.sum() * cost.plain_step()
    return RoundEstimate(
        tokens_per_round=float(tokens.mean()),
        drafted_per_round=float(drafted.mean()),
        acceptance_rate=float(accepted.sum() / max(drafted.sum(), 1)),
        expected_speedup=float(speedup),
        max_draft=max_draft,
        threshold=threshold,
    )


THRESHOLDS = (0.0, 0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def best_policy(profile: Profile, plan: DraftPlan, cost, max_draft: int) -> RoundEstimate:
    """The draft-length policy (max draft, confidence threshold) that maximises expected speedup."""
    candidates = (estimate(profile, plan, cost, k, th) for k in range(1, max_draft + 1) for th in THRESHOLDS)
    return max(candidates, key=lambda e: e.expected_speedup)
