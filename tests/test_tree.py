"""Token trees (runtime/tree.py) and lookahead decoding (runtime/drafting/lookahead.py) stay lossless.

- every node's logits equal the full model's for its own root path (torch and ONNX Runtime), and a
  deliberately wrong tree mask is caught by that check;
- n-gram tree plans give plain greedy output token for token on every canonical family and both backends;
- sampling over a tree keeps the full model's distribution (chi-square, with a negative control);
- the tuner's replay of a tree plan is the real loop's rounds.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from lossless import assert_same_greedy, exact_marginals, next_token_logits, run
from tiny_models import FAMILIES

from speccompile.runtime import tree
from speccompile.runtime.artifact.manifest import DraftPlan
from speccompile.runtime.backends.torch.backend import TorchBackend
from speccompile.runtime.drafting import options
from speccompile.runtime.drafting.ngram import NgramIndex
from speccompile.runtime.sampling import SamplingParams

NEW_TOKENS = 40
TREE = DraftPlan.of(
    name="tree",
    lookup=["ngram"],
    lookup_max_draft=4,
    lookup_branches=3,
    tree_nodes=8,
    sources={"ngram": {"min": 1, "max": 3}},
)
WIDE = DraftPlan.of(
    name="wide",
    lookup=["ngram"],
    lookup_max_draft=3,
    lookup_branches=4,
    tree_nodes=10,
    sources={"ngram": {"min": 1, "max": 2, "short": 1}},
)
LOOKAHEAD = DraftPlan.of(name="lookahead", lookup=["lookahead"], sources={"lookahead": {"window": 4, "ngram": 2}})
LOOKAHEAD_TREE = DraftPlan.of(
    name="lookahead-tree",
    lookup=["lookahead", "ngram"],
    lookup_max_draft=4,
    lookup_branches=3,
    tree_nodes=10,
    sources={"ngram": {"min": 1, "max": 3}, "lookahead": {"window": 3, "ngram": 3}},
)
LOOKAHEAD_BEHIND = DraftPlan.of(
    name="lookahead-behind",
    lookup=["ngram", "lookahead"],
    lookup_max_draft=4,
    sources={"ngram": {"min": 2, "max": 3}, "lookahead": {"window": 2}},
)
LOGITSPEC = DraftPlan.of(
    name="logitspec", lookup=["ngram", "logitspec"], lookup_max_draft=4, sources={"ngram": {"min": 2, "max": 3}}
)
LOGITSPEC_TREE = DraftPlan.of(
    name="logitspec-tree",
    lookup=["ngram", "logitspec"],
    lookup_max_draft=4,
    lookup_branches=3,
    tree_nodes=10,
    sources={"ngram": {"min": 1, "max": 3}, "logitspec": {"top_k": 3}},
)
RECYCLING = DraftPlan.of(
    name="recycling", lookup=["ngram", "recycling"], lookup_max_draft=4, sources={"ngram": {"min": 2, "max": 3}}
)
RECYCLING_TREE = DraftPlan.of(
    name="recycling-tree",
    lookup=["recycling", "ngram"],
    lookup_max_draft=4,
    lookup_branches=3,
    tree_nodes=10,
    sources={"ngram": {"min": 1, "max": 3}},
)
#        input
#        /    \
#      n0      n3
#     /  \       \
#   n1    n2      n4
PARENTS = [-1, 0, 0, -1, 3]


def test_tree_structure_helpers():
    assert tree.depths(PARENTS) == [1, 2, 2, 1, 2]
    rows = tree.attention_rows(PARENTS)
    assert rows.tolist()[3] == [True, True, False, True, False, False]  # n2: input, n0, itself
    assert rows.tolist()[5] == [True, False, False, False, True, True]  # n4: input, n3, itself
    assert tree.follow([7, 8, 9, 5, 6], PARENTS, [5, 6, 1]) == [3, 4]
    assert tree.follow([7, 8, 9, 5, 6], PARENTS, [7, 9]) == [0, 2]
    assert tree.is_chain([-1, 0, 1]) and not tree.is_chain(PARENTS)
    with pytest.raises(ValueError):
        tree.depths([-1, 2, 0])
    trie = tree.TokenTrie(5)
    assert trie.add([1, 2, 3], "ngram") == 3
    assert trie.add([1, 2, 4], "ngram") == 1  # shares 1, 2
    assert trie.add([5, 6], "ngram") == 1  # budget: 5 nodes
    assert trie.tokens == [1, 2, 3, 4, 5] and trie.parents == [-1, 0, 1, 1, -1]


def test_ngram_index_lists_several_continuations():
    index = NgramIndex(1, 3)
    index.sync([1, 2, 3, 9, 1, 2, 4, 8, 5, 2, 7, 1, 2])
    found = index.continuations([1, 2], limit=2, most=4)
    assert found[0] == index.continuation([1, 2], 2) == [4, 8]  # the chain's draft comes first
    assert found[:2] == [[4, 8], [3, 9]]  # "1 2": most recent, then earlier
    assert [7, 1] in found  # then the 1-gram "2"'s other continuations
    assert len(found) == len({tuple(f) for f in found}) <= 4


def path_logits(decoder, prompt, tokens, parents):
    """Reference logits of every call row: the full model on the prompt plus each node's root path."""
    rows = []
    for r in range(len(tokens)):
        path, node = [], r - 1
        while node >= 0:
            path.insert(0, tokens[node + 1])
            node = parents[node]
        with torch.inference_mode():
            rows.append(decoder(torch.tensor([prompt + [tokens[0]] + path]))[0, -1].float().numpy())
    return np.stack(rows)


def tree_call(backend, prompt, tokens, parents):
    backend.reserve(len(prompt) + len(tokens) + 4)
    backend.forward(prompt, 0)
    return backend.forward_tree(tokens, parents, len(prompt))


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_rows_are_the_full_models_logits_for_their_paths(family, tiny_decoder):
    _, decoder = tiny_decoder(family)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, decoder.config.vocab_size, (30,), generator=gen).tolist()  # crosses mistral's window
    tokens = torch.randint(3, decoder.config.vocab_size, (len(PARENTS) + 1,), generator=gen).tolist()
    got = tree_call(TorchBackend(decoder), prompt, tokens, PARENTS)
    np.testing.assert_allclose(got, path_logits(decoder, prompt, tokens, PARENTS), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_graphed_tree_rows_are_the_full_models_logits_for_their_paths(family, tiny_decoder):
    """The fixed-shape tree verify that CUDA graphs replay (``Positions.fixed_tree``: slots as a tensor,
    the mask over the whole static cache), run here through ``eager_capture``: the same rows as the eager
    tree call, twice at other positions through the same captured step."""
    from speccompile.runtime.backends.torch.graphs import eager_capture

    _, decoder = tiny_decoder(family)
    gen = torch.Generator().manual_seed(7)
    backend = TorchBackend(decoder, capture=eager_capture)
    for length in (30, 26):  # the second call replays the step captured by the first
        prompt = torch.randint(3, decoder.config.vocab_size, (length,), generator=gen).tolist()
        tokens = torch.randint(3, decoder.config.vocab_size, (len(PARENTS) + 1,), generator=gen).tolist()
        got = tree_call(backend, prompt, tokens, PARENTS)
        np.testing.assert_allclose(got, path_logits(decoder, prompt, tokens, PARENTS), atol=2e-4, rtol=1e-4)
    assert ("tree", len(PARENTS) + 1) in backend.static.graphs


def test_tree_plans_greedy_lossless_on_graphed_steps(tiny_decoder):
    """Tree rounds verified by the fixed-shape steps CUDA graphs replay decode what plain decoding does."""
    from speccompile.runtime.backends.torch.graphs import eager_capture

    _, decoder = tiny_decoder("llama")
    backend = TorchBackend(decoder, capture=eager_capture)
    accepted = check_tree_lossless(decoder, backend, [TREE, WIDE, RECYCLING_TREE])
    assert sum(accepted.values()) > 0 and any(key[0] == "tree" for key in backend.static.graphs)


@pytest.fixture(scope="module")
def onnx_export(tiny_decoder, tmp_path_factory):
    """(family, variant) -> (decoder, ONNX backend over its exported graphs, whether they are the fused
    variant); variant "fused", "fused-padded" (a padding query row, as quantized exports have) or "standard"."""
    from speccompile.exporters.onnx_export import export_onnx
    from speccompile.runtime.backends.onnx import OnnxBackend

    cache = {}

    def get(family: str, variant: str = "fused"):
        if (family, variant) not in cache:
            _, decoder = tiny_decoder(family)
            root = tmp_path_factory.mktemp("tree") / f"{family}-{variant}"
            record = export_onnx(
                decoder, {}, root / "onnx", variant=variant.split("-")[0], pad_rows=variant.endswith("padded")
            )
            fused = record["graphs"]["verify"].get("variant") == "fused"
            cache[family, variant] = decoder, OnnxBackend(root, record, decoder.config, threads=1), fused
        return cache[family, variant]

    return get


@pytest.mark.parametrize("family", FAMILIES + ("llama/fused-padded", "gpt2/fused-padded"))
def test_onnx_tree_rows_are_the_full_models_logits_for_their_paths(family, onnx_export):
    decoder, backend, fused = onnx_export(*family.split("/"))
    assert fused and backend.tree_unsupported() is None
    windows = [w for w in map(decoder.config.window_of, range(decoder.config.num_layers)) if w is not None]
    length = 30 if not windows else min(windows) - len(PARENTS) - 1  # ORT verifies trees inside a sliding window
    assert backend.tree_fits(length, len(PARENTS) + 1) and (
        not windows or not backend.tree_fits(length + 1, len(PARENTS) + 1)
    )
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, decoder.config.vocab_size, (length,), generator=gen).tolist()
    tokens = torch.randint(3, decoder.config.vocab_size, (len(PARENTS) + 1,), generator=gen).tolist()
    got = tree_call(backend, prompt, tokens, PARENTS)
    np.testing.assert_allclose(got, path_logits(decoder, prompt, tokens, PARENTS), atol=2e-4, rtol=1e-4)
    # the chain path through the same graph (zero bias) is unchanged: one step after the prompt
    backend.forward(prompt, 0)
    np.testing.assert_allclose(
        backend.forward(tokens[:1], len(prompt))[0],
        path_logits(decoder, prompt, tokens[:1], [])[0],
        atol=2e-4,
        rtol=1e-4,
    )


def test_a_wrong_tree_mask_is_caught(tiny_decoder, monkeypatch):
    """The check above fails when the tree mask lets a node see its sibling's branch (a causal mask)."""
    _, decoder = tiny_decoder("llama")
    prompt, tokens = list(range(3, 20)), [21, 22, 23, 24, 25, 26]
    reference = path_logits(decoder, prompt, tokens, PARENTS)
    monkeypatch.setattr(tree, "attention_rows", lambda parents: np.tril(np.ones((len(parents) + 1,) * 2, bool)))
    wrong = tree_call(TorchBackend(decoder), prompt, tokens, PARENTS)
    assert not np.allclose(wrong, reference, atol=2e-4, rtol=1e-4)
    assert np.allclose(wrong[:3], reference[:3], atol=2e-4, rtol=1e-4)  # rows whose ancestors are all before them


def repetitive_prompts(decoder, backend, count: int = 4) -> list[list[int]]:
    """Prompts in which the model's own continuation recurs after several different n-gram contexts, so
    trees branch and some branches are accepted."""
    gen = torch.Generator().manual_seed(9)
    vocab = decoder.config.vocab_size
    prompts = []
    for p in range(count):
        seed = torch.randint(3, vocab, (5 + p,), generator=gen).tolist()
        own = run(backend, seed, 10)[0]
        noise = torch.randint(3, vocab, (6,), generator=gen).tolist()
        prompts.append(seed + own[:4] + noise + seed[-2:] + noise[:3] + seed + own[:2] + noise[2:] + seed)
    return prompts


def check_tree_lossless(decoder, backend, plans, trees_expected: bool | None = True) -> dict[str, int]:
    """Every plan's greedy output equals plain; ``trees_expected``: whether rounds verified trees (None: either)."""
    near_ties, accepted, trees = 0, {}, 0
    for prompt in repetitive_prompts(decoder, TorchBackend(decoder)):
        plain, _ = run(backend, prompt, NEW_TOKENS)
        for plan in plans:
            with warnings.catch_warnings():
                if trees_expected is False:
                    warnings.simplefilter("ignore")  # "drafts chains": said once per decode
                spec, stats = run(backend, prompt, NEW_TOKENS, plan)
            near_ties += assert_same_greedy(decoder, prompt, plain, spec)
            accepted[plan.name] = accepted.get(plan.name, 0) + stats.accepted
            trees += stats.tree_rounds
    assert near_ties <= 1, f"{near_ties} near-tie divergences: too many to be rounding"
    if trees_expected is not None:
        assert (trees > 0) == trees_expected, (
            "no round verified a tree" if trees_expected else "a tree where none can run"
        )
    return accepted


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_plans_greedy_lossless_torch(family, tiny_decoder):
    _, decoder = tiny_decoder(family)
    accepted = check_tree_lossless(
        decoder,
        TorchBackend(decoder),
        [TREE, WIDE, LOOKAHEAD, LOOKAHEAD_TREE, LOOKAHEAD_BEHIND, LOGITSPEC, LOGITSPEC_TREE, RECYCLING, RECYCLING_TREE],
    )
    assert sum(accepted.values()) > 0


@pytest.mark.parametrize("family", FAMILIES + ("llama/fused-padded",))
def test_tree_plans_greedy_lossless_onnx(family, onnx_export):
    decoder, backend, _ = onnx_export(*family.split("/"))
    # a windowed model verifies trees inside its window and first branches past it (these prompts start past
    # mistral's window of 24: first branches only; the test above verifies a tree inside it)
    windowed = any(map(decoder.config.window_of, range(decoder.config.num_layers)))
    accepted = check_tree_lossless(
        decoder,
        backend,
        [TREE, WIDE, LOOKAHEAD, LOOKAHEAD_TREE, LOOKAHEAD_BEHIND, LOGITSPEC, LOGITSPEC_TREE, RECYCLING, RECYCLING_TREE],
        trees_expected=None if windowed else True,
    )
    assert sum(accepted.values()) > 0


def test_graphs_without_tree_inputs_draft_chains(onnx_export):
    """The portable (standard) graphs take no tree mask: a tree plan runs its first branch, losslessly."""
    decoder, backend, fused = onnx_export("llama", "standard")
    assert not fused and "tree mask" in backend.tree_unsupported()
    prompt = repetitive_prompts(decoder, TorchBackend(decoder))[0]
    plain, _ = run(backend, prompt, NEW_TOKENS)
    with pytest.warns(UserWarning, match="drafts chains"):
        spec, stats = run(backend, prompt, NEW_TOKENS, TREE)
    assert spec == plain and stats.tree_rounds == 0 and stats.rounds > 0


VOCAB = 12
# Every token is followed by three different ones (x + 1, x + 5, x + 7 mod 12): whatever is sampled first, the
# next round's 1-gram lookup finds three continuations, a tree.
PROMPT = (
    [x % VOCAB for x in range(VOCAB)] + [5 * x % VOCAB for x in range(VOCAB)] + [7 * x % VOCAB for x in range(VOCAB)]
)
SAMPLES = 2000
ALPHA = 1e-3


def sampled(backend, plan, params):
    second, third, accepted, trees = [], [], 0, 0
    for seed in range(SAMPLES):
        tokens, stats = run(backend, PROMPT, 8, plan, params, seed=seed)  # 8: room for a 6-node tree
        second.append(tokens[1])
        third.append(tokens[2])
        accepted += stats.accepted
        trees += stats.tree_rounds > 0 and stats.round_log[0][0] > 2
    return second, third, accepted, trees


def test_tree_sampling_matches_target_distribution(small_vocab_llama, monkeypatch):
    from test_drafters import chi_square_pvalue

    decoder = small_vocab_llama
    backend = TorchBackend(decoder)
    params = SamplingParams(temperature=1.0)
    plan = DraftPlan.of(
        name="tree",
        lookup=["ngram"],
        lookup_max_draft=2,
        lookup_branches=3,
        tree_nodes=6,
        sources={"ngram": {"min": 1, "max": 2}},
    )
    target2, target3 = exact_marginals(next_token_logits(decoder), params, PROMPT, VOCAB)
    second, third, accepted, trees = sampled(backend, plan, params)
    assert trees > SAMPLES // 2 and 0 < accepted < 6 * SAMPLES
    assert chi_square_pvalue(second, target2) > ALPHA
    assert chi_square_pvalue(third, target3) > ALPHA

    # Negative control: accepting a rejected branch's sibling without renormalising the residual biases
    # the output, and the same test sees it.
    def biased(tokens, parents, logits, params, rng):
        from speccompile.runtime.sampling import probabilities, sample

        p = probabilities(logits[0], params)
        for c in tree.children_of(parents)[0]:
            if rng.random() < p[tokens[c]]:
                return [c], sample(probabilities(logits[c + 1], params), rng)
        return [], sample(p, rng)

    import speccompile.runtime.acceptance as acceptance

    monkeypatch.setattr(acceptance, "sample_path", biased)
    second, third, _, _ = sampled(backend, plan, params)
    assert min(chi_square_pvalue(second, target2), chi_square_pvalue(third, target3)) < ALPHA


def test_lookahead_window_is_a_jacobi_step_and_fills_the_pool(tiny_decoder):
    """After a round, the window holds the verifier's outputs past the committed tokens (one Jacobi step) and
    the pool the n-grams the rows produced; the window's guesses are accepted where they are right."""
    from speccompile.runtime.drafting.drafter import RoundContext
    from speccompile.runtime.drafting.lookahead import LookaheadDrafter

    _, decoder = tiny_decoder("llama")
    backend = TorchBackend(decoder)
    prompt = list(range(3, 15))
    plain, _ = run(backend, prompt, 12)
    drafter = LookaheadDrafter(window=4, ngram=2)
    drafter.start(prompt)
    drafter.window = plain[1:3] + [5, 6]  # two right guesses, then two wrong ones
    history = prompt + plain[:1]
    backend.reserve(64)
    backend.forward(prompt, 0)
    draft = drafter.propose(RoundContext(history, len(prompt), 8, SamplingParams(), None))
    assert draft.tokens == plain[1:3] + [5, 6]
    logits = backend.forward(history[-1:] + draft.tokens, len(prompt))
    targets = logits.argmax(-1).tolist()
    assert targets[:3] == plain[1:4]  # rows 0..2 are the true next tokens
    committed = plain[1:4]  # the two right guesses and the verifier's token
    drafter.observe(draft, logits, committed)
    assert drafter.window[:2] == targets[3:5]  # the outputs after the committed ones: the next guesses
    assert drafter.pool[6][0] == (6, targets[4])  # the n-gram the last row made: its guess, then its output


def test_lookahead_pools_the_n_gram_of_every_row():
    """Each verify row is a Jacobi step for its own input: the input token's row and a pooled branch's rows add
    their n-grams to the pool, not only the window's rows."""
    from speccompile.runtime.drafting.drafter import Draft, RoundContext
    from speccompile.runtime.drafting.lookahead import LookaheadDrafter

    drafter = LookaheadDrafter(window=2, ngram=2, branches=2)
    history = [1, 2, 3]
    drafter.start(history)
    drafter.window, drafter.pool = [7, 8], {3: [(3, 9)]}
    assert drafter.continuations(history, limit=4, most=2) == [[9], [7, 8]]  # the pooled branch, then the window
    draft = Draft(tokens=[9, 7, 8], q=[None] * 3, sources=["lookahead"] * 3, parents=[-1, -1, 1])
    logits = np.zeros((4, 20), dtype=np.float32)
    for row, out in enumerate([11, 12, 13, 14]):  # the model's token after: 3, 9, 7, 8
        logits[row, out] = 1.0
    drafter.observe(draft, logits, [11], RoundContext(history, len(history) - 1, 8, SamplingParams(), None))
    assert (3, 11) in drafter.pool[3] and drafter.pool[9] == [(9, 12)]  # rows outside the window
    assert drafter.pool[7] == [(7, 13)] and drafter.pool[8] == [(8, 14)]  # the window's rows


@pytest.mark.parametrize(
    "plan",
    [
        DraftPlan.of(
            name="la",
            lookup=["lookahead", "ngram"],
            lookup_max_draft=2,
            lookup_branches=3,
            tree_nodes=6,
            sources={"ngram": {"min": 1, "max": 2}, "lookahead": {"window": 2}},
        ),
        DraftPlan.of(
            name="ls",
            lookup=["logitspec", "ngram"],
            lookup_max_draft=2,
            lookup_branches=3,
            tree_nodes=6,
            sources={"ngram": {"min": 1, "max": 2}, "logitspec": {"top_k": 3}},
        ),
        DraftPlan.of(
            name="rc",
            lookup=["recycling", "ngram"],
            lookup_max_draft=2,
            lookup_branches=3,
            tree_nodes=6,
            sources={"ngram": {"min": 1, "max": 2}},
        ),
    ],
    ids=["lookahead", "logitspec", "recycling"],
)
def test_output_reading_sources_sample_the_target_distribution(small_vocab_llama, plan):
    """Lookahead's window, LogitSpec's guesses and the recycled tokens come from earlier verifier outputs, never from this round's
    random draws, so the tree rejection keeps the full model's distribution."""
    from test_drafters import chi_square_pvalue

    backend = TorchBackend(small_vocab_llama)
    params = SamplingParams(temperature=1.0)
    target2, target3 = exact_marginals(next_token_logits(small_vocab_llama), params, PROMPT, VOCAB)
    second, third, accepted, trees = sampled(backend, plan, params)
    assert trees > 0 and accepted > 0
    assert chi_square_pvalue(second, target2) > ALPHA
    assert chi_square_pvalue(third, target3) > ALPHA


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_replay_of_tree_plans_matches_the_real_loop(family, tiny_decoder):
    from speccompile.passes.acceptance_estimate import reference_pass
    from speccompile.passes.replay import replay

    _, decoder = tiny_decoder(family)
    backend = TorchBackend(decoder)
    for plan in (TREE, WIDE):
        real, refs = [], []
        for prompt in repetitive_prompts(decoder, backend):
            plain, _ = run(backend, prompt, NEW_TOKENS)
            spec, stats = run(backend, prompt, NEW_TOKENS, plan)
            assert spec == plain
            real += [(d, a, label) for (d, a), label in zip(stats.round_log, stats.round_sources)]
            refs.append(reference_pass(decoder, prompt + plain, len(prompt)))
        assert [(r.drafted, r.accepted, r.label) for r in replay(plan, refs)] == real


@pytest.mark.parametrize("backend", ["torch", "onnx"])
def test_lookahead_build_tunes_by_running_and_stays_lossless(backend, tiny_model_dir, tmp_path):
    """``--method lookahead``: the plan is tuned by running it on the backend (its figures are in the manifest,
    next to the lookup tuner's chain-versus-tree pricing on backends that verify trees), and the artifact's
    lookahead plan decodes exactly what plain decoding does."""
    from speccompile.build import BuildOptions, build
    from speccompile.runtime.model import load

    out = build(
        BuildOptions(
            model=str(tiny_model_dir("llama")),
            out=tmp_path / "la",
            method="lookahead",
            backends=(backend,),
            max_draft=4,
            calibration_tokens=16,
            confirm_prompts=2,
            confirm_tokens=16,
            show_progress=False,
        ),
        log=lambda message: None,
    )
    model = load(out)
    plan = model.manifest.plans["lookahead"]
    assert "lookahead" in plan.lookup and plan.measured["method"] == "lookahead"
    assert plan.measured["expected_speedup"] > 0 and plan.measured["drafted_per_round"] > 0
    if backend == "onnx":
        assert set(model.manifest.plans["lookup"].measured["trees"]) == {"chain", "tree"}
    recycling = model.manifest.plans["recycling"]  # Token Recycling, tuned by running it too
    assert "recycling" in recycling.lookup and recycling.measured["method"] == "recycling"
    prompt = model.tokenizer.encode("def read_lines(path):")
    plain = model.generate(prompt, max_new_tokens=24, speculate=False).token_ids
    for name in ("lookahead", "recycling"):
        assert model.generate(prompt, max_new_tokens=24, plan=name).token_ids == plain


def test_no_trees_builds_chains_only(tiny_model_dir, tmp_path):
    """``--no-trees``: the tuner prices no token tree and keeps no tree plan, on a backend that verifies trees (the
    chain-only build a tree build is compared with); the manifest records the choice."""
    from speccompile.build import BuildOptions, build
    from speccompile.runtime.model import load

    out = build(
        BuildOptions(
            model=str(tiny_model_dir("llama")),
            out=tmp_path / "chains",
            method="lookahead",
            backends=("torch",),
            max_draft=4,
            calibration_tokens=16,
            confirm_prompts=2,
            confirm_tokens=16,
            show_progress=False,
            trees=False,
        ),
        log=lambda message: None,
    )
    manifest = load(out).manifest
    assert manifest.tuning["token_trees"] is False
    assert "trees" not in manifest.plans["lookup"].measured
    for plan in manifest.plans.values():
        assert plan.lookup_branches == 1 and plan.tree_nodes == 0 and options(plan, "model").branches == 1, plan.name


def test_token_recycling_keeps_every_rows_top_tokens_and_drafts_them(tiny_decoder):
    """After a round, each verify row's best tokens are its input token's successors (rejected rows too), best
    first; the next round drafts the input token's best successors, each followed greedily through the table."""
    from speccompile.runtime.drafting.drafter import Draft, RoundContext
    from speccompile.runtime.drafting.recycling import RECYCLED, RecyclingDrafter

    _, decoder = tiny_decoder("llama")
    backend = TorchBackend(decoder)
    prompt = [3, 4, 5, 3, 6]
    drafter = RecyclingDrafter()
    drafter.start(prompt)
    assert drafter.table[3] == [6, 4] and drafter.table[5] == [3]  # the prompt's successions, latest first
    assert drafter.continuations(prompt[:4], limit=3, most=2) == [[6], [4, 5, 3]]  # after 3: 6 (no successor), 4 5 3
    assert drafter.continuations(prompt, limit=3, most=2) == []  # nothing has followed 6 yet
    backend.reserve(64)
    backend.forward(prompt[:-1], 0)
    draft = Draft(tokens=[9, 10], q=[None, None], sources=["recycling"] * 2)  # two wrong guesses
    logits = backend.forward(prompt[-1:] + draft.tokens, len(prompt) - 1)
    ctx = RoundContext(prompt, len(prompt) - 1, 8, SamplingParams(), None)
    drafter.observe(draft, logits, [int(logits[0].argmax())], ctx)
    for token, row in zip([6, 9, 10], logits):
        best = np.argsort(-row, kind="stable")[:RECYCLED].tolist()
        assert drafter.table[token] == best
    first = drafter.table[6][:2]
    assert [c[0] for c in drafter.continuations(prompt, limit=4, most=2)] == first


def test_a_tree_priced_above_its_chain_races_the_chain_in_confirmation(tiny_model_dir, tmp_path, monkeypatch):
    """When the tuner prices a token tree above the best chain, the chain stays beside it (``lookup-chain``), both
    are confirmed by timed runs, and the default is the one that ran faster (the tree where the turns could not
    tell them apart: a tie between plans priced alike goes to the higher price): a tree's price leans on a verify-cost
    curve timed in a few calls (on refcoder with torch the tree priced highest ran 0.98-0.99x of its chain). Here
    the tree is over-priced on purpose; both plans still decode exactly what plain decoding does."""
    import dataclasses

    from speccompile.build import BuildOptions, build
    from speccompile.passes import lookup_autotune
    from speccompile.runtime.model import load

    real_score = lookup_autotune.score_lookup

    def tree_priced_high(context, plan, profile=None):
        estimate, rounds = real_score(context, plan, profile)
        if plan.lookup_branches > 1:
            estimate = dataclasses.replace(estimate, expected_speedup=estimate.expected_speedup * 3)
        return estimate, rounds

    monkeypatch.setattr(lookup_autotune, "score_lookup", tree_priced_high)
    out = build(
        BuildOptions(
            model=str(tiny_model_dir("llama")),
            out=tmp_path / "race",
            method="lookup",
            backends=("torch",),
            max_draft=4,
            calibration_tokens=16,
            confirm_prompts=2,
            confirm_tokens=16,
            show_progress=False,
        ),
        log=lambda message: None,
    )
    model = load(out)
    tree, chain = model.manifest.plans["lookup"], model.manifest.plans[lookup_autotune.CHAIN_PLAN]
    assert tree.lookup_branches > 1 and tree.tree_nodes > 0
    assert chain.lookup_branches == 1 and chain.tree_nodes == 0 and chain.lookup == tree.lookup
    assert tree.measured["confirmed_speedup"] and chain.measured["confirmed_speedup"]
    faster, slower = sorted((tree, chain), key=lambda plan: -plan.measured["confirmed_speedup"])
    versus = slower.measured["confirmed_vs_best"]
    assert versus["plan"] == faster.name
    tied = versus["interval"][1] is None or versus["interval"][1] >= 1.0  # the turns could not tell them apart
    expected = tree if tied and tree.measured["confirmed_speedup"] > 1.0 else faster  # a tie: the higher price
    if expected.measured["confirmed_speedup"] > 1.0:
        assert model.manifest.default_plan == expected.name
    prompt = model.tokenizer.encode("def read_lines(path):")
    plain = model.generate(prompt, max_new_tokens=24, speculate=False).token_ids
    for name in ("lookup", lookup_autotune.CHAIN_PLAN):
        assert model.generate(prompt, max_new_tokens=24, plan=name).token_ids == plain
