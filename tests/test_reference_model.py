"""The bundled reference model (models/refcoder) loads offline and reaches its documented held-out loss.

The loss is computed exactly as models/refcoder/train.py (and the model card) do: heldout_sample.txt is
tokenized as one string without added special tokens (its literal <|endoftext|> separators become the EOS
id), cut into non-overlapping windows of the training context length (inputs ids[i:i+T], targets shifted by
one, last window partial), token-weighted mean cross-entropy in fp32.
"""

import json
import math
import os
from pathlib import Path

import pytest

MODEL_DIR = Path(os.environ.get("REFCODER_DIR", Path(__file__).resolve().parents[1] / "models" / "refcoder"))
MARGIN = 0.02


@pytest.fixture(scope="module")
def metrics():
    return json.loads((MODEL_DIR / "metrics.json").read_text())


@pytest.fixture(scope="module")
def model_and_tokenizer():
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(2)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        MODEL_DIR, local_files_only=True, torch_dtype=torch.float32
    )
    tok = transformers.AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)
    model.eval()
    return model, tok


def heldout_loss(model, tok, text, seq_len, batch_size=16):
    import torch
    import torch.nn.functional as F

    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    n = len(ids) - 1
    wins = [(ids[i : min(i + seq_len, n)], ids[i + 1 : min(i + seq_len, n) + 1]) for i in range(0, n, seq_len)]
    total, count, correct = 0.0, 0, 0
    with torch.no_grad():
        for j in range(0, len(wins), batch_size):
            group = wins[j : j + batch_size]
            if len({len(g[0]) for g in group}) == 1:
                batches = [(torch.stack([g[0] for g in group]), torch.stack([g[1] for g in group]))]
            else:
                batches = [(g[0][None], g[1][None]) for g in group]
            for x, y in batches:
                logits = model(x).logits.float()
                total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum").item()
                correct += (logits.argmax(-1) == y).sum().item()
                count += y.numel()
    return total / count, correct / count


def test_files_present():
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "metrics.json",
        "README.md",
        "train.py",
        "heldout_sample.txt",
        "prompts.jsonl",
    ):
        assert (MODEL_DIR / name).is_file(), name
    assert not list(MODEL_DIR.glob("*.bin")) and not list(MODEL_DIR.glob("*.pt")), "no pickle checkpoints"
    size = sum(f.stat().st_size for f in MODEL_DIR.rglob("*") if f.is_file())
    assert size < 60 * 1024 * 1024


def test_prompts():
    lines = [ln for ln in (MODEL_DIR / "prompts.jsonl").read_text(encoding="utf-8").splitlines() if ln.strip()]
    prompts = [json.loads(ln)["prompt"] for ln in lines]
    assert len(prompts) >= 40
    assert all(isinstance(p, str) and 100 <= len(p) <= 600 for p in prompts)


def test_metrics_schema(metrics):
    for key in (
        "held_out_loss",
        "perplexity",
        "top1",
        "exit_agreement",
        "tokens_seen",
        "wall_time_s",
        "python_version",
        "sha256_train_file_list",
        "sha256_heldout_file_list",
    ):
        assert key in metrics, key
    assert set(metrics["exit_agreement"]) >= {"main", "baseline"}
    assert math.isclose(metrics["perplexity"], math.exp(metrics["held_out_loss"]), rel_tol=1e-6)


def test_tokenizer(model_and_tokenizer):
    model, tok = model_and_tokenizer
    assert len(tok) == model.config.vocab_size
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == model.generation_config.eos_token_id
    src = "def f(x):\n    return x + 1\n"
    ids = tok(src)["input_ids"]
    assert tok.eos_token_id not in ids and tok.bos_token_id not in ids  # nothing added to prompts
    assert tok.decode(ids) == src
    assert tok("a<|endoftext|>b", add_special_tokens=False)["input_ids"].count(tok.eos_token_id) == 1


def test_heldout_loss(model_and_tokenizer, metrics):
    model, tok = model_and_tokenizer
    text = (MODEL_DIR / "heldout_sample.txt").read_bytes().decode("utf-8")
    loss, top1 = heldout_loss(model, tok, text, metrics["config"]["seq_len"])
    assert loss < metrics["held_out_loss"] + MARGIN, (loss, metrics["held_out_loss"])
    assert top1 > metrics["top1"] - 0.01, (top1, metrics["top1"])


def test_greedy_generation(model_and_tokenizer):
    import torch

    model, tok = model_and_tokenizer
    enc = tok("import os\n\n\ndef ", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=16, do_sample=False)
    assert out.shape[1] > enc["input_ids"].shape[1]
