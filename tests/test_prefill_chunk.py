"""A request alone reads a long prompt in the chunk the build measured on this machine (``runtime/decoding/
prefill_chunk.py``, ``passes/prefill_chunk_timing.py``): the calls are chunks, the output is what one call gives."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from onnx_helpers import make_artifact, ort_backend

from speccompile.passes.prefill_chunk_timing import time_prefill_chunk
from speccompile.runtime.artifact.manifest import DraftPlan
from speccompile.runtime.backends.torch.backend import TorchBackend
from speccompile.runtime.decoding.prefill_chunk import chunk_for, measure, stored
from speccompile.runtime.decoding.speculative import DecodeRequest, Stats, backend_drafter, decode, reserve_cache
from speccompile.runtime.errors import ArtifactError
from speccompile.runtime.segments import full_model

LOOKUP = DraftPlan.of("lookup", lookup=["ngram"], lookup_max_draft=4, sources={"ngram": {"min": 1, "max": 3}})


def _decode(backend, prompt, plan, chunk):
    """The new tokens of ``prompt`` decoded alone with ``plan``, and the widths of the full model's prompt calls."""
    widths: list[int] = []
    run_rows, full = backend.run_rows, full_model(backend.config.num_layers)

    def recorded(segment, rows):
        if segment == full and rows and rows[0].pos < len(prompt) - 1:
            widths.append(rows[0].width)
        return run_rows(segment, rows)

    backend.run_rows = recorded
    request = DecodeRequest(prompt, 12)
    reserve_cache(backend, request, plan)
    out: list[int] = []
    for new in decode(backend, request, backend_drafter(backend, plan, None), Stats(), chunk):
        out.extend(new)
    backend.run_rows = run_rows
    return out, widths


@pytest.mark.parametrize("backend_kind", ["torch", "onnx"])
def test_a_lone_request_reads_its_prompt_in_chunks_and_decodes_alike(backend_kind, tiny_decoder, tmp_path):
    _, decoder = tiny_decoder("llama")
    if backend_kind == "torch":
        make = lambda: TorchBackend(decoder)  # noqa: E731
    else:
        root = make_artifact(decoder, {"lookup": LOOKUP}, tmp_path / "onnx", variant="fused")
        make = lambda: ort_backend(root)  # noqa: E731
    gen = torch.Generator().manual_seed(5)
    head = torch.randint(3, decoder.config.vocab_size, (20,), generator=gen).tolist()
    prompt = head + head[:7] + head  # 47 tokens that repeat, so the lookup drafts
    for plan in (None, LOOKUP):
        whole, widths = _decode(make(), prompt, plan, None)
        assert widths == [len(prompt)]
        chunked, widths = _decode(make(), prompt, plan, 16)
        assert widths == [16, 16, 15]
        assert chunked == whole


def test_the_build_times_prompt_chunks_and_a_load_here_uses_them(tiny_decoder, monkeypatch):
    """The build stores the fastest chunk with the machine; a load on this machine reads prompts in it, a load
    elsewhere in one call; a malformed record is a one-line error. (Candidates shorter than the tiny model's
    context of 256 positions.)"""
    import speccompile.passes.prefill_chunk_timing as build_side
    import speccompile.runtime.decoding.prefill_chunk as runtime_side

    monkeypatch.setattr(build_side, "CANDIDATES", (64, 128))
    monkeypatch.setattr(runtime_side, "CANDIDATES", (64, 128))
    _, decoder = tiny_decoder("llama")
    backend = TorchBackend(decoder)
    ir = SimpleNamespace(tuning={}, config=decoder.config)
    lines: list[str] = []
    time_prefill_chunk(SimpleNamespace(plain_backend=lambda: backend), ir, None, 0.001, lines.append)
    record = ir.tuning["prefill_chunk"]
    length = min(1024, decoder.config.max_position_embeddings - 2)
    assert int(max(record["seconds"], key=int)) == length and record["tokens"] in map(int, record["seconds"])
    assert chunk_for(ir.tuning, backend) == record["tokens"]
    assert f"a {length}-token prompt read in chunks of" in lines[-1]
    assert chunk_for({"prefill_chunk": {**record, "machine": "torch on cpu: another CPU"}}, backend) is None
    assert chunk_for({}, backend) is None
    with pytest.raises(ArtifactError, match="tuning.prefill_chunk is malformed"):
        chunk_for({"prefill_chunk": {"tokens": "256"}}, backend)
    skipped = SimpleNamespace(tuning={}, config=decoder.config)
    time_prefill_chunk(SimpleNamespace(plain_backend=lambda: backend), skipped, 0.0, 0.001, lines.append)
    assert "prefill_chunk" not in skipped.tuning and "prompt chunks not timed" in lines[-1]


def test_measure_reads_the_prompt_in_every_candidate_chunk(tiny_decoder):
    _, decoder = tiny_decoder("llama")
    backend = TorchBackend(decoder)
    seconds = measure(backend, 300, repeats=1)
    assert sorted(seconds) == [256, 300]
    assert stored(seconds, backend)["tokens"] in (256, 300)


# -- a prompt chunk's head on its last token alone (Row.last_only) ------------------------------------------------


def _backends(decoder, tmp_path):
    """torch, the ONNX fused graphs and the packed ones: each takes ``last_only`` rows."""
    yield "torch", TorchBackend(decoder)
    for packed in (False, True):
        root = make_artifact(
            decoder, {"lookup": LOOKUP}, tmp_path / f"onnx-{packed}", variant="fused", packed_rows=packed
        )
        yield f"onnx packed={packed}", ort_backend(root)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_prompt_chunk_computes_its_last_logits_alone_and_the_same(family, tiny_decoder, tmp_path):
    from speccompile.runtime.segments import Row

    _, decoder = tiny_decoder(family)
    gen = torch.Generator().manual_seed(6)
    prompt = torch.randint(3, decoder.config.vocab_size, (40,), generator=gen).tolist()
    full = full_model(decoder.config.num_layers)
    for name, backend in _backends(decoder, tmp_path / family):
        backend.reserve(64, slots=2)
        every = backend.run_rows(full, [Row(0, 0, prompt[:24])]) + backend.run_rows(full, [Row(0, 24, prompt[24:])])
        backend.reserve(64, slots=2)
        chunks = backend.run_rows(full, [Row(0, 0, prompt[:24], last_only=True)])
        chunks += backend.run_rows(full, [Row(0, 24, prompt[24:], last_only=True)])
        assert [c.shape[0] for c in every] == [24, 16], name
        assert [c.shape[0] for c in chunks] == [1, 1], name
        if name == "torch":  # a one-row product takes another kernel than a 16-row one: the last bits differ
            assert abs(chunks[-1][-1] - every[-1][-1]).max() < 1e-4, name
        else:  # ONNX Runtime's products compute a row the same whatever the rows beside it
            assert (chunks[-1][-1] == every[-1][-1]).all(), name
        # beside a verify of another sequence in one call: each row as alone
        backend.run_rows(full, [Row(1, 0, prompt[:30])])
        mixed = backend.run_rows(full, [Row(0, 24, prompt[24:], last_only=True), Row(1, 30, prompt[30:33])])
        alone = backend.run_rows(full, [Row(1, 30, prompt[30:33])])[0]
        assert abs(mixed[0][-1] - every[-1][-1]).max() < 1e-4, name
        assert mixed[1].shape[0] == 3 and abs(mixed[1] - alone).max() < 1e-4, name
