"""The device-resident round (``runtime/backends/torch/device_round.py``) on CPU tensors: the torch backend's round on
CUDA, forced here (``round_on_device=True``) so its logic is tested everywhere and only its speed needs
a GPU. Greedy output equals plain greedy on every family for layer-skip, early-exit, draft-head, lookup
and hybrid plans (eagerly and through the static CUDA-graph steps); sampling has the target's
distribution (chi-square); a round reads the device once (a counter of host reads, with a negative
control: the host round reads it at every draft step and verify)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from lossless import assert_same_greedy, exact_marginals, next_token_logits, run
from lossless import chi_square_pvalue as gof
from tiny_models import FAMILIES

from speccompile.runtime.artifact.manifest import DraftPlan
from speccompile.runtime.backends.torch.backend import TorchBackend
from speccompile.runtime.backends.torch.device_round import DeviceRound
from speccompile.runtime.backends.torch.graphs import eager_capture
from speccompile.runtime.decoding.batch import BatchDecoder
from speccompile.runtime.decoding.speculative import DecodeRequest, Stats, decode
from speccompile.runtime.drafting.drafter import Draft, Drafter, LookupSource
from speccompile.runtime.sampling import SamplingParams, probabilities

NEW_TOKENS = 40
PROMPTS = 3


def greedy_plans(num_layers: int) -> list[DraftPlan]:
    half = num_layers // 2
    return [
        DraftPlan.of(
            name="skip-k3",
            skip_attn=[1],
            skip_mlp=[num_layers - 2],
            sources={"model": {"max_draft": 3, "threshold": 0.0}},
        ),
        DraftPlan.of(
            name="skip-k6-cut",
            skip_attn=[1],
            skip_mlp=[num_layers - 2],
            sources={"model": {"max_draft": 6, "threshold": 0.3}},
        ),
        DraftPlan.of(name="exit-k4", exit_layer=half, sources={"model": {"max_draft": 4, "threshold": 0.0}}),
        DraftPlan.of(name="exit-k5-cut", exit_layer=half, sources={"model": {"max_draft": 5, "threshold": 0.3}}),
        DraftPlan.of(
            name="exit-last", exit_layer=num_layers - 1, sources={"model": {"max_draft": 6, "adaptive": False}}
        ),
        DraftPlan.of(
            name="ngram", lookup=["ngram"], lookup_max_draft=4, sources={"ngram": {"min": 1, "max": 3, "short": 1}}
        ),
        DraftPlan.of(
            name="hybrid-exit",
            lookup=["ngram"],
            lookup_max_draft=4,
            exit_layer=half,
            sources={"ngram": {"min": 2, "max": 3}, "model": {"max_draft": 3, "adaptive": False}},
        ),
        DraftPlan.of(
            name="hybrid-skip",
            lookup=["ngram"],
            lookup_max_draft=3,
            skip_attn=[1],
            skip_mlp=[num_layers - 2],
            sources={"ngram": {"min": 1, "max": 2}, "model": {"max_draft": 2, "threshold": 0.2}},
        ),
    ]


def prompts_for(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (4 + 11 * p,), generator=gen).tolist() for p in range(PROMPTS)]


def device_backend(decoder, **kwargs) -> TorchBackend:
    return TorchBackend(decoder, round_on_device=True, **kwargs)


def count_calls(monkeypatch, owner, name: str = "__call__") -> list[int]:
    """A one-element counter of calls of ``owner.name`` (so a test knows which round ran)."""
    seen = [0]
    original = getattr(owner, name)

    def counted(self, *args, **kwargs):
        seen[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return seen


@pytest.fixture
def rounds_seen(monkeypatch):
    """Counts calls of the device round (so a test knows it ran, not the host round)."""
    return count_calls(monkeypatch, DeviceRound)


# -- lossless greedy ---------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_device_round_greedy_equals_plain(family, tiny_decoder, rounds_seen):
    """Every family and plan kind; a device round commits what the host round commits (the same round
    log: the policy's cut is applied on the device), except hybrid rounds, which do not extend a model
    draft with a lookup on the device."""
    _, decoder = tiny_decoder(family)
    host = TorchBackend(decoder, round_on_device=False)
    device = device_backend(decoder)
    near_ties = accepted = 0
    for prompt in prompts_for(decoder.config.vocab_size):
        plain, _ = run(host, prompt, NEW_TOKENS)
        for plan in greedy_plans(decoder.config.num_layers):
            before = rounds_seen[0]
            spec, stats = run(device, prompt, NEW_TOKENS, plan)
            assert rounds_seen[0] - before == stats.rounds > 0
            near_ties += assert_same_greedy(decoder, prompt, plain, spec)
            accepted += stats.accepted
            host_spec, host_stats = run(host, prompt, NEW_TOKENS, plan)
            if spec == host_spec and not plan.lookup:
                assert stats.round_log == host_stats.round_log, plan.name
    assert near_ties <= 1, f"{near_ties} near-tie divergences: too many to be rounding"
    assert accepted > 0


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt_neox", "gpt2"])
def test_device_round_through_static_steps(family, tiny_decoder, rounds_seen):
    """The draft steps and verifies of device rounds go through ``StaticSteps`` (CUDA graphs on a GPU,
    ``eager_capture`` here) with token ids fed from device tensors and positions computed on the device."""
    _, decoder = tiny_decoder(family)
    plain, _ = run(TorchBackend(decoder), [5, 17, 42, 9, 100, 3, 77, 12], 32)
    static = device_backend(decoder, capture=eager_capture)
    for plan in greedy_plans(decoder.config.num_layers)[::2]:
        spec, stats = run(static, [5, 17, 42, 9, 100, 3, 77, 12], 32, plan)
        assert stats.rounds > 0
        assert_same_greedy(decoder, [5, 17, 42, 9, 100, 3, 77, 12], plain, spec)
    assert static.static.captures > 0 and rounds_seen[0] > 0


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_device_round_with_draft_heads(family, tiny_decoder, tmp_path):
    """Trained-adapter and reduced-vocabulary draft heads: their logits come back over the whole
    vocabulary on the device (``TorchDraftHead.full_logits``), and output is unchanged."""
    from test_adapter import ADAPTER, REDUCED, head_plans, random_head

    from speccompile.runtime.artifact.draft_head_file import DraftHead

    _, decoder = tiny_decoder(family)
    config = decoder.config
    host, device = TorchBackend(decoder, round_on_device=False), device_backend(decoder)
    prompts = prompts_for(config.vocab_size)
    produced = np.concatenate([run(host, p, NEW_TOKENS)[0] for p in prompts])
    vocab = np.argsort(-np.bincount(produced, minlength=config.vocab_size), kind="stable")[:48]
    for relative, head in {
        ADAPTER: random_head(config, None, 1),
        REDUCED: random_head(config, vocab, 2),
        "draft_heads/vocab.safetensors": DraftHead(vocab=vocab),
    }.items():
        head.save(tmp_path / relative)
    accepted = 0
    for prompt in prompts:
        plain, _ = run(host, prompt, NEW_TOKENS)
        for plan in head_plans(config.num_layers, len(vocab)).values():
            spec, stats = run(device, prompt, NEW_TOKENS, plan, root=tmp_path)
            assert_same_greedy(decoder, prompt, plain, spec)
            accepted += stats.per_source.get("model", [0, 0])[1]
    assert accepted > 0


def test_eos_stops_like_plain(tiny_decoder):
    _, decoder = tiny_decoder("llama")
    host, device = TorchBackend(decoder, round_on_device=False), device_backend(decoder)
    prompt = [5, 9, 17, 33]
    eos = frozenset({run(host, prompt, 30)[0][12]})
    plain, stats = run(host, prompt, 30, eos=eos)
    assert stats.stop_reason == "eos"
    for plan in greedy_plans(decoder.config.num_layers)[:4]:
        spec, spec_stats = run(device, prompt, 30, plan, eos=eos)
        assert spec == plain and spec_stats.stop_reason == "eos"


# -- sampling ------------------------------------------------------------------------------------------
VOCAB = 12
PROMPT = [1, 5, 7, 3, 5, 7, 9, 5]
SAMPLES = 2000
ALPHA = 1e-3
SKIP = DraftPlan.of(
    name="skip", skip_attn=[1, 2], skip_mlp=[1, 2], sources={"model": {"max_draft": 2, "adaptive": False}}
)


@pytest.mark.parametrize(
    "plan,params",
    [
        (SKIP, SamplingParams(temperature=0.8, top_k=6, top_p=0.9)),
        (
            DraftPlan.of(
                name="skip-cut",
                skip_attn=[1, 2],
                skip_mlp=[1, 2],
                sources={"model": {"max_draft": 3, "threshold": 0.45, "adaptive": False}},
            ),
            SamplingParams(temperature=1.0),
        ),
        (
            DraftPlan.of(
                name="hybrid",
                lookup=["ngram"],
                lookup_max_draft=2,
                skip_attn=[1, 2],
                skip_mlp=[1, 2],
                sources={"ngram": {"min": 2, "max": 2}, "model": {"max_draft": 1, "adaptive": False}},
            ),
            SamplingParams(temperature=1.0),
        ),
    ],
    ids=["skip-t0.8-topk6-topp0.9", "skip-threshold-cut-t1.0", "hybrid-ngram-t1.0"],
)
def test_device_round_sampling_matches_target_distribution(small_vocab_llama, plan, params, rounds_seen):
    """Leviathan/Chen on the device: the 2nd and 3rd tokens follow the target's exact marginals; a
    negative control shows the test tells them from the draft's."""
    decoder = small_vocab_llama
    backend = device_backend(decoder)
    target2, target3 = exact_marginals(next_token_logits(decoder), params, PROMPT, VOCAB)
    draft2, draft3 = exact_marginals(next_token_logits(decoder, plan), params, PROMPT, VOCAB)
    spec2, spec3, drafted, accepted, sources = [], [], 0, 0, set()
    for seed in range(SAMPLES):
        tokens, stats = run(backend, PROMPT, 3, plan, params, seed=seed)
        spec2.append(tokens[1])
        spec3.append(tokens[2])
        drafted += stats.drafted
        accepted += stats.accepted
        sources |= {s for s, (d, _) in stats.per_source.items() if d}
    assert rounds_seen[0] >= SAMPLES
    assert 0 < accepted < drafted, "both the accept and the reject path must be exercised"
    assert sources == ({"model", "ngram"} if plan.lookup else {"model"})
    assert gof(spec2, target2) > ALPHA
    assert gof(spec3, target3) > ALPHA
    assert gof(spec3, draft3) < ALPHA  # negative control


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.9, top_k=7, top_p=0.5),
        SamplingParams(temperature=1e-300),
    ],
)
def test_device_probabilities_are_the_host_rule(params):
    """``sampling.probabilities`` on torch tensors (the device round) gives what it gives on numpy arrays (the host
    round), and both what the rule says, written here in plain numpy a row at a time (temperature, top-k, top-p,
    ties, any positive temperature)."""
    gen = np.random.default_rng(0)
    logits = gen.normal(0, 3, (5, 40)).astype(np.float32)
    logits[1, [3, 9, 20]] = logits[1].max() + 1.0  # an exact tie at the top
    logits[2, 5:] = -np.inf  # a reduced vocabulary's logits
    device = probabilities(torch.from_numpy(logits), params).numpy()
    host = probabilities(logits, params)
    np.testing.assert_allclose(device, host, atol=1e-12)
    np.testing.assert_allclose(host, np.stack([_reference_probabilities(row, params) for row in logits]), atol=1e-12)


def _reference_probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The plain sampler's distribution, one row, in numpy only: softmax(logits / T) taken after the shift by the
    maximum, top-k by partition, top-p over a stable descending order."""
    with np.errstate(over="ignore", divide="ignore", under="ignore"):
        e = np.exp((logits.astype(np.float64) - logits.max()) / params.temperature)
    probs = e / e.sum()
    if params.top_k and params.top_k < probs.shape[-1]:
        probs = np.where(probs >= np.partition(probs, -params.top_k)[-params.top_k], probs, 0.0)
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        mask = np.zeros_like(probs, dtype=bool)
        mask[order[cumulative - probs[order] < params.top_p * cumulative[-1]]] = True
        probs = np.where(mask, probs, 0.0)
    return probs / probs.sum()


def test_the_chain_rule_is_the_same_on_host_and_device():
    """``acceptance.accept_chain`` on numpy arrays and on torch tensors, from the same logits, drafts, draft
    distributions and uniforms: the same accepted count and next token (greedy, and sampling with model and lookup
    drafts), the one rule both rounds drive."""
    from speccompile.runtime.acceptance import accept_chain

    gen = np.random.default_rng(4)
    vocab, n = 30, 5
    for trial in range(200):
        logits = gen.normal(0, 2, (n + 1, vocab)).astype(np.float32)
        drafted = np.argmax(logits[:n] + gen.normal(0, 1.5, (n, vocab)), axis=-1).astype(np.int64)
        kept = np.arange(n) < gen.integers(0, n + 1)
        u = gen.random(n + 1)
        q = None if trial % 2 else probabilities(logits[:n] + gen.normal(0, 1, (n, vocab)), SamplingParams(1.0))
        for params in (SamplingParams(), SamplingParams(temperature=0.8, top_k=10)):
            host = accept_chain(logits, drafted, params, u=u, q=q, kept=kept)
            device = accept_chain(
                *(torch.from_numpy(a) for a in (logits, drafted)),
                params,
                u=torch.from_numpy(u),
                q=None if q is None else torch.from_numpy(q),
                kept=torch.from_numpy(kept),
            )
            assert (int(host[0]), int(host[1][0])) == (int(device[0]), int(device[1][0]))
            assert int(host[0]) <= kept.sum()
            if params.greedy:
                targets = logits.argmax(-1)
                run = 0
                while run < n and kept[run] and drafted[run] == targets[run]:
                    run += 1
                assert (int(host[0]), int(host[1][0])) == (run, targets[run])


# -- one host read per round -----------------------------------------------------------------------------
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero")


class HostReads:
    """Counts reads of tensor values by the host (what is a device sync on a GPU), on CPU tensors: the
    Tensor methods that return host values, and ``torch.equal`` / ``allclose`` / ``is_nonzero``. A read
    made inside another (``tolist`` calling ``__index__``) counts once."""

    def __init__(self, monkeypatch):
        self.count, self.depth = 0, 0
        for name in HOST_READS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(getattr(torch.Tensor, name)))
        for name in ("equal", "allclose", "is_nonzero"):
            monkeypatch.setattr(torch, name, self._wrap(getattr(torch, name)))

    def _wrap(self, original):
        def read(*args, **kwargs):
            self.count += self.depth == 0
            self.depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self.depth -= 1

        return read


def reads_per_round(monkeypatch, round_fn_owner, name) -> list[int]:
    """Wrap the round ``round_fn_owner.name`` so each call records the host reads it made."""
    per_round: list[int] = []
    reads = HostReads(monkeypatch)
    original = getattr(round_fn_owner, name)

    def counted(*args, **kwargs):
        before = reads.count
        out = original(*args, **kwargs)
        per_round.append(reads.count - before)
        return out

    monkeypatch.setattr(round_fn_owner, name, counted)
    return per_round


SYNC_PLANS = [
    DraftPlan.of(name="skip-cut", skip_attn=[1], skip_mlp=[2], sources={"model": {"max_draft": 4, "threshold": 0.3}}),
    DraftPlan.of(name="exit", exit_layer=2, sources={"model": {"max_draft": 4, "adaptive": False}}),
    DraftPlan.of(name="ngram", lookup=["ngram"], lookup_max_draft=4, sources={"ngram": {"min": 1, "max": 3}}),
    DraftPlan.of(
        name="hybrid",
        lookup=["ngram"],
        lookup_max_draft=4,
        exit_layer=2,
        sources={"ngram": {"min": 2, "max": 3}, "model": {"max_draft": 3, "adaptive": False}},
    ),
]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static-steps"])
@pytest.mark.parametrize(
    "params", [SamplingParams(), SamplingParams(temperature=0.9, top_k=20, top_p=0.9)], ids=["greedy", "sampling"]
)
def test_a_device_round_reads_the_device_once(tiny_decoder, monkeypatch, graphs, params):
    _, decoder = tiny_decoder("llama")
    backend = device_backend(decoder, capture=eager_capture if graphs else None)
    prompt = [5, 9, 17, 33, 5, 9, 17, 40]
    per_round = reads_per_round(monkeypatch, DeviceRound, "__call__")
    drafted = 0
    for plan in SYNC_PLANS:
        _, stats = run(backend, prompt, 24, plan, params, seed=1)
        drafted += stats.drafted
    assert len(per_round) > 10 and drafted > len(per_round)
    assert set(per_round) == {1}, f"host reads per device round: {per_round}"


def test_the_counter_sees_the_host_rounds_reads(tiny_decoder, monkeypatch):
    """Negative control: the host round reads logits back at every draft step and at the verify."""
    _, decoder = tiny_decoder("llama")
    backend = TorchBackend(decoder, round_on_device=False)
    per_round = reads_per_round(monkeypatch, BatchDecoder, "_round")
    _, stats = run(backend, [5, 9, 17, 33, 5, 9, 17, 40], 24, SYNC_PLANS[1])
    # every verify round, then perhaps one plain step (the last token, when one is left)
    assert stats.rounds > 0 and len(per_round) in (stats.rounds, stats.rounds + 1)
    assert all(reads >= drafted + 1 > 1 for reads, (drafted, _) in zip(per_round, stats.round_log))


# -- which round runs --------------------------------------------------------------------------------------
def test_the_device_round_is_chosen_on_cuda_or_when_asked(tiny_decoder, monkeypatch):
    _, decoder = tiny_decoder("llama")
    plan = SYNC_PLANS[0]
    monkeypatch.delenv("SPECCOMPILE_DEVICE_ROUND", raising=False)
    from speccompile.runtime.decoding.speculative import backend_drafter

    cpu = TorchBackend(decoder)
    assert cpu.round_on_device is None and cpu.device_round(backend_drafter(cpu, plan), 0) is None  # host round on CPU
    forced = TorchBackend(decoder, round_on_device=True)
    assert isinstance(forced.device_round(backend_drafter(forced, plan), 0), DeviceRound)
    assert forced.replica().round_on_device is True
    assert forced.device_round(Drafter(), 0) is None  # a drafter with neither a model part nor lookups: the host round
    monkeypatch.setenv("SPECCOMPILE_DEVICE_ROUND", "1")
    assert TorchBackend(decoder).round_on_device is True
    monkeypatch.setenv("SPECCOMPILE_DEVICE_ROUND", "0")
    assert TorchBackend(decoder).round_on_device is False


# -- captured rounds and the lookup gate -------------------------------------------------------------------
def warm_capture(fn):
    """What ``graphs.cuda_capture_with`` does before recording a graph: the round runs twice (the warm-up), with
    every side effect of a real round (commits into the token buffer, the next lookup); then calls replay it."""
    fn()
    fn()
    return fn


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_captured_rounds_undo_the_capture_warm_up(family, tiny_decoder):
    _, decoder = tiny_decoder(family)
    prompt = [5, 9, 17, 33, 5, 9, 17, 40, 5, 9]
    plain, _ = run(TorchBackend(decoder, round_on_device=False), prompt, 32)
    backend = device_backend(decoder, capture=warm_capture)
    for plan in SYNC_PLANS:
        spec, stats = run(backend, prompt, 32, plan)
        assert stats.rounds > 0
        assert_same_greedy(decoder, prompt, plain, spec)


class Oracle(LookupSource):
    """Proposes the known plain continuation, every token wrong (``wrong``) or right: a lookup whose acceptance
    the test sets."""

    name = "oracle"

    def __init__(self, prompt_length: int, plain: list[int], wrong: bool, vocab: int, k: int = 4):
        self.prompt_length, self.plain, self.wrong, self.vocab, self.k = prompt_length, plain, wrong, vocab, k

    def propose(self, ctx):
        done = len(ctx.history) - self.prompt_length
        tokens = self.plain[done : done + min(self.k, ctx.limit)]
        if self.wrong:
            tokens = [(t + 1) % self.vocab for t in tokens]
        return Draft(tokens=tokens, q=[None] * len(tokens), sources=[self.name] * len(tokens))


@pytest.mark.parametrize("wrong", [True, False], ids=["acceptance-0", "acceptance-1"])
def test_a_lookup_that_keeps_failing_stops_being_verified(tiny_decoder, wrong):
    _, decoder = tiny_decoder("llama")
    prompt = [5, 9, 17, 33]
    plain, _ = run(TorchBackend(decoder, round_on_device=False), prompt, 80)
    backend = device_backend(decoder)
    backend.reserve(len(prompt) + 80)
    oracle = Oracle(len(prompt), plain, wrong, decoder.config.vocab_size)
    stats = Stats()
    request = DecodeRequest(prompt, 80)
    spec = [t for new in decode(backend, request, oracle, stats) for t in new]
    assert spec == plain
    verified = sum(1 for drafted, _ in stats.round_log if drafted)
    if wrong:  # a few rounds until the running acceptance falls under the floor, then a probe every 16 rounds
        assert 0 < verified <= 20 < stats.rounds
    else:
        assert verified == stats.rounds and stats.accepted == stats.drafted
