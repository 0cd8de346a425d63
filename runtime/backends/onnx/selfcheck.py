"""Load-time self-check of an ONNX artifact whose target itself is weight-only quantized (``build --quantize``).

Greedy speculation is lossless only if verifying k tokens in one call computes, bit for bit, what k one-token
steps compute: quantized products amplify the rounding of any other kernel path into whole quantization steps
(docs/design.md section 6). The export pads attention rows so that this holds on the kernels it was measured on
(``FusedGraph.padding``), but ONNX Runtime picks its MatMulNBits and attention kernels by CPU (AVX2, AVX-512,
VNNI, AMX) and by row count, so it is checked here, on this CPU, with the artifact's own graphs: a few random
prompts, each verified as one k-token call and as k steps, and a token tree against the steps of its
branches. Where a chain verify differs, speculation is refused (the model decodes plainly and says why);
where only a tree does, the backend verifies chains only (plans draft their first branch, with a warning):
never decoding something other than plain decoding would.

Float targets need no check: their k-row and one-row results agree within the near-tie rule, which the tests
cover at real shapes.

This module must not import torch or transformers.
"""

from __future__ import annotations

import numpy as np

TRIALS = ((37, 5), (90, 8), (12, 12))  # (prompt length, tokens verified at once): row counts on both sides of
# MLAS's row blocks, prompts shorter and longer than a kernel's tile


def rows_differ(backend, trials=TRIALS, seed: int = 0) -> str | None:
    """Why a k-token call of ``backend``'s full model does not compute its k one-token steps bit for bit
    (None: it does, on every trial)."""
    rng = np.random.default_rng(seed)
    vocab = backend.config.vocab_size
    for prompt, k in trials:
        prompt = min(prompt, backend.config.max_position_embeddings - k - 1)
        ids = rng.integers(0, vocab, prompt + k).tolist()
        backend.reserve(prompt + k + 1)
        backend.forward(ids[:prompt], 0)
        together = np.array(backend.forward(ids[prompt:], prompt), copy=True)
        apart = np.stack([backend.forward([ids[prompt + i]], prompt + i)[0] for i in range(k)])
        if not np.array_equal(together, apart):
            diff = float(np.abs(together - apart).max())
            return f"a {k}-token verify and its {k} one-token steps differ by up to {diff:.2g} in the logits"
    return None


TREE = [-1, 0, 1, -1, 3]  # two branches off the input token: the second's rows attend past the first's slots


def tree_rows_differ(backend, prompt: int = 57, seed: int = 1) -> str | None:
    """Why a token-tree verify of ``backend``'s full model (``forward_tree``) does not compute, bit for bit, the
    one-token steps along each of its branches (None: it does). A tree's later branch reads its keys past the
    slots of the earlier one, masked out: a different attention tiling than its own steps see, which a
    quantized target's int8 activations turn into whole quantization steps, on some CPUs and not others
    (measured: docs/history.md, 'Figures behind the code's constants')."""
    rng = np.random.default_rng(seed)
    prompt = min(prompt, backend.config.max_position_embeddings - len(TREE) - 2)
    ids = rng.integers(0, backend.config.vocab_size, prompt + 1 + len(TREE)).tolist()
    backend.reserve(prompt + len(TREE) + 2)
    backend.forward(ids[:prompt], 0)
    tree = np.array(backend.forward_tree(ids[prompt:], TREE, prompt), copy=True)
    rows = {0: []}  # the rows of each branch, input token first
    for node, parent in enumerate(TREE):
        rows[node + 1] = (rows[parent + 1] if parent >= 0 else [0]) + [node + 1]
    leaves = [node + 1 for node in range(len(TREE)) if node not in TREE]
    for leaf in leaves:
        backend.forward(ids[:prompt], 0)
        for depth, row in enumerate(rows[leaf]):
            step = backend.forward([ids[prompt + row]], prompt + depth)[0]
            if not np.array_equal(step, tree[row]):
                diff = float(np.abs(step - tree[row]).max())
                return f"a token tree's rows and the steps along its branches differ by up to {diff:.2g} in the logits"
    return None


def tree_refusal(backend) -> str | None:
    """Why ``backend`` must verify chains only (its plans' trees drafted as their first branch), or None. Only
    an ONNX backend whose target is quantized is checked, once, on a replica (its own KV buffers)."""
    if "_tree_refusal" not in backend.__dict__:
        refusal = None
        if _quantization(backend):
            why = tree_rows_differ(backend.replica())
            refusal = None if why is None else f"on this CPU the quantized target's {why}"
        backend.__dict__["_tree_refusal"] = refusal
    return backend.__dict__["_tree_refusal"]


def _quantization(backend) -> dict | None:
    return (getattr(backend, "record", None) or {}).get("quantization") if backend.name == "onnx" else None


def speculation_refusal(backend) -> str | None:
    """Why this opened backend must not speculate (None: it may). Only an ONNX backend whose target is
    quantized is checked (a few forwards of its full model at load)."""
    quantization = _quantization(backend)
    if not quantization:
        return None
    why = rows_differ(backend.replica())
    if why is None:
        return None
    return (
        f"on this CPU the {quantization.get('scheme', 'quantized')} target's kernels round a verify differently "
        f"from plain steps ({why}), so speculative output would not equal plain output; this artifact decodes "
        "plainly here (an artifact built without --quantize speculates losslessly on any CPU)"
    )


__all__ = ["TREE", "TRIALS", "rows_differ", "speculation_refusal", "tree_refusal", "tree_rows_differ"]
