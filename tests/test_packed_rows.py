"""Packed calls (fused graphs exported with ``packed_rows``, GroupQueryAttention's ``query_seqlens``): every row of a
``run_rows`` call, whatever its width (one-token steps, k-token verifies, token trees, prompt chunks), in one call of
each graph, each row computing to the bit what it computes in a call of its own.

Checked in lockstep: one backend runs each batch of rows as one call, another runs every row alone in the same
slot, and the logits and the cache must be equal, on random-weight models of several architectures and at
SmolLM2-135M's shapes (all 30 blocks: kernels pick their paths by shape, and tiny models hide it), with and without
one-token rows counting their pad as a query row (``pad_rows``: then a step also computes, to the bit, what the same
position computes inside a verify). Then batched decoding (sequences joining with prompt chunks beside others'
verifies, and leaving): every sequence decodes its own plain output, every run of the full model one call. Graphs exported before ``packed_rows`` keep today's
path, and an ONNX Runtime older than the graphs need is refused in one line.

Quantized targets (``--quantize int8`` / ``int4``: int8 activations, which turn a last-bit difference into a whole
quantization step) batch only on packed graphs: at SmolLM2's shapes every row, a step or a k-token verify, computes
to the bit alone what it computes beside 1, 3 and 7 rows of other widths in any slot; batched decoding gives every
sequence its own plain output to the token, in shared calls; their older graphs still run the verifier's rows
alone."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from lossless import assert_same_greedy, run
from onnx_helpers import make_artifact, ort_backend
from test_batch_decoding import EXIT, LOOKUP, SKIP, _decode_batch, _requests
from test_real_shapes import LAYERS, ROUNDING, SMOLLM2
from test_tree import TREE
from tiny_models import make_model

from speccompile.runtime.artifact.manifest import DraftPlan
from speccompile.runtime.backends.slots import batch_of
from speccompile.runtime.errors import BackendUnavailableError
from speccompile.runtime.segments import Row, full_model

PLANS = {"exit": DraftPlan.of(name="exit", exit_layer=1, head="final")}
PARENTS = [-1, 0, 0, 1, 3]  # a token tree of five nodes below the input token


def _tokens(vocab: int, lengths, seed: int = 5) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def count_calls(backend) -> Counter:
    """Counts every run of each of ``backend``'s sessions from now on (graph key -> runs)."""
    counts: Counter = Counter()
    for key, session in backend.sessions.items():
        original = session.run_with_iobinding

        def counted(*args, _key=key, _original=original, **kwargs):
            counts[_key] += 1
            return _original(*args, **kwargs)

        session.run_with_iobinding = counted
    return counts


def lockstep(batch, alone, calls: list[list[Row]]) -> None:
    """Each entry of ``calls`` as one ``run_rows`` on ``batch`` (one run of each full-model graph) and row by row
    on ``alone``: the logits equal to the bit, then the cache of every slot a row wrote."""
    full = full_model(batch.config.num_layers)
    graphs = batch.index.calls(full)
    counts = count_calls(batch)
    written: dict[int, int] = {}
    for rows in calls:
        before = counts.copy()
        got = batch.run_rows(full, rows)
        assert all(counts[key] - before[key] == 1 for key in graphs), f"rows {rows} took more than one call"
        for row, logits in zip(rows, got):
            want = alone.run_rows(full, [row])[0]
            assert logits.shape == want.shape == (row.width, batch.config.vocab_size)
            difference = float(np.abs(logits - want).max())
            assert np.array_equal(logits, want), f"slot {row.slot}: a row in a batch differs alone by {difference:.3g}"
            if row.parents is None:
                written[row.slot] = row.pos + row.width
    for slot, length in written.items():
        for mine, theirs in zip(batch.k + batch.v, alone.k + alone.v):
            assert np.array_equal(mine[slot, :, :length], theirs[slot, :, :length]), f"slot {slot}'s cache differs"


def mixed_calls(vocab: int, tree_fits) -> list[list[Row]]:
    """Prompts of five sequences (slot 4 stays idle between them), then one call of a one-token step, a 4-token
    verify, a token tree (where the model's windows allow it), a 16-token prompt chunk and an 8-token verify, then
    one-token steps only (the call the kernel would run on its one-row path, were it one row wide)."""
    p = _tokens(vocab, (20, 13, 9, 6, 17, 1, 4, 6, 16, 8, 1, 1, 1, 1, 1))
    prompts = [Row(0, 0, p[0]), Row(1, 0, p[1]), Row(2, 0, p[2]), Row(3, 0, p[3]), Row(5, 0, p[4])]
    tree = Row(2, 9, p[7], parents=PARENTS) if tree_fits(9, len(p[7])) else Row(2, 9, p[7][:2])
    mixed = [Row(0, 20, p[5]), Row(1, 13, p[6]), tree, Row(3, 6, p[8]), Row(5, 17, p[9])]
    after = 9 if tree.parents is not None else 11
    steps = [Row(0, 21, p[10]), Row(1, 17, p[11]), Row(2, after, p[12]), Row(3, 22, p[13]), Row(5, 25, p[14])]
    return [prompts, mixed, steps, [Row(3, 23, p[0][:2]), Row(5, 26, p[1][:1])]]


@pytest.fixture(scope="module")
def artifacts(tiny_decoder, tmp_path_factory):
    made = {}

    def get(family: str, **options):
        key = (family, tuple(sorted(options.items())))
        if key not in made:
            _, decoder = tiny_decoder(family)
            folder = tmp_path_factory.mktemp("packed") / family
            options = {"packed_rows": True, **options}  # build --packed-rows, unless a test asks for older graphs
            made[key] = decoder, make_artifact(decoder, PLANS, folder, variant="fused", **options)
        return made[key]

    return get


def record_widths(backend, full) -> list[list[int]]:
    """The row widths of every full-model ``run_rows`` call ``backend`` makes from now on (a list that fills)."""
    widths: list[list[int]] = []
    run_rows = backend.run_rows

    def recorded(segment, rows):
        if segment == full:
            widths.append([row.width for row in rows])
        return run_rows(segment, rows)

    backend.run_rows = recorded
    return widths


@pytest.mark.parametrize(
    "family", ["llama", "qwen2", "qwen3", "gemma", "gpt_neox", "gpt2", "mistral", "gemma3_text", "smollm3"]
)
def test_rows_of_any_width_share_one_call_and_compute_what_they_compute_alone(family, artifacts):
    """Kernel rotary (Llama, Qwen), rotary outside the kernel (GPT-NeoX's partial rotary), learned positions (GPT-2),
    sliding windows (Mistral, Gemma 3 with its local rotary), q/k norms (Qwen3), a block without rotary (SmolLM3)."""
    decoder, root = artifacts(family)
    batch, alone = ort_backend(root), ort_backend(root)
    assert batch.rows_share_a_call() and batch.packed
    batch.reserve(48, slots=6)
    alone.reserve(48, slots=6)
    lockstep(batch, alone, mixed_calls(decoder.config.vocab_size, batch.tree_fits))


def test_a_row_without_room_for_the_calls_width_runs_alone(artifacts):
    """GroupQueryAttention wants room for the call's padded width after each row's past: a row near the end of the
    cache beside a wide prompt chunk leaves the call (and computes the same), the others stay together."""
    decoder, root = artifacts("llama")
    batch, alone = ort_backend(root), ort_backend(root)
    for backend in (batch, alone):
        backend.reserve(24, slots=3)
    capacity = batch.k[0].shape[2]
    p = _tokens(decoder.config.vocab_size, (20, 3, 1, 10, 1))
    calls = batch.index.calls(full_model(decoder.config.num_layers))
    near_end = [Row(0, 20, p[2]), Row(1, 3, p[3]), Row(2, 3, p[4])]
    assert near_end[0].pos + near_end[1].width > capacity
    assert batch._groups(calls, near_end) == [[1, 2], [0]]
    lockstep(batch, alone, [[Row(0, 0, p[0]), Row(1, 0, p[1]), Row(2, 0, p[1])]])
    full = full_model(decoder.config.num_layers)
    for row, logits in zip(near_end, batch.run_rows(full, near_end)):
        assert np.array_equal(logits, alone.run_rows(full, [row])[0])


@pytest.mark.parametrize("family, pad_rows", [("llama", False), ("gpt2", False), ("gpt_neox", False), ("llama", True)])
def test_batched_decoding_packs_each_round_and_every_sequence_decodes_its_own_output(
    family, pad_rows, tiny_decoder, tmp_path
):
    """Sequences join with prompt chunks while others verify, and leave; plain steps, lookup chains and trees, an
    early exit and a layer skip. Every run of the full model is one call of each of its graphs, however many rows
    of whatever widths it has, and every output is the sequence's own plain output: to the token where one-token
    rows count their pad (``pad_rows``: a step computes what its position computes inside a verify), else up to
    the near-tie rule (a step and a verify row may differ in the last bits)."""
    _, decoder = tiny_decoder(family)
    plans = {p.name: p for p in (LOOKUP, TREE, EXIT, SKIP)}
    root = make_artifact(decoder, plans, tmp_path / family, variant="fused", pad_rows=pad_rows, packed_rows=True)
    backend = ort_backend(root)
    full = full_model(decoder.config.num_layers)
    graphs = backend.index.calls(full)
    widths = record_widths(backend, full)
    counts = count_calls(backend)
    requests = _requests(decoder, [None, LOOKUP, TREE, EXIT, SKIP, LOOKUP])
    outputs = _decode_batch(backend, requests, max_batch=4, joins=(0, 0, 1, 1, 4, 6), prefill_chunk=5)
    assert any(len(w) > 1 and max(w) > 1 for w in widths), "no call had several rows with a verify or a chunk"
    assert all(counts[key] == len(widths) for key in graphs), (counts, len(widths))
    alone, near_ties = ort_backend(root), 0
    for (request, _), got in zip(requests, outputs):
        plain = run(alone, request.prompt_ids, request.max_new_tokens)[0]
        if pad_rows:
            assert got == plain
        else:
            near_ties += assert_same_greedy(decoder, request.prompt_ids, plain, got)
    assert near_ties <= 1, f"{near_ties} near-tie divergences: too many to be rounding"


def test_graphs_exported_before_packed_rows_keep_todays_calls(artifacts):
    """Without ``query_seqlens`` one-token rows of consecutive slots share a call and every wider row runs alone;
    rows of a model whose positions the kernel does not compute (GPT-2) all run alone."""
    _, llama = artifacts("llama", packed_rows=False)
    _, gpt2 = artifacts("gpt2", packed_rows=False)
    backend = ort_backend(llama)
    assert not backend.packed and not backend.rows_in_one_call
    assert backend.rows_share_a_call() and not ort_backend(gpt2).rows_share_a_call()
    backend.reserve(16, slots=5)
    calls = backend.index.calls(full_model(backend.config.num_layers))
    steps = [Row(2, 6, [4]), Row(0, 4, [5]), Row(1, 9, [8])]
    assert backend._groups(calls, steps) == [[1, 2, 0]]  # slot order
    mixed = [Row(0, 4, [5]), Row(1, 9, [8, 9]), Row(2, 6, [4]), Row(3, 3, [7]), Row(4, 0, [1, 2])]
    assert backend._groups(calls, mixed) == [[0], [1], [2, 3], [4]]
    _, packed = artifacts("llama")
    packed = ort_backend(packed)
    packed.reserve(16, slots=5)
    assert packed._groups(packed.index.calls(full_model(backend.config.num_layers)), mixed) == [[0, 1, 2, 3, 4]]


def test_an_onnxruntime_older_than_the_graphs_need_is_refused_in_one_line(artifacts, monkeypatch):
    import onnxruntime

    _, packed = artifacts("llama")
    _, old = artifacts("llama", packed_rows=False)
    monkeypatch.setattr(onnxruntime, "__version__", "1.31.2")
    with pytest.raises(BackendUnavailableError) as refused:
        ort_backend(packed)
    message = str(refused.value)
    assert "onnxruntime>=1.32" in message and "1.31.2" in message and "\n" not in message
    ort_backend(old)  # older graphs still open


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """pad_rows -> a random-weight Llama with SmolLM2-135M's shapes, all 30 blocks, exported packed (with or without
    one-token rows counting their pad), built once each."""
    from transformers import AutoModelForCausalLM

    from speccompile.convert import arch_config, canonical_weights
    from speccompile.runtime.backends.torch.decoder import build_decoder

    base = tmp_path_factory.mktemp("smollm2_packed")
    folder = make_model("llama", base / "model", seed=7, num_hidden_layers=30, **SMOLLM2)
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    config = arch_config(hf)
    decoder = build_decoder(config, canonical_weights(hf, config))
    del hf
    made = {}

    def get(pad_rows: bool):
        if pad_rows not in made:
            made[pad_rows] = make_artifact(
                decoder,
                {"lookup": LOOKUP},
                base / f"pad{int(pad_rows)}",
                folder / "tokenizer.json",
                variant="fused",
                pad_rows=pad_rows,
                packed_rows=True,
            )
        return made[pad_rows]

    return get


@pytest.mark.parametrize("pad_rows", [False, True])
def test_at_smollm2_shapes_a_row_computes_in_every_batch_what_it_computes_alone(pad_rows, smollm2):
    """All 30 blocks at SmolLM2-135M's shapes, ONNX Runtime's default threads: ragged prompts, then steps, verifies,
    a tree and a prompt chunk in one call, then one-token steps only in one call, each row to the bit what it
    computes alone. A one-token step and the same position inside a verify: within the near-tie rule's rounding
    (fp32's default), or to the bit where one-token rows count their pad (``pad_rows``, what quantized targets
    need)."""
    from onnx_helpers import open_onnx

    root = smollm2(pad_rows)
    batch, alone = open_onnx(root), open_onnx(root)
    vocab = batch.config.vocab_size
    batch.reserve(64, slots=6)
    alone.reserve(64, slots=6)
    lockstep(batch, alone, mixed_calls(vocab, batch.tree_fits))
    full = full_model(batch.config.num_layers)
    tokens = _tokens(vocab, (8,), seed=9)[0]
    verify = alone.run_rows(full, [Row(0, 22, tokens)])[0]
    steps = np.concatenate([alone.run_rows(full, [Row(0, 22 + i, [t])])[0] for i, t in enumerate(tokens)])
    rounding = float(np.abs(verify - steps).max())
    limit = 0.0 if pad_rows else ROUNDING
    assert rounding <= limit, f"a verify and its steps give logits {rounding:.2e} apart (allowed {limit:.0e})"


# -- quantized targets (int8 activations): batched only on packed graphs -------------------------------------------

SCHEMES = ["int8", "int4"]
ORDER = (3, 1, 8, 5, 2, 7, 4, 6)  # the other rows' widths, in the order they join a call


@pytest.fixture(scope="module")
def quantized_smollm2(tmp_path_factory):
    """scheme -> a random-weight Llama with SmolLM2-135M's shapes and ``test_real_shapes.LAYERS`` blocks (kernels
    pick their paths by shape, not by depth), exported quantized and packed, built once each."""
    from transformers import AutoModelForCausalLM

    from speccompile.convert import arch_config, canonical_weights
    from speccompile.runtime.backends.torch.decoder import build_decoder

    base = tmp_path_factory.mktemp("smollm2_quantized")
    folder = make_model("llama", base / "model", seed=7, num_hidden_layers=LAYERS, **SMOLLM2)
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    config = arch_config(hf)
    decoder = build_decoder(config, canonical_weights(hf, config))
    del hf
    made = {}

    def get(scheme: str):
        if scheme not in made:
            made[scheme] = make_artifact(
                decoder,
                {"lookup": LOOKUP},
                base / scheme,
                folder / "tokenizer.json",
                variant="fused",
                quantize=scheme,
                packed_rows=True,
            )
        return made[scheme]

    return get


def compositions(vocab: int, width: int, pos: list[int]) -> list[list[Row]]:
    """Calls that hold one row of ``width`` tokens: alone (slot 2), beside one row (slot 5, the call's last, an
    idle slot between), beside three (slot 0, the call's first, idle slots between) and beside seven (slot 4, the
    middle of a full call), the others of the other widths of ``ORDER``; slot ``s``'s rows start at ``pos[s]``."""
    others = [w for w in ORDER if w != width]
    tokens = _tokens(vocab, [8] * 8, seed=20 + width)

    def call(target: int, slots: list[int]) -> list[Row]:
        widths = iter(others)
        return [Row(s, pos[s], tokens[s][: width if s == target else next(widths)]) for s in slots]

    return [call(2, [2]), call(5, [1, 5]), call(0, [0, 2, 3, 6]), call(4, list(range(8)))]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_at_smollm2_shapes_a_quantized_row_computes_in_every_batch_what_it_computes_alone(scheme, quantized_smollm2):
    """Packed int8 / int4 graphs at SmolLM2's shapes: a one-token step and k-token verifies (k = 2..8), each alone,
    beside 1, 3 and 7 rows of other widths, first, last or in the middle of a call with idle slots: the logits and
    the cache to the bit what the row computes alone (no tolerance: int8 activations make any other rounding a
    quantization step). So the backend lets them share calls, and the load policy prices a round as one call.
    Laid out one place wide when alone, without its pad, a one-token row moved by 1e-6 beside wider rows here, and
    by up to 0.036 where an int8 activation crossed a rounding step."""
    from onnx_helpers import open_onnx

    root = quantized_smollm2(scheme)
    batch, alone = open_onnx(root), open_onnx(root)
    assert batch.record["quantization"]["scheme"] == scheme and batch.record["padded_attention_rows"]
    assert batch.rows_share_a_call() and batch.rows_in_one_call
    vocab = batch.config.vocab_size
    for backend in (batch, alone):
        backend.reserve(48, slots=8)
    prompts = _tokens(vocab, (20, 13, 9, 6, 17, 11, 5, 15), seed=6)
    lockstep(batch, alone, [[Row(s, 0, p) for s, p in enumerate(prompts)]])
    pos = [len(p) for p in prompts]
    for width in range(1, 9):  # each call rewrites its rows' positions, as a verify after a rejected one does
        lockstep(batch, alone, compositions(vocab, width, pos))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_packed_targets_batch_and_every_sequence_decodes_its_own_plain_output(scheme, tiny_decoder, tmp_path):
    """A tiny int8 / int4 packed artifact in a batch (sequences joining with prompt chunks beside others' verifies,
    and leaving; plain steps, lookup chains and trees (chains where this CPU's self-check refuses a quantized
    target's trees), an early exit and a layer skip): on the batched backend itself (no replicas), every run of the
    full model one call of each graph, some with several rows and a verify or a chunk, drafts accepted, and every
    output the sequence's own batch-1 plain output, to the token."""
    _, decoder = tiny_decoder("llama")
    plans = {p.name: p for p in (LOOKUP, TREE, EXIT, SKIP)}
    root = make_artifact(decoder, plans, tmp_path / scheme, variant="fused", quantize=scheme, packed_rows=True)
    backend = ort_backend(root)
    assert backend.rows_share_a_call() and backend.rows_in_one_call and batch_of(backend) is backend
    backend.tree_unsupported()  # its load-time self-check runs on a replica, before the calls are counted
    full = full_model(decoder.config.num_layers)
    graphs = backend.index.calls(full)
    widths = record_widths(backend, full)
    counts = count_calls(backend)
    requests = _requests(decoder, [None, LOOKUP, TREE, EXIT, SKIP, LOOKUP])
    sequences: list = []
    outputs = _decode_batch(
        backend, requests, max_batch=4, joins=(0, 0, 1, 1, 4, 6), prefill_chunk=5, sequences=sequences
    )
    assert any(len(w) > 1 and max(w) > 1 for w in widths), "no call had several rows with a verify or a chunk"
    assert all(counts[key] == len(widths) for key in graphs), (counts, len(widths))
    assert sum(s.stats.accepted for s in sequences) > 0, "no draft was accepted: nothing speculative was checked"
    alone = ort_backend(root)
    for (request, _), got in zip(requests, outputs):
        assert got == run(alone, request.prompt_ids, request.max_new_tokens)[0]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_targets_on_older_graphs_keep_their_verifier_rows_apart(scheme, tiny_decoder, tmp_path):
    """Without ``query_seqlens`` a quantized target's single steps run with a padding row and a batch without it
    (``FusedGraph.padding``): its verifier's rows still run one call each."""
    _, decoder = tiny_decoder("llama")
    backend = ort_backend(make_artifact(decoder, PLANS, tmp_path / scheme, variant="fused", quantize=scheme))
    assert not backend.packed and not backend.rows_share_a_call() and not backend.rows_in_one_call
    backend.reserve(16, slots=3)
    full = full_model(backend.config.num_layers)
    steps = [Row(0, 4, [5]), Row(1, 9, [8]), Row(2, 6, [4])]
    assert backend._groups(backend.index.calls(full), steps, full) == [[0], [1], [2]]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_build_quantize_packed_rows_serves_concurrent_requests_in_shared_calls(scheme, tiny_model_dir, tmp_path):
    """``build --quantize int8|int4 --packed-rows`` end to end on the tiny Llama: the graphs are quantized and
    packed, the loaded model's backend lets sequences share calls, and the server's scheduler runs concurrent
    requests in rounds of several sequences, each round at most one call of each graph (rows run alone would make
    more calls than rounds), every answer the request's own batch-1 greedy output."""
    import threading

    from click.testing import CliRunner

    from speccompile.cli import main
    from speccompile.runtime import load
    from speccompile.runtime.artifact.manifest import read_manifest
    from speccompile.server.openai_api import SamplingOptions
    from speccompile.server.scheduler import Job, Scheduler

    out = tmp_path / scheme
    args = ["build", str(tiny_model_dir("llama")), "-o", str(out), "--method", "lookup", "--backend", "onnx"]
    args += ["--quantize", scheme, "--packed-rows", "--calibration-tokens", "8", "--max-draft", "2", "--quiet"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    record = read_manifest(out).backends["onnx"]
    assert record["quantization"]["scheme"] == scheme and record["packed_rows"]
    model = load(out)
    assert model.backend.rows_share_a_call() and model.backend.rows_in_one_call
    model.backend.tree_unsupported()  # its load-time self-check runs on a replica, before the calls are counted
    config = model.backend.config
    prompts = [p + p for p in _tokens(config.vocab_size, (9, 5, 12, 7), seed=8)]  # repeats: lookups draft
    rounds: list[dict] = []
    scheduler = Scheduler(model, max_batch=4, plan=next(iter(model.manifest.plans), None), observe=rounds.append)
    counts = count_calls(model.backend)  # after the scheduler timed its call costs
    finished, outcomes = threading.Event(), {}

    def done(i: int):
        def record_outcome(outcome):
            outcomes[i] = outcome
            if len(outcomes) == len(prompts):
                finished.set()

        return record_outcome

    try:
        for i, prompt in enumerate(prompts):
            options = SamplingOptions(max_tokens=8, temperature=0.0, top_p=1.0, top_k=0, seed=None, stops=[])
            scheduler.submit(Job(prompt, options, None, done(i)))
        assert finished.wait(120), "the requests did not finish"
    finally:
        scheduler.close()
    assert max(r["batch"] for r in rounds) > 1, "no round ran several sequences"
    full = model.backend.index.calls(full_model(config.num_layers))
    assert all(0 < counts[key] <= len(rounds) for key in full), (counts, len(rounds))
    alone = model.replica()
    for i, prompt in enumerate(prompts):
        assert outcomes[i].token_ids == alone.generate(prompt, max_new_tokens=8, speculate=False).token_ids


def test_quantized_targets_export_packed_rows_by_default():
    """A quantized target's rows share a call only on packed graphs, so ``--quantize`` exports them unless told not
    to; fp32 targets keep the older graphs unless asked."""
    from speccompile.build import BuildOptions, onnx_export_options

    def packed(**options) -> bool:
        return onnx_export_options(BuildOptions(model="m", out="o", **options)).get("packed_rows", False)

    assert packed(quantize="int8") and packed(quantize="int4")
    assert not packed(quantize="int4", packed_rows=False)
    assert not packed() and packed(packed_rows=True)
