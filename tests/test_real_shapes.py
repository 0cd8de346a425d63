"""Lossless at a real model's shapes (docs/design.md section 6): kernels pick different paths for one
row than for several, and the tiny test models hide it.

A random-weight Llama with SmolLM2-135M's sizes (hidden 576, 9 query / 3 KV heads of 64, MLP 1536,
vocabulary 49152, tied head, quantization blocks of 32) and three blocks, built from a config. For each
place where one multi-token call stands in for single steps:

- ONNX Runtime int8 / int4 (MatMulNBits with int8 activations), fused fp32 (GroupQueryAttention, packed
  products) and standard graphs: one k-token call and k one-token steps give the same logits within half
  the near-tie threshold (quantized: exactly, since int8 activations turn any difference into a jump of
  a quantization step), and greedy speculative == plain over several prompts and plans;
- the torch CPU backend with every product form ``runtime/backends/torch/cpu_linear.py`` may choose per row count
  (``F.linear``, ``W @ x^T`` or a packed product (MKL's or oneDNN's) everywhere, and mixes): the same logit agreement
  (fp32), and speculative == plain with a mixed choice;
- precision self-drafts (int8 / int4 products drafting, fp32 verifying) on both backends, and token trees.

Run: python -m pytest -q tests/test_real_shapes.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")

from lossless import NEAR_TIE, assert_speculative_is_plain, run  # noqa: E402
from onnx_helpers import open_onnx  # noqa: E402
from test_onnx_fused import make_artifact  # noqa: E402
from tiny_models import make_model  # noqa: E402

from speccompile.runtime.artifact.manifest import DraftPlan, read_manifest  # noqa: E402
from speccompile.runtime.backends.torch.backend import TorchBackend  # noqa: E402
from speccompile.runtime.backends.torch.cpu_linear import MAX_ROWS  # noqa: E402
from speccompile.runtime.drafting import read_plans  # noqa: E402

SMOLLM2 = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
    initializer_range=0.04,
)
LAYERS = 3
ROUNDING = NEAR_TIE / 2  # a divergence needs a top-2 gap below twice the rounding: keep that under the near-tie rule
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def real_shaped(tmp_path_factory):
    """(folder, function -> a fresh canonical decoder) of the three-block SmolLM2-shaped model."""
    from transformers import AutoModelForCausalLM

    from speccompile.convert import arch_config, canonical_weights
    from speccompile.runtime.backends.torch.decoder import build_decoder

    folder = make_model(
        "llama", tmp_path_factory.mktemp("real_shapes") / "smollm2-shaped", seed=7, num_hidden_layers=LAYERS, **SMOLLM2
    )
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    config = arch_config(hf)
    weights = canonical_weights(hf, config)
    return folder, lambda: build_decoder(config, {k: v.clone() for k, v in weights.items()})


def plans() -> dict[str, DraftPlan]:
    out = [
        DraftPlan.of(name="skip", skip_attn=[1], skip_mlp=[1], sources={"model": {"max_draft": 4, "threshold": 0.0}}),
        DraftPlan.of(name="exit", exit_layer=1, sources={"model": {"max_draft": 3, "threshold": 0.0}}),
        DraftPlan.of(name="exit-last", exit_layer=LAYERS - 1, sources={"model": {"max_draft": 6, "adaptive": False}}),
        DraftPlan.of(name="lookup", lookup=["ngram"], lookup_max_draft=8, sources={"ngram": {"min": 1, "max": 3}}),
    ]
    return {p.name: p for p in out}


def prompts(vocab: int) -> list[list[int]]:
    """Two random prompts, the second repeating itself so that lookup drafts find matches."""
    gen = torch.Generator().manual_seed(11)
    first, second = (torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 14))
    return [first, second + second + second[:4]]


def verify_vs_steps(backend, tokens: list[int]) -> float:
    """Largest |logit| difference between one k-token call and k one-token steps over the same positions, for
    k of 2, 4 and 8 (the row counts a verify has) at a few positions."""
    worst = 0.0
    for k, end in ((2, len(tokens) - 6), (4, len(tokens) - 3), (8, len(tokens))):
        backend.reserve(len(tokens) + 1)
        backend.forward(tokens[: end - k], 0)
        together = np.asarray(backend.forward(tokens[end - k : end], end - k))
        apart = np.stack(
            [np.asarray(backend.forward([t], end - k + j))[-1] for j, t in enumerate(tokens[end - k : end])]
        )
        worst = max(worst, float(np.abs(together - apart).max()))
    return worst


@pytest.fixture(scope="module")
def onnx_artifacts(real_shaped, tmp_path_factory):
    """options name -> (artifact root, OnnxBackend with ONNX Runtime's default threads), built once each."""
    folder, decoder = real_shaped[0], real_shaped[1]()
    base = tmp_path_factory.mktemp("real_shapes_onnx")
    options = {
        "int8": {"variant": "fused", "quantize": "int8"},
        "int4": {"variant": "fused", "quantize": "int4"},
        "fused": {"variant": "fused"},
        "standard": {"variant": "standard"},
        "precision": {"variant": "fused"},
    }
    cache = {}

    def get(name: str):
        if name not in cache:
            plan_map = {**plans(), **precision_plans("onnx")} if name == "precision" else plans()
            root = make_artifact(decoder, plan_map, base / name, folder / "tokenizer.json", **options[name])
            cache[name] = root, open_onnx(root)
        return cache[name]

    return get


@pytest.mark.parametrize("name", ["int8", "int4", "fused", "standard"])
def test_onnx_verify_is_the_step_it_replaces(name, onnx_artifacts):
    """A k-token call and k steps agree (quantized: to the bit), and, for the fused graphs the runtime runs on
    CPU, greedy speculative == plain (quantized: every plan kind; fp32, whose rounding is continuous: the
    early exit; the standard graphs': tests/test_onnx.py's)."""
    root, backend = onnx_artifacts(name)
    record = read_manifest(root).backends["onnx"]
    assert (record["quantization"] or {}).get("scheme") == (name if name.startswith("int") else None)
    if record["quantization"]:  # products padded to two rows exactly where this CPU's one-row kernel differs
        from speccompile.exporters.onnx_quant import Quantizer

        quantizer = Quantizer(name, record["quantization"]["block_size"], record["quantization"]["accuracy_level"])
        differs = quantizer.one_row_path_differs(backend.config.hidden_size, backend.config.intermediate_size)
        assert record["padded_product_rows"] == differs
    rounding = verify_vs_steps(backend.replica(), prompts(backend.config.vocab_size)[1])
    limit = 0.0 if record["quantization"] else ROUNDING
    assert rounding <= limit, (
        f"{name}: a k-token call and k steps give logits {rounding:.2e} apart (allowed {limit:.0e})"
    )
    if name != "standard":  # fp32 fused: the early exit's split graphs (the layer-skip path is the verify alone)
        plan_map = plans() if record["quantization"] else {"exit": plans()["exit"]}
        assert_speculative_is_plain(
            backend, backend.replica(), prompts(backend.config.vocab_size), plan_map, NEW_TOKENS, root
        )


EVERY = frozenset(range(1, MAX_ROWS + 1))
# form -> (row counts given W @ x^T, row counts given the packed product); the rest run F.linear
FORMS = {
    "F.linear": (frozenset(), frozenset()),
    "W @ x^T": (EVERY, frozenset()),
    "step F.linear, verify W @ x^T": (EVERY - {1}, frozenset()),
    "step W @ x^T, verify F.linear": (frozenset({1}), frozenset()),
    "packed": (frozenset(), EVERY),
    "step F.linear, verify packed": (frozenset(), EVERY - {1, 2, 3}),
    "step packed, verify F.linear": (frozenset(), frozenset({1})),
}  # the last one also decodes (see below)


def test_torch_cpu_product_forms(real_shaped, monkeypatch):
    """Every choice runtime/backends/torch/cpu_linear.py can make of the product form per row count keeps a k-token call
    within the rounding bound of k steps, and with the most mixed choice (a step runs the packed product, a
    verify F.linear) greedy speculative == plain (fp32: only near-ties may differ)."""
    from speccompile.runtime.backends.torch import cpu_linear

    monkeypatch.setenv("SPECCOMPILE_CPU_LINEAR", "auto")
    for form, (streaming, packed) in FORMS.items():
        if packed and cpu_linear.packing_missing():
            continue
        monkeypatch.setattr(
            cpu_linear, "choose_forms", lambda weights, packs=None, chosen=(streaming - packed, packed): chosen
        )
        decoder = real_shaped[1]()  # fresh: the choice is made once per model
        backend = TorchBackend(decoder)
        assert (decoder._streaming_rows, decoder._packed_rows) == (streaming - packed, packed)
        assert (decoder._packed_bytes > 0) == bool(packed)
        rounding = verify_vs_steps(backend, prompts(decoder.config.vocab_size)[1])
        assert rounding < ROUNDING, f"torch {form}: a k-token call and k steps give logits {rounding:.2e} apart"
    assert_speculative_is_plain(
        backend, TorchBackend(decoder), prompts(decoder.config.vocab_size), {"exit": plans()["exit"]}, NEW_TOKENS
    )


def precision_plans(backend: str) -> dict[str, DraftPlan]:
    """Precision self-drafts (the fp32 model verifies): int8 alone, int8 behind n-gram lookup, an int8 early exit,
    and on ONNX Runtime int4 (torch has no int4 draft)."""
    int8 = {"precision": "int8"}
    out = [
        DraftPlan.of(
            name="int8", kind="precision", params=int8, sources={"model": {"max_draft": 6, "adaptive": False}}
        ),
        DraftPlan.of(
            name="int8+lookup",
            kind="precision",
            params=int8,
            lookup=["ngram"],
            lookup_max_draft=6,
            sources={"model": {"max_draft": 4}, "ngram": {"min": 1, "max": 3}},
        ),
        DraftPlan.of(
            name="int8-exit", kind="precision", params=int8, exit_layer=LAYERS - 1, sources={"model": {"max_draft": 3}}
        ),
    ]
    if backend == "onnx":
        out.append(
            DraftPlan.of(
                name="int4",
                kind="precision",
                params={"precision": "int4"},
                sources={"model": {"max_draft": 4, "threshold": 0.0}},
            )
        )
    return {p.name: p for p in out}


@pytest.mark.parametrize("name", ["onnx", "torch", "torch-smoothed"])
def test_precision_drafts_at_real_shapes(name, onnx_artifacts, real_shaped):
    """A precision draft writes its own KV at the positions it drafts and the fp32 verify rewrites them: greedy
    speculative == plain at SmolLM2's shapes on ONNX Runtime's fused graphs (MatMulNBits drafts) and on torch
    (the int8 twin, also with SmoothQuant scales: folded norms, int8 down projections), and the drafts are
    accepted."""
    if name.startswith("torch"):
        root, backend = None, TorchBackend(real_shaped[1]())
        if name == "torch-smoothed":
            from speccompile.passes.precision_estimate import int8_input_scales
            from speccompile.runtime.backends.torch.int8_twin import set_input_scales

            sequences = [torch.tensor([p]) for p in prompts(backend.config.vocab_size)]
            set_input_scales(backend.decoder, int8_input_scales(backend.decoder, sequences))
    else:
        root, backend = onnx_artifacts("precision")
    plan_map = precision_plans(name)
    backend.check_plans(read_plans(plan_map, backend.config.num_layers))
    assert_speculative_is_plain(
        backend, backend.replica(), prompts(backend.config.vocab_size), plan_map, NEW_TOKENS, root
    )
    _, stats = run(backend, prompts(backend.config.vocab_size)[0], NEW_TOKENS, plan_map["int8"])
    # far above chance (one in 49152) either way; smoothing scales measured on two random prompts of a random
    # model help it less than a real model's calibration text: on an AMD EPYC (Zen 2, AVX2, 7-bit activations)
    # six prompts accepted 0.45 of the smoothed twin's drafts, 0.67 of the plain twin's
    bar = 0.3 if name == "torch-smoothed" else 0.5
    assert stats.accepted / max(stats.drafted, 1) > bar, stats


TREE_PLANS = {
    p.name: p
    for p in (
        DraftPlan.of(
            name="tree",
            lookup=["ngram"],
            lookup_max_draft=4,
            lookup_branches=3,
            tree_nodes=10,
            sources={"ngram": {"min": 1, "max": 3}},
        ),
        DraftPlan.of(
            name="lookahead-tree",
            lookup=["lookahead", "ngram"],
            lookup_max_draft=4,
            lookup_branches=3,
            tree_nodes=10,
            sources={"ngram": {"min": 1, "max": 3}},
        ),
        DraftPlan.of(
            name="logitspec-tree",
            lookup=["ngram", "logitspec"],
            lookup_max_draft=4,
            lookup_branches=3,
            tree_nodes=10,
            sources={"ngram": {"min": 1, "max": 3}},
        ),
    )
}


@pytest.mark.parametrize("name", ["int8", "int4", "fused", "torch"])
def test_token_trees_at_real_shapes(name, onnx_artifacts, real_shaped):
    """Token trees (a tree mask and tree positions in the verify, the accepted path's KV moved in place) keep
    greedy speculative == plain at SmolLM2's shapes: ONNX Runtime's fused graphs (fp32, and int8 / int4 with
    their padding row) and torch's CPU products. A quantized target's tree rows must compute the steps along
    their branches bit for bit on this CPU's kernel path, or the backend verifies chains only (its load-time
    self-check, ``runtime/backends/onnx/selfcheck.py``): on an AMD EPYC (Zen 4, AVX-512 VNNI) int4 tree rows
    differ from their steps by 0.3-0.7 in the logits, and before the check its trees decoded other text."""
    from speccompile.runtime.backends.onnx.selfcheck import tree_rows_differ

    if name == "torch":
        root, backend = None, TorchBackend(real_shaped[1]())
    else:
        root, backend = onnx_artifacts(name)
    differ = tree_rows_differ(backend.replica()) if name.startswith("int") else None
    assert backend.tree_unsupported() == (None if differ is None else f"on this CPU the quantized target's {differ}")
    # the model's own continuation of a seed, then other text after the seed's last tokens, then the seed again:
    # the lookup finds several continuations (a tree) and one of them is what the model says
    seed, noise = prompts(backend.config.vocab_size)
    own = run(backend, seed, 8)[0]
    test_prompts = [seed + own + noise[:6] + seed[-2:] + noise[6:] + seed, seed + noise + seed]
    if differ is None:
        assert_speculative_is_plain(backend, backend.replica(), test_prompts, TREE_PLANS, NEW_TOKENS, root)
    else:  # chains of the first branch (the most recent match here, not the model's text): lossless, maybe unaccepted
        for prompt in test_prompts:
            plain = run(backend, prompt, NEW_TOKENS)[0]
            assert all(run(backend, prompt, NEW_TOKENS, plan, root=root)[0] == plain for plan in TREE_PLANS.values())
    trees = sum(
        run(backend, prompt, NEW_TOKENS, plan, root=root)[1].tree_rounds
        for prompt in test_prompts
        for plan in TREE_PLANS.values()
    )
    assert (trees > 0) == (differ is None), f"{trees} rounds verified a tree; the self-check: {differ}"


def batch_vs_alone(backend_of, prompt_list: list[list[int]]) -> float:
    """Largest |logit| difference between one-token rows of several sequences in one batched call and the same
    rows each alone (same cache contents), at SmolLM2's shapes."""
    from speccompile.runtime.segments import Row, full_model

    batch, alone = backend_of(), backend_of()
    n = len(prompt_list)
    batch.reserve(64, slots=n)
    full = full_model(batch.config.num_layers)
    batch.run_rows(full, [Row(s, 0, p) for s, p in enumerate(prompt_list)])
    rows = [Row(s, len(p), [p[0]]) for s, p in enumerate(prompt_list)]
    together = batch.run_rows(full, rows)
    worst = 0.0
    for row, prompt, got in zip(rows, prompt_list, together):
        alone.reserve(64)
        alone.forward(prompt, 0)
        want = alone.forward(row.tokens, row.pos)
        worst = max(worst, float(np.abs(got - want).max()))
    return worst


@pytest.mark.parametrize("name", ["fused", "int8", "int4"])
def test_onnx_rows_of_a_batch_at_real_shapes(name, onnx_artifacts):
    """Plain steps of four sequences in one call against the same steps alone. fp32: within the rounding of
    section 6. Quantized graphs run a batch of one-token rows on GroupQueryAttention's one-row kernel (their
    single steps use a padding row, ``FusedGraph.padding``): the test says by how much they differ, and a
    quantized artifact batches these graphs' rows only where they do not (``OnnxBackend.rows_share_a_call``; packed
    graphs batch them: ``tests/test_packed_rows.py``)."""
    root, backend = onnx_artifacts(name)
    gen = torch.Generator().manual_seed(5)
    prompt_list = [torch.randint(3, backend.config.vocab_size, (n,), generator=gen).tolist() for n in (7, 12, 5, 9)]

    def forced():  # one call for the batch whatever the backend would choose: what batching would cost
        opened = open_onnx(root)
        opened.rows_share_a_call = lambda segment=None: True
        return opened

    forced_diff = batch_vs_alone(forced, prompt_list)
    diff = batch_vs_alone(lambda: open_onnx(root), prompt_list)
    print(f"{name}: a row in one call of 4 against itself alone: {forced_diff:.3g}; as the backend runs it: {diff:.3g}")
    if name == "fused":
        assert forced_diff <= ROUNDING and diff <= ROUNDING
    else:
        assert diff == 0.0, f"{name}: the verifier's rows in a batch differ from themselves alone by {diff:.3g}"
        assert forced_diff > 0.0 or backend.rows_share_a_call(), (
            f"{name}: rows in one call equal themselves alone ({forced_diff:.3g}): batch them"
        )


def test_torch_rows_of_a_batch_at_real_shapes(real_shaped):
    decoder = real_shaped[1]()
    gen = torch.Generator().manual_seed(5)
    prompt_list = [torch.randint(3, decoder.config.vocab_size, (n,), generator=gen).tolist() for n in (7, 12, 5, 9)]
    diff = batch_vs_alone(lambda: TorchBackend(decoder), prompt_list)
    print(f"torch: a row in a batch of 4 against itself alone: {diff:.3g}")
    assert diff <= ROUNDING
