"""Do two versions of the ONNX exporter write graphs that compute the same thing?

Exports every canonical tiny family (``tests/tiny_models.py``) with an early-exit and a layer-skip plan, as
standard, fused and fused int4 graphs, once with an older checkout of speccompile (in a subprocess) and
once with this one, then runs each pair of graphs on the same random inputs with ONNX Runtime and prints
the largest difference per graph (the "same logits as before": 0.0 means bit-identical).

    git worktree add /tmp/old REV
    ln -s ../runtime /tmp/old/speccompile/runtime; ln -s ../passes /tmp/old/speccompile/passes
    python benchmarks/experiments/export_parity.py /tmp/old [--families llama,olmo2,refcoder]

(The symlinks give the old tree the package layout the installed one maps with ``package-dir``.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent.parent  # this script is in benchmarks/experiments/
SEQ, PAST = 3, 5  # the call's tokens, after this many cached positions
VARIANTS = {
    "standard": {"variant": "standard"},
    "fused": {"variant": "fused"},
    "int4": {"variant": "fused", "quantize": "int4"},
}

EXPORT = r"""
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from tiny_models import make_model
from transformers import AutoModelForCausalLM
import speccompile
from speccompile.convert import arch_config, canonical_weights
from speccompile.runtime.backends.torch.decoder import build_decoder
from speccompile.runtime.artifact.manifest import DraftPlan
try:
    from speccompile.exporters.onnx_export import export_onnx
    if not Path(sys.modules["speccompile.exporters.onnx_export"].__file__).is_relative_to(Path(speccompile.__file__).parent):
        raise ImportError  # an editable install's mapping, not this tree's
except ImportError:
    from speccompile.export_onnx import export_onnx
family, out = sys.argv[1], Path(sys.argv[2])
if family == "refcoder":  # the bundled reference model, as the build loads it
    from speccompile.loading import load_source
    hf = load_source(None).model.eval()
else:
    hf = AutoModelForCausalLM.from_pretrained(make_model(family, out / "model")).eval()
config = arch_config(hf)
decoder = build_decoder(config, canonical_weights(hf, config))
plans = {"ee": DraftPlan.of(name="ee", exit_layer=2), "ls": DraftPlan.of(name="ls", skip_attn=[1], skip_mlp=[2])}
for name, options in json.loads(sys.argv[4]).items():
    try:
        record = export_onnx(decoder, plans, out / name / "onnx", **options)
    except ValueError:
        continue  # this exporter does not write that variant for this family
    (out / name / "record.json").write_text(json.dumps(record))
"""


def export(tree: Path | None, family: str, out: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(tree)) if tree is not None else dict(os.environ)
    subprocess.run(
        [sys.executable, "-c", EXPORT, family, str(out), str(REPO / "tests"), json.dumps(VARIANTS)],
        check=True,
        env=env,
        cwd=tempfile.gettempdir(),
        capture_output=True,
    )


def feeds(graph: dict, variant: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    seq, past, max_len = SEQ, PAST, 16
    out = {}
    for spec in graph["inputs"]:
        name, shape = spec["name"], spec["shape"]
        if name == "input_ids":
            out[name] = rng.integers(3, 200, (1, seq)).astype(np.int64)
        elif name == "position_ids":
            out[name] = np.arange(past, past + seq)[None].astype(np.int64)
        elif name == "hidden":
            out[name] = rng.standard_normal((1, seq, shape[2])).astype(np.float32)
        elif name == "seqlens_k":
            out[name] = np.array([past + seq - 1], np.int32)
        elif name == "total_sequence_length":
            out[name] = np.array(past + seq, np.int32)
        else:  # past_key_values.*: the whole cache (fused) or the past (standard)
            out[name] = rng.standard_normal((1, shape[1], past if variant == "standard" else max_len, shape[3])).astype(
                np.float32
            )
    return out


def compare(old: Path, new: Path) -> tuple[float, list[str]]:
    import onnxruntime as ort

    worst, notes = 0.0, []
    for variant in VARIANTS:
        have = [(root / variant / "record.json").is_file() for root in (old, new)]
        if not all(have):
            notes.append(f"{variant}: only the {'new' if have[1] else 'old'} exporter writes it" if any(have) else "")
            continue
        records = [json.loads((root / variant / "record.json").read_text()) for root in (old, new)]
        if records[0]["variant"] != records[1]["variant"]:
            notes.append(f"{variant}: {records[0]['variant']} graphs before, {records[1]['variant']} now")
            continue
        for key in sorted(set(records[0]["graphs"]) & set(records[1]["graphs"])):
            graphs = [r["graphs"][key] for r in records]
            inputs = feeds(graphs[0], records[0]["variant"])
            outputs = []
            for root, graph in zip((old, new), graphs):
                session = ort.InferenceSession(str(root / variant / graph["file"]), providers=["CPUExecutionProvider"])
                results = session.run(None, {k: v.copy() for k, v in inputs.items()})
                outputs.append(dict(zip([o.name for o in session.get_outputs()], results)))
            for name in outputs[0]:
                a, b = outputs[0][name], outputs[1][name]
                if name.startswith("present.") and records[0]["variant"] == "fused":
                    # the whole cache comes back: compare the call's positions, not the slot after them, which
                    # quantized graphs since the padded form fill with their padding row (FusedGraph.padding)
                    a, b = a[:, :, : PAST + SEQ], b[:, :, : PAST + SEQ]
                worst = max(worst, float(np.abs(a - b).max()))
    return worst, [n for n in notes if n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old_tree", type=Path, help="an older checkout of speccompile (see the module docstring)")
    parser.add_argument(
        "--families",
        default=None,
        help="comma-separated (default: every canonical tiny family); 'refcoder' is the bundled reference model",
    )
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import FAMILIES

    families = args.families.split(",") if args.families else list(FAMILIES)
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            old, new = Path(tmp) / f"old-{family}", Path(tmp) / f"new-{family}"
            export(args.old_tree.resolve(), family, old)
            export(None, family, new)
            worst, notes = compare(old, new)
            print(
                f"{family:12s} max |old - new| {worst:.2e}" + (f"   ({'; '.join(notes)})" if notes else ""), flush=True
            )


if __name__ == "__main__":
    main()
