"""A slice of the randomized lossless harness (tests/lossless_harness.py runs 500+ cases per backend)."""

import pytest
from lossless_harness import run_cases


@pytest.mark.parametrize("backend,cases,seed", [("torch", 40, 101), ("onnx", 20, 202)])
def test_random_cases_are_lossless(backend, cases, seed):
    out = run_cases(
        cases, backend, seed, families=["llama", "gpt_neox", "mistral", "opt"] if backend == "onnx" else None
    )
    assert out.cases == cases and out.accepted > 0
    assert not out.unexplained, "\n".join(out.unexplained)
    assert len(out.explained) <= max(1, cases // 20), "\n".join(out.explained)
    assert set(out.by_kind) == {"model", "lookup", "hybrid"}
