"""bench's near-tie rule follows the artifact's precision: 1e-4 in fp32, units in the last place in bf16/fp16."""

import pytest

from speccompile.bench import NEAR_TIE, NEAR_TIE_ULPS, near_tie_limit


def test_fp32_keeps_the_design_rule():
    assert near_tie_limit("float32", 17.3) == NEAR_TIE == 1e-4


@pytest.mark.parametrize(
    "dtype, top, ulp",
    [("bfloat16", 20.0, 0.125), ("bfloat16", -9.0, 0.0625), ("float16", 20.0, 2.0**-6), ("bfloat16", 0.75, 2.0**-8)],
)
def test_half_precision_counts_units_in_the_last_place_of_the_top_logit(dtype, top, ulp):
    assert near_tie_limit(dtype, top) == NEAR_TIE_ULPS * ulp
    # a 0.25 gap (the largest SmolLM2 showed in bf16) at a top logit in [16, 32), where a bf16 ulp is 0.125: inside
    assert near_tie_limit("bfloat16", 24.0) >= 0.25


def test_a_half_precision_build_says_what_lossless_means_there(tiny_model_dir, tmp_path):
    from click.testing import CliRunner

    from speccompile.cli import main

    result = CliRunner().invoke(
        main,
        [
            "build",
            str(tiny_model_dir("llama")),
            "-o",
            str(tmp_path / "bf16"),
            "--dtype",
            "bfloat16",
            "--method",
            "lookup",
            "--calibration-tokens",
            "12",
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "note: in bfloat16 speculative output equals plain output up to near-ties" in result.output
