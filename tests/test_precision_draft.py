"""Precision self-drafts (``runtime/draft_kinds/precision.py``): the model's own graph with weight-only int8 /
int4 products drafts, the full-precision model verifies.

- on ONNX Runtime's fused graphs, greedy speculative == plain on several families, for the whole model,
  an int4 early exit and an int4 layer skip, and the drafts are accepted (a tiny random model's int8 draft
  agrees with it most of the time);
- the quantized weights go into the same ``weights.bin`` once, next to the full ones, and only the draft
  graph reads them;
- where no kernel runs the scheme (torch; the standard ONNX graphs) the plan is refused in one line
  before any work, and bad options are refused when the plan is validated.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("onnxruntime")

from lossless import assert_speculative_is_plain, run  # noqa: E402
from onnx_helpers import make_artifact, ort_backend  # noqa: E402
from speccompile.runtime.errors import ArtifactError  # noqa: E402
from speccompile.runtime.manifest import DraftPlan, read_manifest  # noqa: E402
from speccompile.runtime.torch_backend import TorchBackend  # noqa: E402


def precision_plans(num_layers: int) -> dict[str, DraftPlan]:
    plans = [DraftPlan(name="int8", kind="precision", params={"precision": "int8"}, max_draft=4, threshold=0.0),
             DraftPlan(name="int4-b16s", kind="precision", params={"precision": "int4", "block_size": 16, "symmetric": True},
                       max_draft=3, threshold=0.0),
             DraftPlan(name="int4-exit", kind="precision", params={"precision": "int4"}, exit_layer=num_layers - 1,
                       max_draft=3, threshold=0.0),
             DraftPlan(name="int8-skip", kind="precision", params={"precision": "int8"}, skip_mlp=[1], max_draft=3,
                       threshold=0.0)]
    return {p.name: p for p in plans}


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(3, vocab, (4 + 9 * i,), generator=gen).tolist() for i in range(3)]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt_neox", "gemma3_text"])
def test_precision_drafts_are_lossless_on_onnx_runtime(tiny_decoder, tmp_path, family):
    _, decoder = tiny_decoder(family)
    plans = precision_plans(decoder.config.num_layers)
    root = make_artifact(decoder, plans, tmp_path / family, variant="fused")
    backend = ort_backend(root)
    backend.check_plans(plans)
    assert_speculative_is_plain(backend, decoder, prompts(decoder.config.vocab_size), plans, 24)
    plain, _ = run(backend, prompts(decoder.config.vocab_size)[0], 24)
    _, stats = run(backend, prompts(decoder.config.vocab_size)[0], 24, plans["int8"])
    assert stats.accepted / max(stats.drafted, 1) > 0.5  # an int8 copy of the model agrees with it most of the time


def test_quantized_weights_are_stored_once_and_read_only_by_the_draft(tiny_decoder, tmp_path):
    _, decoder = tiny_decoder("llama")
    plans = {"int4": DraftPlan(name="int4", kind="precision", params={"precision": "int4"}, max_draft=3)}
    record = read_manifest(make_artifact(decoder, plans, tmp_path / "a", variant="fused")).backends["onnx"]
    assert record["graphs"]["draft.int4"]["segment"] == {"start": 0, "stop": decoder.config.num_layers, "precision": "int4"}
    quantized = {n for n in record["tensors"] if ".int4" in n}
    assert quantized and quantized <= set(record["graphs"]["draft.int4"]["initializers"])
    assert not quantized & set(record["graphs"]["verify"]["initializers"])
    assert record["plans"]["int4"] == {"kind": "precision", "graphs": ["draft.int4"]}
    stored = {record["tensors"][n]["offset"]: record["tensors"][n]["nbytes"] for n in quantized}
    assert record["precision_draft_bytes"] == sum(stored.values()) > 0  # what inspect reports as the draft's bytes


def test_precision_drafts_are_refused_in_one_line_where_nothing_runs_them(tiny_decoder, tmp_path):
    _, decoder = tiny_decoder("llama")
    plan = DraftPlan(name="int4", kind="precision", params={"precision": "int4"}, max_draft=3)
    with pytest.raises(ArtifactError) as torch_refusal:
        TorchBackend(decoder).check_plans({"int4": plan})
    standard = make_artifact(decoder, {"int4": plan}, tmp_path / "std")  # standard graphs: no MatMulNBits draft
    with pytest.raises(ArtifactError) as onnx_refusal:
        ort_backend(standard)  # refused when the artifact is opened
    for exc in (torch_refusal, onnx_refusal):
        assert "int4" in str(exc.value) and "\n" not in str(exc.value)
    assert "ONNX Runtime only" in str(torch_refusal.value) and "no graph" in str(onnx_refusal.value)
    for params, needle in (({"precision": "int3"}, "int3"), ({"precision": "int4", "block_size": 24}, "block_size")):
        with pytest.raises(ArtifactError, match=needle):
            DraftPlan(name="bad", kind="precision", params=params).validate(decoder.config.num_layers)
