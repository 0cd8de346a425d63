"""Run an ONNX artifact with torch and transformers made unimportable (used by tests/test_onnx.py).

    python tests/torch_blocker.py ARTIFACT PROMPT_JSON NEW_TOKENS PLAN

installs a ``sys.meta_path`` finder that raises ImportError for torch / transformers *before anything
else is imported*, loads the artifact through ``speccompile.runtime`` + ``speccompile.runtime.backends.onnx``,
decodes greedily (plain and speculatively with PLAN) and prints one JSON line.
"""

import sys

import import_blocker  # this script's folder is on sys.path when it runs

import_blocker.block("torch", "transformers")

import json  # noqa: E402
import os  # noqa: E402

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main() -> None:
    root, prompt, new_tokens, plan_name = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    import speccompile.runtime as rt
    from speccompile.runtime.backends.onnx import OnnxBackend
    from speccompile.runtime.decoding.speculative import DecodeRequest, decode_all
    from speccompile.runtime.drafting import check_plans

    try:
        import torch  # noqa: F401

        blocked = False
    except ImportError:
        blocked = True
    manifest = rt.read_manifest(root)
    plans = check_plans(manifest)
    backend = OnnxBackend.from_artifact(root, manifest, plans, threads=1)
    out = {}
    for mode, plan in (("plain", None), ("spec", plans[plan_name])):
        tokens, stats = decode_all(backend, DecodeRequest(prompt, new_tokens), plan)
        out[mode] = tokens
        out[f"{mode}_accepted"] = stats.accepted
    out["torch_blocked"] = blocked
    out["torch_loaded"] = any(m.split(".")[0] in ("torch", "transformers") for m in sys.modules)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
