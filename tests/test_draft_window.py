"""A precision self-draft far into its context attends to the cache's sinks and a window of recent positions
(``runtime/backends/onnx/draft_window.py``), not the whole past:

- a window that reaches back to the sinks computes, to the bit, what the draft on the whole cache computes
  (the buffer, the binding, the explicit positions and the rotary table are right), and leaves the same entry in
  the main cache;
- with a real window, the draft's logits do not move when positions outside the sinks and the window change,
  and do move when a position inside either changes;
- greedy speculative output stays plain output on several families with the window in use (the verifier
  decides every token), the window following the sequence across rounds and sliding;
- a new sequence in the slot, a moved slot and an older export without the positions input take the whole cache.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from lossless import assert_speculative_is_plain  # noqa: E402
from onnx_helpers import make_artifact, ort_backend  # noqa: E402

from speccompile.runtime.artifact.manifest import DraftPlan  # noqa: E402
from speccompile.runtime.backends.onnx.draft_window import WindowShape  # noqa: E402
from speccompile.runtime.decoding.load import draft_step_segment  # noqa: E402
from speccompile.runtime.drafting import read_plans  # noqa: E402
from speccompile.runtime.segments import Row, full_model  # noqa: E402

SMALL = WindowShape(sinks=2, window=8, margin=8)  # the window from 18 positions on


def int8_plans() -> dict[str, DraftPlan]:
    plan = DraftPlan.of(
        name="int8",
        kind="precision",
        params={"precision": "int8"},
        sources={"model": {"max_draft": 4, "threshold": 0.0}},
    )
    return {"int8": plan}


@pytest.fixture(scope="module")
def llama(tiny_decoder, tmp_path_factory):
    _, decoder = tiny_decoder("llama")
    root = make_artifact(decoder, int8_plans(), tmp_path_factory.mktemp("window") / "llama", variant="fused")
    backend = ort_backend(root)
    plan = read_plans(int8_plans(), decoder.config.num_layers)["int8"]
    return decoder, backend, draft_step_segment(plan)


def prefill(backend, tokens: list[int]) -> None:
    backend.reserve(len(tokens) + 16)
    backend.run_rows(full_model(backend.config.num_layers), [Row(0, 0, tokens)])


def prompt(vocab: int, n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def test_a_window_back_to_the_sinks_computes_what_the_whole_cache_computes(llama):
    decoder, backend, draft = llama
    tokens = prompt(decoder.config.vocab_size, 40)
    prefill(backend, tokens)
    backend.window.shape = WindowShape(sinks=4, window=36, margin=8)  # p = 40: window start 4, right after the sinks
    backend.window.forget()
    whole = backend.run_rows(draft, [Row(0, 40, [7])])[0]  # 40 < min_context: the main cache
    assert not backend.window.slots
    entry = [buf[0, :, 40].copy() for buf in backend.k + backend.v]
    calls = backend.index.calls(draft)
    windowed = backend._run_windowed(draft, calls, [Row(0, 40, [7])])[0]
    assert backend.window.slots[0].start == 4
    np.testing.assert_array_equal(windowed, whole)
    for buf, before in zip(backend.k + backend.v, entry):
        np.testing.assert_array_equal(buf[0, :, 40], before)


def test_the_draft_reads_the_sinks_and_the_window_and_nothing_else(llama):
    decoder, backend, draft = llama
    backend.window.shape = SMALL
    tokens = prompt(decoder.config.vocab_size, 40, seed=1)

    def draft_logits(change: int | None) -> np.ndarray:
        prefill(backend, tokens)
        if change is not None:
            for buf in backend.k + backend.v:
                buf[0, :, change] = np.random.default_rng(change).standard_normal(buf[0, :, change].shape)
        backend.window.forget()
        return backend.run_rows(draft, [Row(0, 40, [5])])[0]

    base = draft_logits(None)
    assert backend.window.slots[0].start == 32  # 40 - window
    # the first block's key of the new token depends on its token and position only: rotated at its real position
    window_key = backend.k[0][0, :, 40].copy()
    backend.window.shape = WindowShape(sinks=2, window=1000, margin=8)
    prefill(backend, tokens)
    backend.run_rows(draft, [Row(0, 40, [5])])  # the whole cache (40 < min_context)
    np.testing.assert_array_equal(backend.k[0][0, :, 40], window_key)
    backend.window.shape = SMALL
    for outside in (2, 10, 31):  # after the sinks, before the window
        np.testing.assert_array_equal(draft_logits(outside), base)
    for inside in (0, 1, 32, 39):  # a sink, the window
        assert np.abs(draft_logits(inside) - base).max() > 1e-4, inside


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_windowed_drafts_stay_lossless(tiny_decoder, tmp_path, family):
    _, decoder = tiny_decoder(family)
    root = make_artifact(decoder, int8_plans(), tmp_path / family, variant="fused")
    backend = ort_backend(root)
    if not backend.windowed:
        pytest.skip(f"{family}: its draft graph computes positions outside the kernel")
    backend.window.shape = SMALL
    used = []
    run_windowed = backend._run_windowed

    def counted(segment, calls, rows):
        used.append(rows[0].pos)
        return run_windowed(segment, calls, rows)

    backend._run_windowed = counted
    prompts = [prompt(decoder.config.vocab_size, n, seed=n) for n in (20, 33)]
    assert_speculative_is_plain(backend, backend, prompts, int8_plans(), 30)
    assert used and max(used) - min(used) > 2 * SMALL.window  # the window followed the sequence and slid


def test_new_sequences_and_moved_slots_take_their_own_sinks(llama):
    decoder, backend, draft = llama
    backend.window.shape = SMALL
    backend.window.forget()
    first, second = prompt(decoder.config.vocab_size, 40, seed=2), prompt(decoder.config.vocab_size, 40, seed=3)
    prefill(backend, first)
    backend.run_rows(draft, [Row(0, 40, [5])])
    prefill(backend, second)  # a new sequence in slot 0: its prefill marks the mirror stale from position 0
    assert 0 not in backend.window.slots
    again = backend.run_rows(draft, [Row(0, 40, [5])])[0]
    backend.window.forget()
    prefill(backend, second)
    np.testing.assert_array_equal(backend.run_rows(draft, [Row(0, 40, [5])])[0], again)
    # the main cache rewritten from a position before the window (after the sinks): the window follows
    rewrite = [Row(0, 10, first[10:])]
    backend.run_rows(full_model(backend.config.num_layers), rewrite)
    assert backend.window.slots[0].synced == 10 < backend.window.slots[0].start
    rewritten = backend.run_rows(draft, [Row(0, 40, [5])])[0]
    backend.window.forget()
    prefill(backend, second)
    backend.run_rows(full_model(backend.config.num_layers), rewrite)
    np.testing.assert_array_equal(backend.run_rows(draft, [Row(0, 40, [5])])[0], rewritten)
    backend.reserve(56, slots=2)
    backend.move_slot(0, 1, 41)
    assert 1 not in backend.window.slots


# -- torch: the decoder slices the cache (Positions.windowed) ----------------------------------------------------


def torch_backend(decoder):
    from speccompile.runtime.backends.torch.backend import TorchBackend

    backend = TorchBackend(decoder)
    backend.draft_window = SMALL
    return backend


def test_torch_a_window_back_to_the_sinks_computes_what_the_whole_cache_computes(tiny_decoder):
    import torch

    from speccompile.runtime.backends.torch.decoder import Positions, run_segment

    _, decoder = tiny_decoder("llama")
    backend = torch_backend(decoder)
    plan = read_plans(int8_plans(), decoder.config.num_layers)["int8"]
    draft = draft_step_segment(plan)
    backend.reserve(64)
    backend.run(full_model(decoder.config.num_layers), 0, prompt(decoder.config.vocab_size, 40))
    twin, head = backend.decoder_and_head(draft)
    ids = torch.tensor([[7]])
    with torch.inference_mode():
        whole = run_segment(twin, draft, ids, 40, backend.cache, backend.hidden, head)
        key = backend.cache.k[0, :, :, 40].clone()
        where = Positions.windowed(40, 1, "cpu", 4, 4)
        windowed = run_segment(twin, draft, ids, 40, backend.cache, backend.hidden, head, where=where)
    torch.testing.assert_close(windowed, whole, rtol=0, atol=1e-6)
    torch.testing.assert_close(backend.cache.k[0, :, :, 40], key, rtol=0, atol=0)


@pytest.mark.parametrize("width", [1, 3])
def test_torch_the_draft_reads_the_sinks_and_the_window_and_nothing_else(tiny_decoder, width):
    import torch

    _, decoder = tiny_decoder("llama")
    backend = torch_backend(decoder)
    draft = draft_step_segment(read_plans(int8_plans(), decoder.config.num_layers)["int8"])
    tokens = prompt(decoder.config.vocab_size, 40, seed=1)

    def draft_logits(change: int | None) -> np.ndarray:
        backend.reserve(64)
        backend.run(full_model(decoder.config.num_layers), 0, tokens)
        if change is not None:
            for buf in (backend.cache.k, backend.cache.v):
                buf[:, :, :, change] = torch.randn(
                    buf[:, :, :, change].shape, generator=torch.Generator().manual_seed(change)
                )
        return backend.run(draft, 40, [5] * width)

    base = draft_logits(None)
    for outside in (2, 10, 31):  # after the sinks, before the window (40 - 8)
        np.testing.assert_array_equal(draft_logits(outside), base)
    for inside in (0, 1, 32, 39):
        assert np.abs(draft_logits(inside) - base).max() > 1e-4, inside


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_torch_windowed_drafts_stay_lossless(tiny_decoder, family):
    _, decoder = tiny_decoder(family)
    backend = torch_backend(decoder)
    used = []
    run_tensor = backend.run_tensor

    def counted(segment, pos, ids=None, count=0, last_only=False):
        if segment.precision and pos >= SMALL.min_context:
            used.append(pos)
        return run_tensor(segment, pos, ids, count, last_only)

    backend.run_tensor = counted
    prompts = [prompt(decoder.config.vocab_size, n, seed=n) for n in (20, 33)]
    assert_speculative_is_plain(backend, decoder, prompts, int8_plans(), 30)
    assert used and max(used) - min(used) > SMALL.window
