"""Batched calls (``Backend.run_rows``): every row of a batch computes what it computes alone.

Rows of one call differ in slot, position and width (a prompt chunk, one plain token, a k-token draft, a
token tree), so a batch can hold sequences at any stage; each row's logits must be the ones the same row
gives in a call of its own. Checked on ONNX Runtime's fused graphs (one call for the batch) and on the
canonical torch decoder, on several families, against single-row calls on a backend of one slot (bit for bit,
and one call of each graph per batch, on packed graphs: tests/test_packed_rows.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx_helpers import make_artifact, ort_backend

from speccompile.runtime.artifact.manifest import DraftPlan
from speccompile.runtime.backends.torch.backend import TorchBackend
from speccompile.runtime.segments import Row, full_model

PLANS = {"exit": DraftPlan.of(name="exit", exit_layer=1, head="final")}
PARENTS = [-1, 0, 0, 1]  # a tree of 4 nodes below the input token


def _prompts(vocab: int, lengths) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def _batched_against_alone(make_backend, config, max_diff: float) -> float:
    """Prefill four prompts of different lengths in one call, then one call of mixed rows (a plain token, a
    3-token draft, a tree, a prompt chunk); every row against the same row run alone. Returns the largest
    logit difference seen."""
    prompts = _prompts(config.vocab_size, (7, 12, 3, 9))
    batch, alone = make_backend(), make_backend()
    batch.reserve(64, slots=4)
    full = full_model(config.num_layers)
    worst = 0.0

    def compare(rows: list[Row]) -> None:
        nonlocal worst
        got = batch.run_rows(full, rows)
        for row, logits in zip(rows, got):
            alone.reserve(64)
            for slot_prompt_row in history[row.slot]:  # the same cache contents, in slot 0 of its own backend
                alone.run_rows(full, [Row(0, slot_prompt_row.pos, slot_prompt_row.tokens, parents=None)])
            want = alone.run_rows(full, [Row(0, row.pos, row.tokens, parents=row.parents)])[0]
            assert logits.shape == want.shape
            diff = float(np.abs(logits - want).max())
            worst = max(worst, diff)
            assert diff <= max_diff, f"slot {row.slot}: a row in a batch differs from itself alone by {diff:.3g}"
            assert (logits.argmax(-1) == want.argmax(-1)).all()

    history: dict[int, list[Row]] = {slot: [] for slot in range(4)}
    first = [Row(slot, 0, prompt) for slot, prompt in enumerate(prompts)]
    compare(first)
    for row in first:
        history[row.slot].append(row)
    tokens = _prompts(config.vocab_size, (1, 4, 5, 6))
    mixed = [
        Row(0, 7, tokens[0]),  # a plain step
        Row(1, 12, tokens[1]),  # an input token and a 3-token draft
        Row(2, 3, tokens[2], parents=PARENTS),  # an input token and a token tree
        Row(3, 9, tokens[3]),  # a prompt chunk
    ]
    compare(mixed)
    for row in mixed:
        if row.parents is None:
            history[row.slot].append(row)
    # the tree row's KV is not kept: its slot continues from its prompt
    steps = [Row(0, 8, [3]), Row(1, 16, [4]), Row(2, 3, [5]), Row(3, 15, [6])]
    compare(steps)  # one call on backends that batch one-token rows
    return worst


@pytest.fixture(scope="module")
def onnx_artifacts(tiny_decoder, tmp_path_factory):
    made = {}

    def get(family: str, variant: str = "fused"):
        if (family, variant) not in made:
            _, decoder = tiny_decoder(family)
            packed = {"packed_rows": True} if variant == "fused" else {}  # one call for every row (--packed-rows)
            root = make_artifact(decoder, PLANS, tmp_path_factory.mktemp("rows") / family, variant=variant, **packed)
            made[family, variant] = (decoder, root)
        return made[family, variant]

    return get


@pytest.mark.parametrize(
    "family", ["llama", "qwen2", "gemma", "gpt_neox", "gpt2", "mistral", "llama/standard", "gpt2/standard"]
)
def test_onnx_rows_in_one_call_compute_what_they_compute_alone(family, onnx_artifacts):
    decoder, root = onnx_artifacts(*family.split("/"))
    worst = _batched_against_alone(lambda: ort_backend(root), decoder.config, max_diff=1e-5)
    print(f"{family}: largest difference of a batched row from the same row alone {worst:.3g}")


def test_onnx_every_row_shares_one_call(onnx_artifacts):
    """Packed graphs (``query_seqlens``): every row of a call together in slot order, whatever its width and
    whatever the model's positions (GPT-2's learned ones too); how older graphs group rows:
    tests/test_packed_rows.py."""
    for family in ("llama", "gpt2"):
        _, root = onnx_artifacts(family)
        backend = ort_backend(root)
        assert backend.rows_share_a_call()
        backend.reserve(16, slots=5)
        calls = backend.index.calls(full_model(backend.config.num_layers))
        mixed = [Row(2, 6, [4]), Row(0, 4, [5]), Row(1, 9, [8, 9]), Row(4, 0, [1, 2]), Row(3, 3, [7], parents=[])]
        assert backend._groups(calls, mixed) == [[1, 2, 0, 4, 3]]


def test_onnx_rows_keep_hidden_states_per_slot(onnx_artifacts):
    """An early exit's prefix keeps each row's hidden states in its own slot; the suffix on them gives the
    full model's logits, row by row."""
    decoder, root = onnx_artifacts("llama")
    backend = ort_backend(root)
    backend.reserve(32, slots=2)
    kinds = __import__("speccompile.runtime.drafting.kinds", fromlist=["kind_of"])
    kind = kinds.kind_of(PLANS["exit"], decoder.config.num_layers)
    prompts = _prompts(decoder.config.vocab_size, (6, 4))
    rows = [Row(0, 0, prompts[0]), Row(1, 0, prompts[1])]
    backend.run_rows(kind.prefix, rows)
    got = backend.run_rows(kind.suffix, [Row(0, 0, count=6), Row(1, 0, count=4)])
    alone = ort_backend(root)
    for prompt, logits in zip(prompts, got):
        alone.reserve(32)
        np.testing.assert_allclose(logits, alone.forward(prompt, 0), atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma", "gpt2", "mistral"])
def test_torch_rows_in_one_call_compute_what_they_compute_alone(family, tiny_decoder):
    _, decoder = tiny_decoder(family)
    worst = _batched_against_alone(lambda: TorchBackend(decoder), decoder.config, max_diff=1e-5)
    print(f"{family}: largest difference of a batched row from the same row alone {worst:.3g}")


def test_torch_pads_of_a_row_near_its_end_fit_beside_a_wide_row(tiny_decoder):
    """A one-token row at the last cache position, in one call with a prompt chunk wider than the room left:
    the call pads it to the chunk's width, and the pads' KV writes must find room (the cache grows) instead of
    running off the cache; the row still computes what it computes alone."""
    _, decoder = tiny_decoder("llama")
    config = decoder.config
    first, chunk = _prompts(config.vocab_size, (15, 10))  # the first fills 15 of 16 positions
    batch, alone = TorchBackend(decoder), TorchBackend(decoder)
    batch.reserve(16, slots=2)
    full = full_model(config.num_layers)
    batch.run_rows(full, [Row(0, 0, first[:-1])])
    got = batch.run_rows(full, [Row(0, 14, [first[-1]]), Row(1, 0, chunk)])
    alone.reserve(16)
    want = alone.run_rows(full, [Row(0, 0, first)])[0][-1:]
    np.testing.assert_allclose(got[0], want, atol=1e-5)
    alone.reserve(16)
    np.testing.assert_allclose(got[1], alone.run_rows(full, [Row(0, 0, chunk)])[0], atol=1e-5)


def test_torch_graphed_rows_pad_the_batch_without_touching_other_slots(tiny_decoder):
    """A batch of 3 rows replayed from the graph of bucket 4 (``StaticSteps.run_rows``): each row computes what it
    computes alone, and the pad row writes only past every sequence's end in its slot, so what slot 3 holds (a
    kept prompt, say) is intact."""
    from speccompile.runtime.backends.torch.graphs import eager_capture

    _, decoder = tiny_decoder("llama")
    config = decoder.config
    full = full_model(config.num_layers)
    prompts = _prompts(config.vocab_size, (7, 12, 3, 9))
    batch = TorchBackend(decoder, capture=eager_capture)
    batch.reserve(40, slots=3)
    assert batch.slots == 4  # slots grow to a bucket with graphs on
    batch.run_rows(full, [Row(3, 0, prompts[3])])  # slot 3: a prompt outside the batch
    kept = (batch.slot_cache.k[:, 3, :, :40].clone(), batch.slot_cache.v[:, 3, :, :40].clone())
    rows = [Row(slot, 0, prompt) for slot, prompt in enumerate(prompts[:3])]
    got = batch.run_rows(full, rows)
    steps = [Row(slot, len(prompt), [5 + slot]) for slot, prompt in enumerate(prompts[:3])]
    got_steps = batch.run_rows(full, steps)
    assert ("rows", full, 4, 12) in batch.static.graphs and ("rows", full, 4, 1) in batch.static.graphs
    assert torch.equal(batch.slot_cache.k[:, 3, :, :40], kept[0]) and torch.equal(
        batch.slot_cache.v[:, 3, :, :40], kept[1]
    )
    for row, step, logits, step_logits in zip(rows, steps, got, got_steps):
        alone = TorchBackend(decoder)
        alone.reserve(40)
        want = alone.run_rows(full, [Row(0, 0, row.tokens)])[0]
        np.testing.assert_allclose(logits, want, atol=1e-5)
        np.testing.assert_allclose(step_logits, alone.run_rows(full, [Row(0, step.pos, step.tokens)])[0], atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt2", "qwen2", "phi", "mistral"])
def test_torch_packed_rows_compute_what_they_compute_alone(family, tiny_decoder):
    """Chains of different widths (a verify, a plain step, a prompt chunk) run packed: the products on the real
    tokens only, attention on the padded rows. Each row's logits are the row's alone; so are an early exit's
    prefix (which keeps its hidden states) and its suffix on them, packed likewise."""
    from speccompile.runtime.segments import FINAL_HEAD, Segment

    _, decoder = tiny_decoder(family)
    config = decoder.config
    full = full_model(config.num_layers)
    exit_layer = max(1, config.num_layers // 2)
    prefix = Segment(0, exit_layer, head=None, keep_hidden=True)
    suffix = Segment(exit_layer, config.num_layers, head=FINAL_HEAD)
    prompts = _prompts(config.vocab_size, (6, 11, 4))
    news = _prompts(config.vocab_size, (4, 1, 7))
    batch = TorchBackend(decoder)
    batch.reserve(48, slots=3)
    batch.run_rows(full, [Row(slot, 0, prompt) for slot, prompt in enumerate(prompts)])
    rows = [Row(slot, len(prompt), new) for slot, (prompt, new) in enumerate(zip(prompts, news))]
    packed_calls = []
    original = batch._run_packed

    def spy(*args):
        packed_calls.append(len(args[1]))
        return original(*args)

    batch._run_packed = spy
    got = batch.run_rows(full, rows)
    assert batch.run_rows(prefix, rows) == [None] * 3
    got_suffix = batch.run_rows(suffix, [Row(row.slot, row.pos, None, count=row.width) for row in rows])
    assert packed_calls == [3, 3, 3]
    for row, prompt, logits, suffix_logits in zip(rows, prompts, got, got_suffix):
        alone = TorchBackend(decoder)
        alone.reserve(48)
        alone.run_rows(full, [Row(0, 0, prompt)])
        want = alone.run_rows(full, [Row(0, row.pos, row.tokens)])[0]
        np.testing.assert_allclose(logits, want, atol=1e-5)
        alone.run_rows(prefix, [Row(0, row.pos, row.tokens)])
        want_suffix = alone.run_rows(suffix, [Row(0, row.pos, None, count=row.width)])[0]
        np.testing.assert_allclose(suffix_logits, want_suffix, atol=1e-5)
