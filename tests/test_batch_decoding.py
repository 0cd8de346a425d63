"""The batch round (``runtime/decoding/batch.py``): every sequence of a batch decodes what it decodes alone.

Sequences of different prompt and output lengths join and leave the batch between rounds, each with its own
plan (plain, n-gram lookup chains, lookup trees, an early exit that reuses its prefix), on the torch backend
and on ONNX Runtime's fused graphs; the load policy may cut their drafts to any length. Each sequence's
output must equal its own batch-1 plain greedy output (the near-tie rule of docs/design.md section 6), and a
sampled sequence must follow the plain sampler's distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from lossless import assert_same_greedy, chi_square_pvalue, exact_marginals, next_token_logits, run
from onnx_helpers import make_artifact, ort_backend
from test_tree import TREE

from speccompile.runtime.artifact.manifest import DraftPlan
from speccompile.runtime.backends.slots import ReplicaSlots
from speccompile.runtime.backends.torch.backend import TorchBackend
from speccompile.runtime.backends.torch.graphs import eager_capture
from speccompile.runtime.decoding.batch import BatchDecoder
from speccompile.runtime.decoding.load import CallCosts, Choice, choose_lengths, draft_pays, expected_tokens
from speccompile.runtime.decoding.speculative import DecodeRequest
from speccompile.runtime.errors import InputError
from speccompile.runtime.sampling import SamplingParams

LOOKUP = DraftPlan.of(name="lookup", lookup=["ngram"], lookup_max_draft=4, sources={"ngram": {"min": 1, "max": 3}})
EXIT = DraftPlan.of(name="exit", exit_layer=1, head="final", sources={"model": {"max_draft": 3, "threshold": 0.0}})
SKIP = DraftPlan.of(name="skip", skip_attn=[1], skip_mlp=[0], sources={"model": {"max_draft": 3, "threshold": 0.0}})


def _prompts(vocab: int, count: int) -> list[list[int]]:
    """Prompts that repeat themselves, so lookups draft, of different lengths."""
    gen = torch.Generator().manual_seed(3)
    prompts = []
    for i in range(count):
        head = torch.randint(3, vocab, (4 + i,), generator=gen).tolist()
        prompts.append(head + head[:3] + torch.randint(3, vocab, (2,), generator=gen).tolist() + head)
    return prompts


def _decode_batch(backend, requests, max_batch, costs=None, joins=(), prefill_chunk=None, sequences=None):
    """Run ``requests`` ((request, plan) pairs) through one BatchDecoder: the first ``max_batch`` from the
    start, each later one when a place frees or at the step ``joins`` gives; their outputs in order
    (``sequences``: a list that gets each request's ``Sequence``, in order)."""
    engine = BatchDecoder(backend, max_batch=max_batch, costs=costs, prefill_chunk=prefill_chunk)
    outputs: dict[int, list[int]] = {}
    pending = list(enumerate(requests))
    live: dict[int, object] = {}
    step = 0
    while pending or live:
        while pending and len(live) < max_batch and (not joins or step >= joins[min(pending[0][0], len(joins) - 1)]):
            index, (request, plan) = pending.pop(0)
            live[index] = engine.add(request, plan)
            outputs[index] = []
            if sequences is not None:
                sequences.append(live[index])
        by_id = {id(seq): i for i, seq in live.items()}
        for seq, new in engine.step():
            outputs[by_id[id(seq)]].extend(new)
        for index, seq in list(live.items()):
            if seq.finished:
                engine.remove(seq)
                del live[index]
        step += 1
        assert step < 2000, "the batch did not finish"
    return [outputs[i] for i in range(len(requests))]


def _check(decoder, alone_backend, requests, outputs) -> int:
    near_ties = 0
    for (request, _), got in zip(requests, outputs):
        plain, _ = run(alone_backend, request.prompt_ids, request.max_new_tokens)
        near_ties += assert_same_greedy(decoder, request.prompt_ids, plain, got)
    assert near_ties <= 1, f"{near_ties} near-tie divergences: too many to be rounding"
    return near_ties


def _requests(decoder, plans, lengths=(9, 14, 6, 11, 8, 12)) -> list[tuple[DecodeRequest, DraftPlan | None]]:
    prompts = _prompts(decoder.config.vocab_size, len(lengths))
    return [
        (DecodeRequest(prompt, new), plans[i % len(plans)]) for i, (prompt, new) in enumerate(zip(prompts, lengths))
    ]


@pytest.mark.parametrize("family", ["llama", "gpt2", "mistral", "gpt_neox"])
def test_torch_batch_every_sequence_decodes_its_own_plain_output(family, tiny_decoder):
    _, decoder = tiny_decoder(family)
    requests = _requests(decoder, [None, LOOKUP, TREE, EXIT, SKIP, LOOKUP])
    outputs = _decode_batch(TorchBackend(decoder), requests, max_batch=3, joins=(0, 0, 0, 2, 3, 5))
    _check(decoder, TorchBackend(decoder), requests, outputs)


def warm_capture(fn):
    """What ``graphs.cuda_capture_with`` does before recording a graph: the step runs twice (the warm-up), with
    every side effect of a real call; then each call replays it."""
    fn()
    fn()
    return fn


@pytest.mark.parametrize("capture", [eager_capture, warm_capture], ids=["static-steps", "warm-capture"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "mistral"])
def test_torch_batches_through_graphs_per_batch_bucket_decode_their_own_plain_output(family, capture, tiny_decoder):
    """The batched calls a CUDA GPU replays from graphs (one per segment, batch bucket and width; the batch padded
    with rows that write past every sequence's end), run here through the same static buffers: sequences joining
    and leaving, plain steps, verifies, prompt chunks and kept prompts beside them."""
    _, decoder = tiny_decoder(family)
    requests = _requests(decoder, [None, LOOKUP, TREE, EXIT, SKIP, LOOKUP])
    backend = TorchBackend(decoder, capture=capture, round_on_device=False)
    outputs = _decode_batch(backend, requests, max_batch=3, joins=(0, 0, 0, 2, 3, 5))
    _check(decoder, TorchBackend(decoder), requests, outputs)
    buckets = {key[2] for key in backend.static.graphs if key[0] == "rows"}
    assert buckets >= {2, 4}, buckets  # batches of 2 and 3 sequences ran from their buckets' graphs


@pytest.fixture(scope="module")
def onnx_family(tiny_decoder, tmp_path_factory):
    made = {}

    def get(family: str):
        if family not in made:
            _, decoder = tiny_decoder(family)
            plans = {p.name: p for p in (LOOKUP, TREE, EXIT, SKIP)}
            root = make_artifact(decoder, plans, tmp_path_factory.mktemp("batch") / family, variant="fused")
            made[family] = (decoder, root)
        return made[family]

    return get


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "mistral"])
def test_onnx_batch_every_sequence_decodes_its_own_plain_output(family, onnx_family):
    decoder, root = onnx_family(family)
    requests = _requests(decoder, [None, LOOKUP, TREE, EXIT, SKIP, LOOKUP])
    outputs = _decode_batch(ort_backend(root), requests, max_batch=4, joins=(0, 0, 1, 1, 4, 6), prefill_chunk=5)
    _check(decoder, ort_backend(root), requests, outputs)


def test_onnx_quantized_targets_in_a_batch_decode_their_own_plain_output(tiny_decoder, tmp_path):
    """int8 / int4 graphs (int8 activations): a batch's rows run one call each for the verifier, so every output
    is still the sequence's own plain output, to the token."""
    _, decoder = tiny_decoder("llama")
    for scheme in ("int8", "int4"):
        plans = {p.name: p for p in (LOOKUP, SKIP)}
        root = make_artifact(decoder, plans, tmp_path / scheme, variant="fused", quantize=scheme)
        backend = ort_backend(root)
        assert not backend.rows_share_a_call()
        requests = _requests(decoder, [None, LOOKUP, SKIP, LOOKUP])[:4]
        outputs = _decode_batch(backend, requests, max_batch=4)
        alone = ort_backend(root)
        for (request, _), got in zip(requests, outputs):
            assert got == run(alone, request.prompt_ids, request.max_new_tokens)[0]


def test_batch_with_the_load_policy_cutting_drafts_stays_lossless(tiny_decoder, onnx_family):
    """Costs that make drafting expensive past two sequences: the policy cuts drafts to nothing or part of
    them, rounds mix plain and speculative rows, and every output is still its plain one."""
    _, decoder = tiny_decoder("llama")
    costs = CallCosts({1: 1.0, 2: 1.05, 4: 1.2, 8: 2.0}, {1: 1.0, 2: 1.6, 3: 2.2, 4: 2.8, 5: 3.4})
    requests = _requests(decoder, [LOOKUP, TREE, SKIP])
    outputs = _decode_batch(TorchBackend(decoder), requests, max_batch=4, costs=costs)
    _check(decoder, TorchBackend(decoder), requests, outputs)
    onnx_decoder, root = onnx_family("llama")
    requests = _requests(onnx_decoder, [LOOKUP, TREE, EXIT])
    outputs = _decode_batch(ort_backend(root), requests, max_batch=4, costs=costs)
    _check(onnx_decoder, ort_backend(root), requests, outputs)


def _shared_prefix_requests(decoder, plans, prefix=12) -> list[tuple[DecodeRequest, DraftPlan | None]]:
    """Requests whose prompts begin with the same ``prefix`` tokens (a chat template's system prompt), then
    differ; one prompt is the shared part and one token only."""
    gen = torch.Generator().manual_seed(11)
    vocab = decoder.config.vocab_size
    shared = torch.randint(3, vocab, (prefix,), generator=gen).tolist()
    tails = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 9, 1, 7, 3, 6)]
    tails = [tail + tail[:2] + tail for tail in tails]  # repeats, so that lookups draft
    lengths = (9, 12, 6, 10, 8, 11)
    return [
        (DecodeRequest(shared + tail, new), plans[i % len(plans)]) for i, (tail, new) in enumerate(zip(tails, lengths))
    ]


@pytest.mark.parametrize("backend_kind", ["torch", "onnx"])
def test_a_shared_prompt_prefix_is_copied_not_recomputed(backend_kind, tiny_decoder, onnx_family):
    """Sequences that join after a prompt with the same first tokens was read copy that prefix's KV from a kept
    prompt's slot (which moves up when the batch grows into it) and read only the rest of their prompt; each
    still decodes its own batch-1 plain output. The first sequence has nothing to copy; a request alone
    (``max_batch`` 1) and replicas keep no prompts."""
    if backend_kind == "torch":
        _, decoder = tiny_decoder("llama")
        make = lambda: TorchBackend(decoder)  # noqa: E731
    else:
        decoder, root = onnx_family("qwen2")
        make = lambda: ort_backend(root)  # noqa: E731
    requests = _shared_prefix_requests(decoder, [None, LOOKUP, TREE, EXIT, SKIP, LOOKUP])
    sequences: list = []
    outputs = _decode_batch(make(), requests, max_batch=3, joins=(0, 1, 2, 3, 3, 4), sequences=sequences)
    _check(decoder, make(), requests, outputs)
    reused = [s.stats.reused_prompt_tokens for s in sequences]
    assert reused[0] == 0 and all(n == 12 for n in reused[1:]), reused
    assert all(s.reused == n for s, n in zip(sequences, reused))
    alone = BatchDecoder(make(), max_batch=1)
    first = alone.add(requests[0][0])
    while not first.finished:
        alone.step()
    assert alone.prompts.capacity == 0 and not alone.prompts.kept
    assert BatchDecoder(ReplicaSlots(make()), max_batch=3).prompts.capacity == 0  # replicas trade places
    with pytest.raises(InputError, match="cannot keep prompts"):
        BatchDecoder(ReplicaSlots(make()), max_batch=3, keep_prompts=2)
    assert BatchDecoder(make(), max_batch=3, keep_prompts=0).prompts.capacity == 0


def test_quantized_targets_copy_kept_prompts_to_the_token(tiny_decoder, tmp_path):
    """int8 / int4 graphs: a prompt prefix copied from another prompt's prefill (a call of another row count) gives
    each sequence its own plain output to the token, as the quantized targets' batches do."""
    _, decoder = tiny_decoder("llama")
    for scheme in ("int8", "int4"):
        root = make_artifact(
            decoder, {p.name: p for p in (LOOKUP, SKIP)}, tmp_path / scheme, variant="fused", quantize=scheme
        )
        requests = _shared_prefix_requests(decoder, [None, LOOKUP, SKIP])
        sequences: list = []
        outputs = _decode_batch(ort_backend(root), requests, max_batch=3, joins=(0, 1, 2, 3, 3, 4), sequences=sequences)
        assert [s.reused for s in sequences] == [0, 12, 12, 12, 12, 12]
        alone = ort_backend(root)
        for (request, _), got in zip(requests, outputs):
            assert got == run(alone, request.prompt_ids, request.max_new_tokens)[0], scheme


def _read_prompts(engine, *requests):
    """Add ``requests`` and step until each has read its prompt; the sequences."""
    added = [engine.add(r) for r in requests]
    while any(s.prefilled < len(s.request.prompt_ids) for s in added):
        engine.step()
    return added


def test_kept_prompts_stay_out_of_the_sequences_slots(tiny_decoder):
    """Kept prompts sit in slots after the sequences' and move out of a joining sequence's way with their KV;
    the batch's slots stay 0..n-1."""
    _, decoder = tiny_decoder("llama")
    backend = TorchBackend(decoder)
    engine = BatchDecoder(backend, max_batch=3)
    (first, _), (second, _), (third, _) = _shared_prefix_requests(decoder, [None])[:3]
    (a,) = _read_prompts(engine, first)
    assert [(e.tokens, e.slot) for e in engine.prompts.kept] == [(list(first.prompt_ids), 1)]
    kept = backend.slot_cache.k[:, 1, :, : len(first.prompt_ids)].clone()
    (b,) = _read_prompts(engine, second)  # takes slot 1: the first prompt moves to slot 2 first
    assert (a.slot, b.slot, b.reused) == (0, 1, 12)
    assert [e.slot for e in engine.prompts.kept] == [2, 3]
    torch.testing.assert_close(backend.slot_cache.k[:, 2, :, : len(first.prompt_ids)], kept, rtol=0, atol=0)
    c = engine.add(third)
    assert c.slot == 2 and c.reused == 12 and sorted(e.slot for e in engine.prompts.kept) == [3, 4]


def test_a_repeated_prompt_copies_all_but_its_last_token_and_the_oldest_is_evicted(tiny_decoder):
    """A prompt read before is copied whole but for its last token; a prompt that extends a kept one (the next
    turn of a conversation) replaces it; beyond ``keep_prompts`` the least recently used one goes. Every
    sequence still decodes its own plain output."""
    _, decoder = tiny_decoder("llama")
    backend = TorchBackend(decoder)
    engine = BatchDecoder(backend, max_batch=2, keep_prompts=2)
    gen = torch.Generator().manual_seed(23)
    vocab = decoder.config.vocab_size
    one, two, three = (torch.randint(3, vocab, (10 + i,), generator=gen).tolist() for i in range(3))
    turn = one + torch.randint(3, vocab, (4,), generator=gen).tolist()
    outputs = {}
    for name, prompt in (("one", one), ("two", two), ("one again", one), ("turn", turn), ("three", three)):
        s = engine.add(DecodeRequest(prompt, 6))
        outputs[name] = []
        while not s.finished:
            for _, new in engine.step():
                outputs[name].extend(new)
        engine.remove(s)
        expected = {"one": 0, "two": 0, "one again": len(one) - 1, "turn": len(one), "three": 0}[name]
        assert s.reused == expected, (name, s.reused)
        kept = [e.tokens for e in sorted(engine.prompts.kept, key=lambda e: e.last_used)]
        if name == "turn":
            assert kept == [two, turn]  # the conversation's next turn replaced its first
        if name == "three":
            assert kept == [turn, three]  # "two", least recently used, was evicted
    for name, prompt in (("one", one), ("one again", one), ("turn", turn)):
        plain, _ = run(TorchBackend(decoder), prompt, 6)
        assert_same_greedy(decoder, prompt, plain, outputs[name])


def test_a_batch_on_replicas_decodes_like_one_on_slots(tiny_decoder):
    """Backends without slots (TensorRT, the generic torch path) batch through replicas: same outputs."""
    _, decoder = tiny_decoder("llama")
    requests = _requests(decoder, [None, LOOKUP, TREE])[:4]
    on_slots = _decode_batch(TorchBackend(decoder), requests, max_batch=4)
    on_replicas = _decode_batch(ReplicaSlots(TorchBackend(decoder)), requests, max_batch=4)
    assert on_slots == on_replicas


def test_a_sequence_that_leaves_hands_its_slot_to_the_last_one(tiny_decoder):
    """Slots stay consecutive: the last sequence moves into a freed slot, with its cache, and decodes on."""
    _, decoder = tiny_decoder("llama")
    backend = TorchBackend(decoder)
    engine = BatchDecoder(backend, max_batch=3)
    prompts = _prompts(decoder.config.vocab_size, 3)
    short, long_a, long_b = (
        engine.add(DecodeRequest(prompts[0], 2)),
        engine.add(DecodeRequest(prompts[1], 12)),
        engine.add(DecodeRequest(prompts[2], 12), LOOKUP),
    )
    outputs = {id(s): [] for s in (short, long_a, long_b)}
    while not (long_a.finished and long_b.finished):
        for seq, new in engine.step():
            outputs[id(seq)].extend(new)
        if short.finished and short in engine.sequences:
            engine.remove(short)
            assert long_b.slot == 0 and [s.slot for s in engine.sequences] == [0, 1]
    for seq, prompt in ((long_a, prompts[1]), (long_b, prompts[2])):
        plain, _ = run(TorchBackend(decoder), prompt, 12)
        assert_same_greedy(decoder, prompt, plain, outputs[id(seq)])


def test_sampling_in_a_batch_follows_the_plain_distribution(small_vocab_llama):
    """A sampled sequence beside others: its 3rd token's distribution (over seeds) is the plain sampler's,
    by chi-square, with drafts accepted and rejected."""
    decoder = small_vocab_llama
    params = SamplingParams(temperature=1.0)
    vocab = decoder.config.vocab_size
    prompt = [x % vocab for x in range(vocab)] * 3
    neighbour = DecodeRequest([5, 6, 7, 5, 6, 7, 5], 6)
    thirds, accepted = [], 0
    backend = TorchBackend(decoder)
    for seed in range(600):
        engine = BatchDecoder(backend, max_batch=2)
        engine.add(neighbour, LOOKUP)
        seq = engine.add(DecodeRequest(prompt, 3, params, seed=seed), LOOKUP)
        tokens: list[int] = []
        while not seq.finished:
            for s, new in engine.step():
                if s is seq:
                    tokens.extend(new)
        thirds.append(tokens[2])
        accepted += seq.stats.accepted
    assert 0 < accepted
    _, expected = exact_marginals(next_token_logits(decoder), params, prompt, vocab)
    assert chi_square_pvalue(thirds, expected) > 1e-3


def test_expected_tokens_and_the_policy_fall_back_to_plain_under_load():
    assert expected_tokens(0.0, 4) == pytest.approx(1.0)
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    # a call of n one-token rows: flat up to 4 rows, then linear; a row of w tokens alone costs like 1 row
    costs = CallCosts({1: 1.0, 4: 1.0, 16: 4.0, 64: 16.0}, {1: 1.0, 5: 1.1})
    few = [Choice(0.8, 4), Choice(0.8, 4)]
    assert choose_lengths(costs, few) == [4, 4]  # nearly free alone: draft
    many = [Choice(0.8, 4)] * 16
    lengths = choose_lengths(costs, many)
    rate = sum(expected_tokens(0.8, k) for k in lengths) / costs.round_cost([k + 1 for k in lengths])
    assert rate >= 16 / costs.round_cost([1] * 16)  # never below plain batched decoding
    poor = [Choice(0.05, 4)] * 16
    assert choose_lengths(costs, poor) == [0] * 16  # drafts that are rarely right: plain batched decoding
    padded = CallCosts({1: 1.0, 8: 1.0, 64: 8.0}, {1: 1.0}, one_call=True)
    assert choose_lengths(padded, [Choice(0.9, 3)] * 2) == [3, 3]
    assert choose_lengths(padded, [Choice(0.3, 3)] * 16) == [0] * 16
    assert draft_pays(costs, 0.9, 4, 0.3, 1)
    assert not draft_pays(costs, 0.3, 4, 0.5, 16)


def test_a_sequences_acceptance_is_the_per_token_chance_the_policy_prices():
    """``expected_tokens`` reads acceptance as the chance of each drafted token after the ones before it; a
    sequence's running estimate must be that chance, not accepted over drafted (which reads 0.85 as about 0.5
    from drafts of 8, and prices long drafts at a fraction of what they bring)."""
    from speccompile.runtime.decoding.batch import Sequence

    rng = np.random.default_rng(0)
    s = Sequence(request=None, drafter=None, stats=None, view=None, rng=rng)
    estimates, tokens = [], []
    for _ in range(3000):
        depth = 8
        accepted = 0
        while accepted < depth and rng.random() < 0.85:
            accepted += 1
        s.observe_acceptance(accepted, depth)
        estimates.append(s.acceptance)
        tokens.append(accepted + 1)
    assert np.mean(estimates[500:]) == pytest.approx(0.85, abs=0.03)
    # and so the policy's tokens per round for a draft of 8 match what the rounds committed
    assert expected_tokens(np.mean(estimates[500:]), 8) == pytest.approx(np.mean(tokens), rel=0.1)
    # a tree's depth, not its node count, is what a round judges: all of a 3-deep path accepted is no rejection
    t = Sequence(request=None, drafter=None, stats=None, view=None, rng=rng)
    for _ in range(50):
        t.observe_acceptance(3, 3)
    assert t.acceptance > 0.99


def test_sequences_in_their_prompt_chunks_count_as_load(tiny_decoder):
    """A sequence that finished its prompt while others are still in their prompt chunks drafts as if they were in
    the round: with costs where drafting pays alone and not in a batch of eight, it steps plainly until they join
    (and drafts once it is alone, the control). Outputs stay its own plain output either way."""
    _, decoder = tiny_decoder("llama")
    costs = CallCosts({1: 1.0, 16: 1.2}, {1: 1.0, 5: 1.0})
    prompt = [5, 6, 7, 8] * 4
    plain = BatchDecoder(TorchBackend(decoder), max_batch=1)
    alone_seq = plain.add(DecodeRequest(prompt, 24))
    reference = []
    while not alone_seq.finished:
        for _, new in plain.step():
            reference.extend(new)

    def drafted_while(joining_prompts: int) -> tuple[list[int], list[int]]:
        engine = BatchDecoder(TorchBackend(decoder), max_batch=8, costs=costs, prefill_chunk=len(prompt))
        first = engine.add(DecodeRequest(prompt, 24), LOOKUP)
        for i in range(joining_prompts):
            engine.add(DecodeRequest(list(range(3, 3 + 60 + i)), 1))  # long prompts: many steps of chunks
        out, drafted = [], []
        while not first.finished:
            for seq, new in engine.step():
                if seq is first:
                    out.extend(new)
            joining = any(not s.finished and s.prefilled < len(s.request.prompt_ids) for s in engine.sequences)
            if engine.last_round and joining:
                drafted.append(engine.last_round["drafted"][0])
                engine.last_round = None
        return out, drafted

    out, drafted = drafted_while(7)
    assert out == reference
    assert drafted and all(d == 0 for d in drafted)
    control = BatchDecoder(TorchBackend(decoder), max_batch=8, costs=costs)
    seq = control.add(DecodeRequest(prompt, 24), LOOKUP)
    lengths = []
    while not seq.finished:
        control.step()
        if control.last_round:
            lengths.extend(control.last_round["drafted"])
    assert max(lengths) > 0  # alone, the same costs let it draft
    # without costs (no load policy), joining sequences add no phantom entries to the round's draft lengths
    engine = BatchDecoder(TorchBackend(decoder), max_batch=8, prefill_chunk=len(prompt))
    engine.add(DecodeRequest(prompt, 4), LOOKUP)
    engine.add(DecodeRequest(list(range(3, 63)), 1))
    engine.step()
    engine.step()
    assert len(engine.last_round["drafted"]) == engine.last_round["sequences"] == 1


def test_measured_costs_come_from_the_backend_calls(tiny_decoder, onnx_family):
    _, root = onnx_family("llama")
    costs = CallCosts.measure(ort_backend(root), max_rows=4, max_width=3, context=8, repeats=1)
    assert sorted(costs.batched) == [1, 2, 4] and sorted(costs.alone) == [1, 2, 3]
    assert all(v > 0 for v in list(costs.batched.values()) + list(costs.alone.values()))
    assert not costs.one_call  # graphs exported without --packed-rows: a wider row is a call of its own
    _, decoder = tiny_decoder("llama")
    assert CallCosts.measure(TorchBackend(decoder), max_rows=2, max_width=2, context=8, repeats=1).one_call
    again = CallCosts.from_dict(costs.as_dict())
    assert again.round_cost([1, 1, 3]) == pytest.approx(costs.round_cost([1, 1, 3]), rel=1e-3)


def test_batch_limits_are_one_line_errors(tiny_decoder):
    from speccompile.runtime.errors import InputError

    _, decoder = tiny_decoder("llama")
    with pytest.raises(InputError, match="max_batch must be at least 1"):
        BatchDecoder(TorchBackend(decoder), max_batch=0)
    engine = BatchDecoder(TorchBackend(decoder), max_batch=1)
    engine.add(DecodeRequest([5, 6], 3))
    with pytest.raises(InputError, match="the batch is full"):
        engine.add(DecodeRequest([5, 6], 3))
    np.testing.assert_equal(len(engine.sequences), 1)


class CallLog:
    """The full model's batched calls of a backend: per call, the rows' widths and whether they were prompt rows."""

    def __init__(self, backend, prompt_slots):
        self.calls: list[list[tuple[int, int]]] = []  # per call: (slot, width)
        original = backend.run_rows

        def logged(segment, rows):
            if segment.stop == backend.config.num_layers and segment.start == 0 and segment.head is not None:
                self.calls.append([(row.slot, row.width) for row in rows])
            return original(segment, rows)

        backend.run_rows = logged


def test_prompt_chunks_ride_in_the_verify_call_within_the_token_budget(tiny_decoder):
    """Three sequences decode while a fourth reads a long prompt: each step is one call of the full model with the
    running sequences' rows first and the prompt chunk in what the token budget leaves; every output is its own."""
    _, decoder = tiny_decoder("llama")
    vocab = decoder.config.vocab_size
    prompts = _prompts(vocab, 3)
    gen = torch.Generator().manual_seed(5)
    long_prompt = torch.randint(3, vocab, (40,), generator=gen).tolist()
    requests = [(DecodeRequest(p, 20), None) for p in prompts] + [(DecodeRequest(long_prompt, 6), LOOKUP)]
    backend = TorchBackend(decoder)
    engine = BatchDecoder(backend, max_batch=4, prefill_chunk=32, token_budget=8)
    log = CallLog(engine.backend, None)
    sequences = [engine.add(request, plan) for request, plan in requests[:3]]
    outputs = {id(s): [] for s in sequences}
    while any(s.prefilled < len(s.request.prompt_ids) for s in sequences):
        for s, new in engine.step():
            outputs[id(s)].extend(new)
    log.calls.clear()
    joiner = engine.add(*requests[3])
    sequences.append(joiner)
    outputs[id(joiner)] = []
    steps = 0
    while not all(s.finished for s in sequences):
        for s, new in engine.step():
            outputs[id(s)].extend(new)
        steps += 1
        assert steps < 200
    reading = [call for call in log.calls if any(slot == joiner.slot for slot, _ in call)][: -(-40 // 5)]
    assert len(reading) >= 8  # the 40 prompt tokens came in chunks of what the budget left: 8 - 3 running rows
    for call in reading[:5]:
        assert sum(width for _, width in call) <= 8 and len(call) == 4  # one call: 3 steps and the chunk
    _check(decoder, TorchBackend(decoder), requests, [outputs[id(s)] for s in sequences])


def test_a_token_budget_must_be_positive(tiny_decoder):
    _, decoder = tiny_decoder("llama")
    with pytest.raises(InputError, match="token_budget must be at least 1"):
        BatchDecoder(TorchBackend(decoder), max_batch=2, token_budget=0)


def test_one_call_costs_price_each_drafted_token_and_read_older_manifests():
    """Where every row shares one call priced by its tokens (torch's packed rows), each drafted token is weighed on
    its own: a sequence whose drafts are often right drafts longer than one whose drafts rarely are, and a batch
    whose drafts do not pay steps plainly. Costs stored by earlier builds under ``pad_to_widest`` read alike."""
    costs = CallCosts({1: 1.0, 8: 1.0, 64: 8.0}, {1: 1.0}, one_call=True)
    acceptance = [0.9, 0.2, 0.7, 0.7]  # four rows: a call of up to 8 tokens costs one step, more cost more
    mixed = choose_lengths(costs, [Choice(a, 6) for a in acceptance])
    # the 4 free tokens go to the likeliest: 0.9, 0.81, 0.729 of the first sequence, then one 0.7
    assert mixed[0] == 3 and mixed[1] == 0 and mixed[2] + mixed[3] == 1
    rate = sum(expected_tokens(a, k) for a, k in zip(acceptance, mixed)) / costs.round_cost([k + 1 for k in mixed])
    assert rate >= 4 / costs.round_cost([1] * 4)
    assert choose_lengths(costs, [Choice(0.05, 6)] * 16) == [0] * 16
    stored = costs.as_dict()
    assert stored["one_call"] is True
    legacy = {key: value for key, value in stored.items() if key != "one_call"} | {"pad_to_widest": True}
    assert CallCosts.from_dict(legacy).one_call and not CallCosts.from_dict(stored | {"one_call": False}).one_call


def test_model_draft_steps_are_priced_as_one_shared_call():
    """One batched draft step serves every sequence that drafts with the model, so each pays its share of that
    step (``CallCosts.draft``): with a cheap draft curve, four sequences draft where pricing each sequence's
    steps as full-model steps would keep them all plain (the control: no draft curve, where a draft step is
    priced as a plain step of as many rows)."""
    from speccompile.runtime.decoding.load import draft_pays

    flat = {1: 1.0, 16: 1.0, 64: 4.0}  # a verify call costs one step up to 16 tokens
    cheap = CallCosts(flat, {1: 1.0}, one_call=True, draft={1: 0.2, 4: 0.25}, draft_segment="blocks")
    assert cheap.draft_step(4) == pytest.approx(0.25) and cheap.draft_step(2) == pytest.approx(0.2 + 0.05 / 3 * 1)
    assert draft_pays(cheap, 0.6, 3, cheap.draft_step(4) / 4, 4)
    assert not draft_pays(cheap, 0.6, 3, cheap.round_cost([1]), 4)  # a full step per drafted token: never
    bare = CallCosts(flat, {1: 1.0}, one_call=True)
    assert bare.draft_step(4) == bare.round_cost([1] * 4)
    # a long model draft that does not pay where a short one does: the policy drafts the short one
    from speccompile.runtime.decoding.load import best_draft_length

    rising = CallCosts({1: 1.0, 8: 1.0, 64: 8.0}, {1: 1.0}, one_call=True)  # flat to 8 tokens, then rising
    assert best_draft_length(rising, 0.9, 8, 0.1, 4) == 4  # 4 + 4 tokens: the last free call
    assert best_draft_length(rising, 0.6, 8, 0.1, 4) == 1
    assert best_draft_length(rising, 0.05, 8, 0.1, 4) == 0 and not draft_pays(rising, 0.05, 8, 0.1, 4)
    restored = CallCosts.from_dict(cheap.as_dict())
    assert restored.draft == cheap.draft and restored.draft_segment == "blocks"
    assert CallCosts.from_dict(bare.as_dict()).draft == {}


def test_a_batch_runs_model_drafts_when_their_shared_step_pays(tiny_decoder):
    """Four sequences with a model draft in one batch: they draft with the model when the draft curve says one
    shared step is cheap, and step plainly when a draft step is priced as a plain step; outputs equal plain
    either way."""
    _, decoder = tiny_decoder("llama")
    flat = {1: 1.0, 16: 1.0, 64: 4.0}
    requests = _requests(decoder, [SKIP], lengths=(8, 8, 8, 8))

    def first_round(costs) -> list[int]:
        engine = BatchDecoder(TorchBackend(decoder), max_batch=4, costs=costs)
        for request, plan in requests:
            engine.add(request, plan)
        while True:
            engine.step()
            if engine.last_round and engine.last_round["sequences"] == 4 and not engine.last_round["prompt_tokens"]:
                return engine.last_round["drafted"]

    cheap = CallCosts(flat, {1: 1.0}, one_call=True, draft={1: 0.2, 4: 0.25}, draft_segment="blocks")
    assert all(d > 0 for d in first_round(cheap))
    # a verify call that grows past 5 tokens: at the prior acceptance each sequence runs one model draft step,
    # not its plan's 3
    short = CallCosts({1: 1.0, 5: 1.0, 64: 8.0}, {1: 1.0}, one_call=True, draft={1: 0.05, 4: 0.06}, draft_segment="b")
    assert max(first_round(short)) == 1
    assert first_round(CallCosts(flat, {1: 1.0}, one_call=True)) == [0, 0, 0, 0]
    outputs = _decode_batch(TorchBackend(decoder), requests, max_batch=4, costs=cheap)
    _check(decoder, TorchBackend(decoder), requests, outputs)


def test_the_draft_step_curve_is_timed_on_the_plans_segment(tiny_decoder, onnx_family):
    """``call_costs`` times the plan's draft step at the batch's row counts beside the stored curves, and times it
    again for a plan that drafts with another segment."""
    from speccompile.runtime.decoding.load import call_costs
    from speccompile.runtime.drafting.plan import read_plan

    _, decoder = tiny_decoder("llama")
    backend = TorchBackend(decoder)
    layers = decoder.config.num_layers
    skip = read_plan(SKIP, layers).kind.draft_segment
    costs = CallCosts.measure(backend, max_rows=4, max_width=3, context=8, repeats=1, draft=skip)
    assert sorted(costs.draft) == [1, 2, 4] and costs.has_draft(skip)
    stored = costs.as_dict()
    assert call_costs(backend, stored, max_rows=4, max_width=3, draft=skip).draft == CallCosts.from_dict(stored).draft
    exit_segment = read_plan(EXIT, layers).kind.draft_segment
    again = call_costs(backend, stored, max_rows=4, max_width=3, draft=exit_segment)
    assert again.has_draft(exit_segment) and not again.has_draft(skip)
