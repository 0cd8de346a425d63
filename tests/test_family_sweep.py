"""A CI slice of the family sweep (tests/family_sweep.py): real tiny random transformers models of
families outside the canonical set run on the generic path with logits parity and lossless greedy drafting
(early exit and whole-block skip), a canonical family stays canonical, and state-space models (pure and
hybrid) are refused with a reason that says why."""

import family_sweep
import pytest
import torch

# Families with no canonical conversion planned, each with a quirk of its own: per-layer settings
# indexed by list position (exaone4), a BART-style padding mask sized from the cache, RoBERTa's position
# ids with a padding offset, a mixture of experts (dbrx), ALiBi (bloom), partial rotary and q/k norm (stablelm).
GENERIC = ["olmo", "stablelm", "exaone4", "bart", "roberta", "dbrx", "bloom"]
# Families that gain a canonical conversion: on either path, they must build and be lossless.
EITHER = ["olmo2", "cohere", "phi", "gemma3_text", "mixtral"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_builds_lossless(row, path):
    assert row.path == path, f"{row.model_type}: {row.path}: {row.reason}"
    assert row.parity is not None and row.parity <= family_sweep.PARITY_TOL, row
    assert row.lossless == "yes" and not row.checks, f"{row.model_type}: {row.checks}"


@pytest.mark.parametrize("model_type", GENERIC)
def test_generic_family_is_lossless(model_type):
    assert_builds_lossless(family_sweep.check(model_type), "generic")


@pytest.mark.parametrize("model_type", EITHER)
def test_family_with_a_planned_conversion_is_lossless(model_type):
    row = family_sweep.check(model_type)
    assert_builds_lossless(row, row.path if row.path in ("canonical", "generic") else "generic")


def test_canonical_family_keeps_its_conversion():
    row = family_sweep.check("llama")
    assert_builds_lossless(row, "canonical")


@pytest.mark.parametrize("model_type", ["mamba", "bamba"])
def test_state_space_models_are_refused_with_a_reason(model_type):
    row = family_sweep.check(model_type)
    assert row.path == "refused", f"{model_type}: {row.path}: {row.reason}"
    assert "recurrent or state-space" in row.reason and "cannot be drafted losslessly" in row.reason
    assert "Mixer" in row.reason  # names the layer that keeps state


def test_attention_models_named_like_markers_are_not_refused():
    """gpt-oss's class names contain "ssm" inside a word ("GptOssModel"): not a state-space model."""
    from speccompile.convert import recurrent_layer

    assert recurrent_layer(family_sweep.build_model("gpt_oss")) is None


def test_table_and_summary_count_every_row():
    rows = [family_sweep.check(t) for t in ("llama", "mamba")]
    table = family_sweep.table(rows)
    assert "| llama | canonical |" in table and "| mamba | refused |" in table
    assert "2 model types: canonical: 1, refused: 1" in family_sweep.summary(rows)
