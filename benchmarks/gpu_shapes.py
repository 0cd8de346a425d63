"""The torch backend at the sizes GPU users serve: random-weight Llama-3.2-1B / Llama-3.1-8B built on the GPU.

Why random weights: the GPU machine this project borrows has no network and a 64 MiB carry, so no real 1B-8B
checkpoint can reach it; the cost of a step, a verify or a draft step depends on the shapes, not on the values.
What depends on the values (how many drafted tokens the model accepts) is set by hand (the oracle drafter) or
measured on a real model on the CPU (``--measure-acceptance``), and every figure says which it is.

What it prints and writes (``--json OUT``: every row), per shape and at batch 1 and 16:

1. **costs** (``kind: "cost"``), timed with CUDA events in turns (each repetition runs every item once, the order
   rotating; the median per item): a plain step of the full model (replayed from its CUDA graph at batch 1), the
   verify of k = 2, 4, 8, 16 drafted tokens (a forward of k + 1 tokens), the early-exit draft steps (blocks up to
   L/4 and L/2 with the shared head: the plan kind's own draft segment) and the precision (int8 twin) draft step,
   or the backend's reason for refusing it. Batch 1 calls ``TorchBackend.run_tensor`` (device tensors in and out,
   nothing read back: what the device round calls); batch 16 calls ``run_rows`` with 16 rows in slots 0..15 (what
   a batch round calls, its logits copied to the host included). All at a context of ``--context`` positions.
2. **rounds** (``kind: "round"``): the real decode loop (``BatchDecoder``, as ``speculative.decode`` runs it)
   against plain decoding on the same backend (CUDA graphs, ``round_on_device=True``), with an **oracle drafter**:
   a lookup source that proposes the known plain continuation (plain decoding runs first), each proposed
   position right with probability a (0, 0.5, 0.8, 0.95), else a token that is certainly wrong; the verdict of
   each position is drawn once per sequence from a seeded generator, so a round proposes up to 8 tokens and the
   verifier keeps those up to the first wrong one (1 + a + ... + a^k tokens a round on average). Reported:
   decode tokens/s (tokens after the first, over the wall time of the rounds after the prompt's), speedup, the
   host milliseconds per round, and whether the output equals plain decoding's (and where not, the first
   differing token and plain's top-2 logit gap there: a near-tie of the model's dtype, or a bug).
   **Host time per round** = the round's wall time (``BatchDecoder.step``: a speculative round, or a block of
   plain steps read at once) minus the GPU time of the forward calls it made, priced from the cost rows (the
   verify of its width, or its plain steps; CUDA events, in turns): what the round spends beyond the model's
   kernels (Python, launches, the read, a lookup). Measured from outside, since a round captured whole as one
   CUDA graph shows no call to time; negative values mean the round ran its kernels faster than they ran alone.
3. **expected speedups** (``kind: "expected"``, with ``--acceptance FILE``): for each real plan, its acceptance
   measured on a real model on the CPU (``--measure-acceptance``: SmolLM2-135M, the same greedy tokens, the
   round log of every prompt) priced with the costs measured here: tokens a round brings against the GPU time of
   its draft steps and verify. Labelled as what it is: costs measured on the GPU, acceptance from a real model
   (SmolLM2-135M on CPU).

``--smoke``: a tiny model on the CPU through the same code paths (CUDA graphs off, the static steps through
``graphs.eager_capture``, CUDA events replaced by ``time.perf_counter``), in well under a minute: what CI runs
(``tests/test_gpu_shapes_smoke.py``) so that the GPU run, which has one try, finds no broken path.

    python benchmarks/gpu_shapes.py --shape 1b --json shapes.json --budget 150            # on a GPU
    python benchmarks/gpu_shapes.py --measure-acceptance --json acceptance.json            # on the CPU (minutes)
    python benchmarks/gpu_shapes.py --shape 1b,8b --acceptance acceptance.json --json shapes.json
    python benchmarks/gpu_shapes.py --smoke --json smoke.json                              # anywhere, seconds

Progress goes to stderr, the tables to stdout. ``--budget SECONDS`` skips (and says so, in a ``skipped`` row) what
would not fit in the time left.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float
    tied: bool
    std: float = 0.02  # the weights' standard deviation: Llama's initializer range


SHAPES = {
    "1b": Shape("llama-3.2-1b", 2048, 16, 32, 8, 64, 8192, 128256, 500000.0, True),
    "8b": Shape("llama-3.1-8b", 4096, 32, 32, 8, 128, 14336, 128256, 500000.0, False),
    # the smoke model: every path of the real shapes (GQA, tied head, exits at L/4 and L/2) at a size CI runs in
    # seconds; its weights scaled as 0.02 is to a 2048-wide model (at 0.02 this narrow model repeats its last token)
    "smoke": Shape("smoke", 64, 4, 4, 2, 16, 128, 512, 10000.0, True, 0.02 * (2048 / 64) ** 0.5),
}
VERIFY_K = (2, 4, 8, 16)
EXIT_FRACTIONS = (4, 2)  # early exits after block L/4 and L/2
ACCEPTANCES = (0.0, 0.5, 0.8, 0.95)
BATCHES = (1, 16)
ORACLE_K = 8  # most tokens the oracle drafts a round
# the rounds' warm-up before the timed turns (acceptances, tokens), alone and batched: alone every acceptance, so that
# each round shape's graph is captured; a batch's rounds cost many times more and run mostly at the full draft length
WARMUP = {False: ACCEPTANCES, True: (0.5, 0.95)}
WARMUP_TOKENS = {False: 48, True: 16}
LABEL = (
    "costs measured on the GPU, acceptance from a real model (SmolLM2-135M on CPU; its fp32 weights sit on a "
    "4-bit grid, so its int8 precision drafts are accepted far more often than a model trained in 16 bits)"
)


def log(message: str) -> None:
    print(f"[gpu_shapes {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the model -----------------------------------------------------------------------------------------------
def arch_config(shape: Shape, max_positions: int):
    from speccompile.runtime.artifact.manifest import ArchConfig

    config = ArchConfig(
        model_type="llama",
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        num_layers=shape.layers,
        num_heads=shape.heads,
        num_kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate,
        norm_eps=1e-5,
        rotary_dim=shape.head_dim,
        tie_word_embeddings=shape.tied,
        max_position_embeddings=max_positions,
    )
    config.validate()
    return config


def random_decoder(shape: Shape, device, dtype, seed: int = 0, max_positions: int = 4096):
    """The runtime's own decoder (``build_decoder``) over random weights made on ``device`` itself (nothing is
    downloaded or copied from the host): linear and embedding weights N(0, std^2) (``Shape.std``: Llama's 0.02, at
    which a step's layers move the residual stream and the greedy continuation changes token as it goes, not one
    token repeated), norms 1, Llama's rotary frequencies."""
    import torch

    from speccompile.runtime.backends.torch.decoder import Decoder, build_decoder

    config = arch_config(shape, max_positions)
    with torch.device("meta"):
        names = {name: tuple(t.shape) for name, t in Decoder(config).state_dict().items()}
    generator = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, size in names.items():
        if name == "lm_head.weight" and shape.tied:
            continue
        if name == "rope_inv_freq":
            steps = torch.arange(0, shape.head_dim, 2, dtype=torch.float32, device=device) / shape.head_dim
            weights[name] = 1.0 / shape.rope_theta**steps
        elif name.endswith("norm.weight"):
            weights[name] = torch.ones(size, dtype=dtype, device=device)
        else:
            weights[name] = torch.randn(size, generator=generator, dtype=dtype, device=device).mul_(shape.std)
    return build_decoder(config, weights, dtype=dtype, device=device, copy=False)


def open_backend(decoder, device, smoke: bool):
    """``TorchBackend`` with CUDA graphs and the device round; in the smoke run the same static steps through
    ``eager_capture`` (graphs' bookkeeping without graphs) on the CPU."""
    from speccompile.runtime.backends.torch.backend import TorchBackend
    from speccompile.runtime.backends.torch.graphs import eager_capture

    if smoke:
        return TorchBackend(decoder, device=str(device), capture=eager_capture, round_on_device=True)
    return TorchBackend(decoder, device=str(device), cuda_graphs=True, round_on_device=True)


# -- clocks ------------------------------------------------------------------------------------------------------
class Clock:
    """CUDA events on a GPU (the GPU's own timeline: what the kernels between two marks took), ``perf_counter``
    on the CPU."""

    def __init__(self, device):
        import torch

        self.torch = torch
        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        if self.cuda:
            event = self.torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1000.0


def in_turns(items: dict[str, Callable[[], object]], repeats: int, clock: Clock, warmup: int = 2) -> dict[str, float]:
    """Median milliseconds of each item, timed in turns: every repetition runs each item once, the order rotated by
    one each time, so that drift (clocks, heat, other work) falls on every item alike. ``warmup`` untimed calls of
    each first (CUDA graph captures, lazy kernels)."""
    names = list(items)
    for _ in range(warmup):
        for name in names:
            items[name]()
    clock.sync()
    marks: dict[str, list] = {name: [] for name in names}
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            start = clock.mark()
            items[name]()
            marks[name].append((start, clock.mark()))
    clock.sync()
    return {name: statistics.median(clock.ms(a, b) for a, b in pairs) for name, pairs in marks.items()}


class Budget:
    """Seconds left of ``--budget``; what would not fit is skipped with a row that says so."""

    def __init__(self, seconds: float | None, rows: list):
        self.end = None if seconds is None else time.monotonic() + seconds
        self.rows = rows

    def left(self) -> float:
        return float("inf") if self.end is None else self.end - time.monotonic()

    def fits(self, what: str, estimate: float, **where) -> bool:
        left = self.left()
        if estimate <= left:
            return True
        reason = f"skipped: needs about {estimate:.0f} s, {max(left, 0):.0f} s of the budget left"
        log(f"{what}: {reason}")
        self.rows.append({"kind": "skipped", "what": what, "reason": reason, **where})
        return False


# -- costs ---------------------------------------------------------------------------------------------------
def exit_layers(layers: int) -> list[int]:
    return sorted({max(1, layers // f) for f in EXIT_FRACTIONS})


def draft_segments(layers: int) -> dict[str, object]:
    """Item name -> the draft segment of the plan kind it stands for (the kinds' own, ``read_plan``)."""
    from speccompile.runtime.artifact.manifest import DraftPlan
    from speccompile.runtime.drafting.plan import read_plan

    out = {}
    for e in exit_layers(layers):
        plan = DraftPlan.of(name=f"exit-{e}", exit_layer=e, sources={"model": {"max_draft": 6}})
        out[f"exit-{e}"] = read_plan(plan, layers).kind.draft_segment
    precision = DraftPlan.of(
        name="precision", kind="precision", params={"precision": "int8"}, sources={"model": {"max_draft": 6}}
    )
    out["precision-int8"] = read_plan(precision, layers).kind.draft_segment
    return out


def measure_costs(backend, shape: Shape, batch: int, context: int, repeats: int, clock: Clock, seed: int) -> list:
    """The cost rows of one shape at one batch size (see the module docstring)."""
    import torch

    from speccompile.runtime.segments import Row, full_model

    layers = backend.config.num_layers
    full = full_model(layers)
    rng = np.random.default_rng(seed)
    widths = {"step": 1, **{f"verify-{k}": k + 1 for k in VERIFY_K}}
    segments = {name: full for name in widths}
    rows_out: list[dict] = []
    for name, segment in draft_segments(layers).items():
        reason = backend.unsupported(segment)
        if reason is not None:
            rows_out.append(
                {"kind": "cost", "shape": shape.name, "batch": batch, "item": name, "ms": None, "unsupported": reason}
            )
            log(f"{shape.name} batch {batch}: {name} not timed: {reason}")
            continue
        backend.prepare(segment)  # an int8 twin is made once, here, not in a timed call
        segments[name], widths[name] = segment, 1
    # the context every call attends to: `context` random tokens in each of the batch's slots
    for slot in range(batch):
        prompt = rng.integers(0, shape.vocab, context).tolist()
        backend.run_rows(full, [Row(slot, 0, prompt)])
    items: dict[str, Callable] = {}
    for name, segment in segments.items():
        width = widths[name]
        if batch == 1:
            ids = torch.as_tensor(rng.integers(0, shape.vocab, width), dtype=torch.long, device=backend.device)
            items[name] = lambda s=segment, i=ids: backend.run_tensor(s, context, i)
        else:
            rows = [Row(slot, context, rng.integers(0, shape.vocab, width).tolist()) for slot in range(batch)]
            items[name] = lambda s=segment, r=rows: backend.run_rows(s, r)
    medians = in_turns(items, repeats, clock)
    step = medians["step"]
    for name, ms in medians.items():
        row = {
            "kind": "cost",
            "shape": shape.name,
            "batch": batch,
            "item": name,
            "tokens": widths[name],
            "ms": round(ms, 4),
            "vs_step": round(ms / step, 3),
            "repeats": repeats,
            "context": context,
            "layers": layers,
        }
        if name.startswith("exit-"):
            row["exit_layer"] = int(name.split("-")[1])
        rows_out.append(row)
    return rows_out


# -- the oracle drafter and the real round ---------------------------------------------------------------------
def oracle_source(prompt_len: int, continuation: Sequence[int], acceptance: float, seed: int, vocab: int):
    """A lookup source (``LookupSource``: the runtime drafts with it as with n-gram lookup) that proposes the known
    plain continuation, each position right with probability ``acceptance``, else a token that is not the right one.
    Which positions are right is drawn once, from ``seed``, so a position keeps its verdict across rounds."""
    from speccompile.runtime.drafting.drafter import Draft, LookupSource

    class OracleSource(LookupSource):
        name = "oracle"

        def __init__(self):
            n = len(continuation) + ORACLE_K
            rng = np.random.default_rng(seed)
            self.right = rng.random(n) < acceptance
            padded = np.concatenate([np.asarray(continuation, dtype=np.int64), np.zeros(ORACLE_K, dtype=np.int64)])
            self.tokens = np.where(self.right, padded, (padded + 1 + rng.integers(0, vocab - 1, n)) % vocab)

        def lookup(self, history, tail, limit):
            start = len(history) - prompt_len  # continuation[start] follows history[-1]
            stop = min(start + min(limit, ORACLE_K), len(continuation))
            return [int(t) for t in self.tokens[start:stop]]

        def propose(self, ctx):
            tokens = self.lookup(ctx.history, ctx.history, ctx.limit)
            return Draft(tokens=tokens, q=[None] * len(tokens), sources=[self.name] * len(tokens))

    return OracleSource()


def oracle_drafter(prompt_len, continuation, acceptance, seed, vocab):
    """The oracle as a plan's lookup part (``HybridDrafter`` without a model part: what ``make_drafter`` builds for a
    lookup-only plan), so the device round picks it up through ``lookup_part``."""
    from speccompile.runtime.drafting.hybrid import HybridDrafter

    return HybridDrafter([oracle_source(prompt_len, continuation, acceptance, seed, vocab)], None)


@dataclass
class Decoded:
    outputs: list[list[int]]
    tokens: int  # decode tokens (after each sequence's first)
    seconds: float  # wall time of the rounds after the prompts'
    round_ms: list[float]  # wall time of each round (``BatchDecoder.step``) after the prompts'
    host_ms: list[float]  # of it, what the GPU time of its forward calls (from the cost rows) leaves
    rounds: int
    drafted: int
    accepted: int
    path: str


def decode_batch(backend, prompts, new_tokens: int, drafters, costs: dict[str, float] | None) -> Decoded:
    """Decode ``prompts`` together (one ``BatchDecoder``; a batch of one is ``speculative.decode``'s case, where the
    backend's device round and device plain steps run), each with its drafter (None: plain). The first step reads
    the prompts and is not counted. ``costs``: the cost rows' milliseconds at this batch size, which price each
    round's forward calls (its verify width; a plain block's steps) for the host time."""
    from speccompile.runtime.decoding.batch import BatchDecoder
    from speccompile.runtime.decoding.speculative import DecodeRequest, Stats

    engine = BatchDecoder(backend, max_batch=len(prompts), keep_prompts=0)
    sequences = [
        engine.add(DecodeRequest(list(p), new_tokens), drafter=d, stats=Stats()) for p, d in zip(prompts, drafters)
    ]
    outputs: dict[int, list[int]] = {i: [] for i in range(len(sequences))}
    index = {id(s): i for i, s in enumerate(sequences)}
    first, tokens, seconds, round_ms, host_ms = True, 0, 0.0, [], []
    while not all(s.finished for s in sequences):
        logged = [len(s.stats.round_log) for s in sequences]
        engine.last_round = {}
        start = time.perf_counter()
        produced = engine.step()
        wall = time.perf_counter() - start
        for s, new in produced:
            outputs[index[id(s)]].extend(new)
        if first:  # the prompts (and each sequence's first token)
            first = False
            continue
        new_tokens_now = sum(len(new) for _, new in produced)
        tokens += new_tokens_now
        seconds += wall
        round_ms.append(wall * 1000.0)
        if costs is None:
            continue
        if len(sequences) == 1:
            s = sequences[0]
            verified = [n + 1 for n, _ in s.stats.round_log[logged[0] :]]  # a round's verify width
            gpu = sum(verify_ms(costs, w) for w in verified) if verified else new_tokens_now * costs["step"]
        else:  # one call for every row, padded to the widest (the torch backend's batched call)
            drafted = engine.last_round.get("drafted") or [0]
            gpu = verify_ms(costs, max(drafted) + 1)
        host_ms.append(wall * 1000.0 - gpu)
    path = "plain: device steps" if sequences[0].device_round is not None else "plain: host steps"
    if drafters[0] is not None:
        path = "device round" if sequences[0].device_round is not None else "host round"
    return Decoded(
        [outputs[i] for i in range(len(sequences))],
        tokens,
        seconds,
        round_ms,
        host_ms,
        sum(s.stats.rounds for s in sequences),
        sum(s.stats.drafted for s in sequences),
        sum(s.stats.accepted for s in sequences),
        path,
    )


def top2_gap(backend, prompt: list[int], produced: list[int]) -> float:
    """Plain decoding's top-2 logit gap before ``produced[-1]``'s position: where a differing token came from a
    near-tie (the verify and the step rounding the two apart) rather than a wrong token."""
    from speccompile.runtime.segments import full_model

    tokens = list(prompt) + list(produced[:-1])
    logits = np.asarray(backend.run(full_model(backend.config.num_layers), 0, tokens))[-1]
    top = np.sort(logits)[-2:]
    return float(top[1] - top[0])


def real_rounds(
    backend, shape: Shape, batch: int, args, costs: dict[str, float] | None, budget: Budget, repetitions: int
) -> list:
    """Plain decoding and the oracle at each acceptance, in turns over ``repetitions`` (each with its own
    prompts), on one backend: the round rows of one shape at one batch size. ``costs``: the cost rows at this
    batch (item -> ms), for the host time (None: not timed, no host time)."""
    rng = np.random.default_rng(args.seed + batch)
    new_tokens = args.new_tokens if batch == 1 else args.batch_new_tokens
    reps = [
        [rng.integers(0, shape.vocab, args.prompt_tokens).tolist() for _ in range(batch)] for _ in range(repetitions)
    ]
    engines = ["plain"] + [f"a={a}" for a in ACCEPTANCES]
    results: dict[str, list[Decoded]] = {name: [] for name in engines}
    plain_outputs = []
    for r, prompts in enumerate(reps):
        # plain first, untimed: the oracle's continuation, and every graph this loop replays is captured
        plain = decode_batch(backend, prompts, new_tokens, [None] * batch, costs).outputs
        plain_outputs.append(plain)

        def drafters(a: float, r=r, prompts=prompts, plain=plain):
            return [
                oracle_drafter(len(p), out, a, args.seed * 1000 + 100 * r + i, shape.vocab)
                for i, (p, out) in enumerate(zip(prompts, plain))
            ]

        if r == 0:  # warm-up: the rounds' graphs (one per round shape) captured untimed (smoke: the path, briefly)
            for a in WARMUP[batch > 1]:
                warm = 4 if args.smoke else WARMUP_TOKENS[batch > 1]
                decode_batch(backend, prompts, min(new_tokens, warm), drafters(a), costs)
        shift = r % len(engines)
        for name in engines[shift:] + engines[:shift]:
            a = None if name == "plain" else float(name[2:])
            ds = [None] * batch if a is None else drafters(a)
            results[name].append(decode_batch(backend, prompts, new_tokens, ds, costs))
        log(
            f"{shape.name} batch {batch}: repetition {r + 1}/{len(reps)} done ({budget.left():.0f} s of the budget left)"
        )
    rows = []
    plain_rate = sum(d.tokens for d in results["plain"]) / sum(d.seconds for d in results["plain"])
    for name in engines:
        runs = results[name]
        rate = sum(d.tokens for d in runs) / sum(d.seconds for d in runs)
        host = [h for d in runs for h in d.host_ms]
        wall = sum(w for d in runs for w in d.round_ms)
        row = {
            "kind": "round",
            "shape": shape.name,
            "batch": batch,
            "engine": "plain" if name == "plain" else "oracle",
            "acceptance": None if name == "plain" else float(name[2:]),
            "tokens_per_s": round(rate, 2),
            "plain_tokens_per_s": round(plain_rate, 2),
            "speedup": round(rate / plain_rate, 3),
            "round_ms": round(statistics.median(d for r in runs for d in r.round_ms), 4),
            "host_ms_per_round": round(statistics.median(host), 4) if host else None,
            "host_share": round(sum(host) / wall, 4) if host and wall > 0 else None,
            "host_ms_per_token": round(sum(host) / sum(d.tokens for d in runs), 4) if host else None,
            "rounds": sum(d.rounds for d in runs),
            "new_tokens": new_tokens,
            "prompts": batch * len(runs),
            "path": runs[0].path,
        }
        if name != "plain":
            rounds = max(sum(d.rounds for d in runs), 1)
            row["mean_accepted"] = round((sum(d.accepted for d in runs) + rounds) / rounds, 3)
            row["drafted_per_round"] = round(sum(d.drafted for d in runs) / rounds, 3)
            equal, first_diff = True, None
            for rep, (d, plain) in enumerate(zip(runs, plain_outputs)):
                for i, (out, want) in enumerate(zip(d.outputs, plain)):
                    if out != want and first_diff is None:
                        at = next((j for j, (x, y) in enumerate(zip(out, want)) if x != y), min(len(out), len(want)))
                        gap = top2_gap(backend, reps[rep][i], want[: at + 1])
                        first_diff = {"prompt": rep * batch + i, "token": at, "plain_top2_gap": gap}
                    equal &= out == want
            row["equal_to_plain"] = equal
            if first_diff is not None:
                row["first_difference"] = first_diff
        rows.append(row)
    return rows


# -- expected speedups of the real plans ------------------------------------------------------------------------
def verify_ms(costs: dict[str, float], width: int) -> float:
    """A forward of ``width`` tokens, interpolated between the measured step and verifies (and beyond the widest)."""
    points = sorted(
        (1 if name == "step" else int(name.split("-")[1]) + 1, ms)
        for name, ms in costs.items()
        if name == "step" or name.startswith("verify-")
    )
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    if width >= xs[-1]:
        return ys[-1] + (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) * (width - xs[-1])
    return float(np.interp(width, xs, ys))


def expected_rows(cost_rows: list, round_rows: list, acceptance: dict) -> list:
    """Each measured plan priced at each shape and batch: tokens its rounds brought on the real model (the round log)
    against the GPU milliseconds of the same rounds here (its verifies at their widths, one draft step per model
    token; an early exit's verify runs only blocks E..L-1 on the drafted tokens, priced as that share of the verify
    plus the prefix's share of a step). At batch 16 each sequence's rounds are priced as calls of 16 rows of their
    width, where a real batch pads every row to the widest of the round: an upper bound there. ``with_host``: plus
    the host time per round and per plain step measured in the round rows at that shape and batch (the oracle at
    a = 0.8 and plain decoding), where there are such rows."""
    out = []
    groups: dict[tuple, dict] = {}
    for row in cost_rows:
        groups.setdefault((row["shape"], row["batch"]), {})[row["item"]] = row
    for (shape, batch), items in groups.items():
        costs = {name: r["ms"] for name, r in items.items() if r.get("ms") is not None}
        if "step" not in costs:
            continue
        step = costs["step"]
        host: dict[
            str, float
        ] = {}  # per call of the batch: plain, a step's (a token of each sequence); oracle, a round's
        for r in round_rows:
            if r["shape"] == shape and r["batch"] == batch and r.get("host_ms_per_round") is not None:
                if r["engine"] == "plain":
                    host["plain"] = r["host_ms_per_token"] * batch
                elif r["acceptance"] == 0.8:
                    host["oracle"] = r["host_ms_per_round"]
        for name, plan in acceptance.get("plans", {}).items():
            row = {"kind": "expected", "label": LABEL, "shape": shape, "batch": batch, "plan": name}
            row["measured_on"] = acceptance.get("model", "")
            if plan.get("unsupported"):
                row.update(expected_speedup=None, reason=f"not measured on the CPU: {plan['unsupported']}")
                out.append(row)
                continue
            layers = int(plan["layers"])
            draft_ms, exit_share = 0.0, 0.0
            if plan["kind"] == "early_exit":
                gpu_layers = int(items["step"]["layers"])
                exits = {int(n.split("-")[1]): n for n in items if n.startswith("exit-") and n in costs}
                if not exits:
                    row.update(expected_speedup=None, reason="no early-exit draft step was timed")
                    out.append(row)
                    continue
                chosen = min(exits, key=lambda e: abs(e / gpu_layers - plan["exit_fraction"]))
                draft_ms, exit_share = costs[exits[chosen]], chosen / gpu_layers
                row["gpu_exit_layer"] = chosen
            elif plan["kind"] == "precision":
                draft_ms = costs.get("precision-int8")
                if draft_ms is None:
                    reason = items.get("precision-int8", {}).get("unsupported", "not timed")
                    row.update(expected_speedup=None, reason=f"no precision draft step on this GPU: {reason}")
                    out.append(row)
                    continue
            rounds = 0
            kernel_ms = plan["model_tokens"] * draft_ms
            for width, count in plan["widths"].items():  # verify width -> rounds
                w = int(width)
                full = verify_ms(costs, w)
                kernel_ms += count * (
                    exit_share * step + (1 - exit_share) * full if plan["kind"] == "early_exit" and w > 1 else full
                )
                rounds += count
            tokens = plan["tokens"]
            row.update(
                cpu_mean_accepted=plan["mean_accepted"],
                cpu_drafted_per_round=plan["drafted_per_round"],
                cpu_layers=layers,
                expected_speedup=round(tokens * step / kernel_ms, 3),
            )
            if "plain" in host and "oracle" in host:  # a negative host time (kernels faster in a round) counts as none
                plain_host, round_host = max(host["plain"], 0.0), max(host["oracle"], 0.0)
                with_host = tokens * (step + plain_host) / (kernel_ms + rounds * round_host)
                row["expected_speedup_with_host"] = round(with_host, 3)
            out.append(row)
    return out


# -- acceptance on a real model (CPU) ---------------------------------------------------------------------------
def real_plans(layers: int) -> dict:
    """The plan kinds a build chooses from (``passes/``), at the draft lengths it starts from: n-gram lookup, early
    exits at L/4 and L/2 (shared head), the int8 precision self-draft alone and behind n-gram lookup."""
    from speccompile.runtime.artifact.manifest import DraftPlan

    model = {"model": {"max_draft": 6}}
    ngram = {"ngram": {"min": 2, "max": 4}}
    out = {
        "lookup": (DraftPlan.of(name="lookup", lookup=["ngram"], lookup_max_draft=8, sources=ngram), {"kind": "lookup"})
    }
    for f in EXIT_FRACTIONS:
        e = max(1, layers // f)
        plan = DraftPlan.of(name=f"exit-1/{f}", exit_layer=e, sources=model)
        out[plan.name] = (plan, {"kind": "early_exit", "exit_fraction": 1 / f, "exit_layer": e})
    precision = dict(kind="precision", params={"precision": "int8"})
    out["precision"] = (DraftPlan.of(name="precision", sources=model, **precision), {"kind": "precision"})
    out["precision+lookup"] = (
        DraftPlan.of(
            name="precision+lookup", lookup=["ngram"], lookup_max_draft=8, sources={**model, **ngram}, **precision
        ),
        {"kind": "precision"},
    )
    return out


def smollm2_prompts(folder: Path, count: int) -> tuple[list[list[int]], frozenset[int], str]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    lines = (REPO / "benchmarks" / "data" / "smollm2_prompts.jsonl").read_text().splitlines()
    texts = [json.loads(line)["prompt"] for line in lines if line.strip()][:count]
    config = json.loads((folder / "config.json").read_text())
    eos = config.get("eos_token_id")
    eos_ids = frozenset(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return [tokenizer.encode(t, add_special_tokens=False).ids for t in texts], eos_ids, "SmolLM2-135M-Instruct"


def measure_acceptance(args) -> dict:
    """Every real plan decoded greedily on a real model on the CPU (``--smoke``: the tiny random model): per plan the
    tokens its rounds brought, its verify widths and its model draft steps, which ``expected_rows`` prices."""
    import torch

    from speccompile.runtime.backends.torch.backend import TorchBackend
    from speccompile.runtime.decoding.speculative import DecodeRequest, decode_all
    from speccompile.runtime.drafting.plan import read_plan

    if args.smoke:
        decoder = random_decoder(SHAPES["smoke"], torch.device("cpu"), torch.float32, seed=args.seed)
        rng = np.random.default_rng(args.seed)
        base = rng.integers(0, SHAPES["smoke"].vocab, 12).tolist()
        prompts = [base + base[: 4 + i] for i in range(args.prompts)]  # repeats, so n-gram lookup finds matches
        eos_ids, model = frozenset(), "smoke (tiny random model)"
    else:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from smollm2 import ensure_model
        from transformers import AutoModelForCausalLM

        from speccompile.convert import arch_config as hf_arch_config
        from speccompile.convert import canonical_weights
        from speccompile.runtime.backends.torch.decoder import build_decoder

        folder = ensure_model()
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        config = hf_arch_config(hf)
        decoder = build_decoder(config, canonical_weights(hf, config))
        del hf
        prompts, eos_ids, model = smollm2_prompts(folder, args.prompts)
    backend = TorchBackend(decoder, device="cpu")
    layers = backend.config.num_layers
    result = {"model": model, "device": "cpu", "new_tokens": args.new_tokens, "prompts": len(prompts), "plans": {}}
    for name, (plan, meta) in real_plans(layers).items():
        read = read_plan(plan, layers)
        reasons = [backend.unsupported(s) for s in read.kind.segments()] if read.has_model_part else []
        reason = next((r for r in reasons if r), None)
        entry = {**meta, "layers": layers}
        if reason is not None:
            log(f"acceptance {name}: not run: {reason}")
            result["plans"][name] = {**entry, "unsupported": reason}
            continue
        widths: dict[int, int] = {}
        tokens = model_tokens = rounds = drafted = 0
        for prompt in prompts:
            request = DecodeRequest(list(prompt), args.new_tokens, eos_ids=eos_ids)
            produced, stats = decode_all(backend, request, plan)
            for n, accepted in stats.round_log:
                widths[n + 1] = widths.get(n + 1, 0) + 1
                tokens += accepted + 1
            model_tokens += stats.per_source.get("model", [0, 0])[0]
            rounds += stats.rounds
            drafted += stats.drafted
        entry.update(
            tokens=tokens,
            rounds=rounds,
            model_tokens=model_tokens,
            widths={str(w): c for w, c in sorted(widths.items())},
            mean_accepted=round(tokens / max(rounds, 1), 4),
            drafted_per_round=round(drafted / max(rounds, 1), 4),
        )
        result["plans"][name] = entry
        log(f"acceptance {name}: {entry['mean_accepted']} tokens a round, {entry['drafted_per_round']} drafted")
    return result


# -- printing ---------------------------------------------------------------------------------------------------
def print_tables(rows: list) -> None:
    costs = [r for r in rows if r["kind"] == "cost"]
    if costs:
        print("\ncosts (GPU time per call, median of turns; vs the plain step at the same batch)")
        print(f"{'shape':<14} {'batch':>5} {'item':<16} {'tokens':>6} {'ms':>9} {'vs step':>8}")
        for r in costs:
            if r.get("ms") is None:
                print(f"{r['shape']:<14} {r['batch']:>5} {r['item']:<16} {'':>6} {'-':>9} {'':>8}  {r['unsupported']}")
            else:
                print(
                    f"{r['shape']:<14} {r['batch']:>5} {r['item']:<16} {r['tokens']:>6} {r['ms']:>9.3f} {r['vs_step']:>7.2f}x"
                )
    rounds = [r for r in rows if r["kind"] == "round"]
    if rounds:
        print("\nrounds: the oracle drafter (known continuation, each position right with probability a) vs plain")
        print(
            f"{'shape':<14} {'batch':>5} {'engine':<10} {'tok/s':>9} {'speedup':>8} {'ms/round':>9} {'host ms':>8} "
            f"{'host %':>6} {'tau':>6} {'drafted':>7} {'equal':>6} path"
        )
        for r in rounds:
            engine = "plain" if r["engine"] == "plain" else f"a={r['acceptance']}"
            host = "-" if r["host_ms_per_round"] is None else f"{r['host_ms_per_round']:.3f}"
            share = "-" if r.get("host_share") is None else f"{100 * r['host_share']:.1f}"
            tau = f"{r['mean_accepted']:.2f}" if "mean_accepted" in r else ""
            drafted = f"{r['drafted_per_round']:.2f}" if "drafted_per_round" in r else ""
            equal = "" if "equal_to_plain" not in r else ("yes" if r["equal_to_plain"] else "NO")
            print(
                f"{r['shape']:<14} {r['batch']:>5} {engine:<10} {r['tokens_per_s']:>9.1f} {r['speedup']:>7.2f}x "
                f"{r['round_ms']:>9.3f} {host:>8} {share:>6} {tau:>6} {drafted:>7} {equal:>6} {r['path']}"
            )
            if r.get("first_difference"):
                d = r["first_difference"]
                print(
                    f"{'':>21}first difference: prompt {d['prompt']}, token {d['token']}, plain's top-2 gap there "
                    f"{d['plain_top2_gap']:.4g}"
                )
    expected = [r for r in rows if r["kind"] == "expected"]
    if expected:
        print(f"\nexpected speedups of the real plans: {LABEL}")
        print(f"{'shape':<14} {'batch':>5} {'plan':<18} {'cpu tau':>8} {'expected':>9} {'with host':>10}")
        for r in expected:
            if r.get("expected_speedup") is None:
                print(f"{r['shape']:<14} {r['batch']:>5} {r['plan']:<18} {'':>8} {'-':>9} {'':>10}  {r['reason']}")
                continue
            host = r.get("expected_speedup_with_host")
            print(
                f"{r['shape']:<14} {r['batch']:>5} {r['plan']:<18} {r['cpu_mean_accepted']:>8.2f} "
                f"{r['expected_speedup']:>8.2f}x {'' if host is None else f'{host:.2f}x':>10}"
            )
    for r in rows:
        if r["kind"] == "skipped":
            print(f"skipped: {r['what']}: {r['reason']}")
        if r["kind"] == "error":
            print(f"FAILED: {r['what']}: {r['error']}")


# -- main ---------------------------------------------------------------------------------------------------------
def attempt(what: str, rows: list, save: Callable[[], None], fn: Callable, **where):
    """``fn()``, or None after an exception, which becomes an ``error`` row (its traceback on stderr) while the next
    phase still runs: one GPU run must bring back every row it could measure. The rows so far are saved either way
    (a run cut off by its time cap keeps them)."""
    try:
        return fn()
    except Exception as error:
        traceback.print_exc(file=sys.stderr)
        message = str(error).splitlines()[0][:300] if str(error) else ""
        rows.append({"kind": "error", "what": what, "error": f"{type(error).__name__}: {message}", **where})
        log(f"{what}: failed: {type(error).__name__}: {message}")
        return None
    finally:
        save()


def run_shape(key: str, args, rows: list, budget: Budget, save: Callable[[], None]) -> None:
    import torch

    smoke = key == "smoke"
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    shape = SHAPES[key]
    if not budget.fits(f"{shape.name}: the model", 15.0 if not smoke else 1.0, shape=shape.name):
        return
    started = time.monotonic()

    def build():
        backend = open_backend(random_decoder(shape, device, dtype, seed=args.seed), device, smoke)
        longest = max(args.context + max(VERIFY_K) + 1, args.prompt_tokens + args.new_tokens + ORACLE_K + 1)
        backend.reserve(longest, slots=max(BATCHES))  # one cache for every row: no graph is captured twice
        return backend

    backend = attempt(f"{shape.name}: the model", rows, save, build, shape=shape.name)
    if backend is None:
        return
    clock = Clock(device)
    info = {
        "kind": "shape",
        "shape": shape.name,
        "layers": shape.layers,
        "hidden": shape.hidden,
        "vocab": shape.vocab,
        "dtype": str(dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda_graphs": backend.graphed,
        "build_s": round(time.monotonic() - started, 1),
    }
    rows.append(info)
    log(f"{shape.name}: built in {info['build_s']} s on {info['device']} ({info['dtype']})")
    cost_rows: dict[int, list] = {}
    for batch in BATCHES:
        step_ms = next((r["ms"] for r in cost_rows.get(1, []) if r["item"] == "step"), None)
        estimate = 5.0 if step_ms is None else (args.repeats + 4) * 12 * step_ms * (3 if batch > 1 else 1) / 1000 + 2
        if not budget.fits(f"{shape.name} batch {batch}: costs", estimate, shape=shape.name, batch=batch):
            continue
        measured = attempt(
            f"{shape.name} batch {batch}: costs",
            rows,
            save,
            lambda: measure_costs(backend, shape, batch, args.context, args.repeats, clock, args.seed),
            shape=shape.name,
            batch=batch,
        )
        if measured is not None:
            cost_rows[batch] = measured
            rows.extend(measured)
            save()
            log(f"{shape.name} batch {batch}: costs timed")
    for batch in BATCHES:
        step_ms = next((r["ms"] for r in cost_rows.get(batch, []) if r["item"] == "step"), None)
        # plain once untimed + plain and four oracles timed, per repetition; batched rounds also read their logits back
        per_token = (step_ms or 5.0) * (2.0 if batch > 1 else 1.5) / 1000
        tokens = args.new_tokens if batch == 1 else args.batch_new_tokens
        warmup = len(WARMUP[batch > 1]) * min(tokens, WARMUP_TOKENS[batch > 1]) * per_token
        reps = args.reps  # fewer repetitions where all of them would not fit; at least one, or skipped
        while reps > 1 and reps * 6 * tokens * per_token + warmup + 2 > budget.left():
            reps -= 1
        if reps < args.reps:
            log(f"{shape.name} batch {batch}: rounds: {reps} repetition(s) of {args.reps}, to fit the budget")
        estimate = reps * 6 * tokens * per_token + warmup + 2
        if not budget.fits(f"{shape.name} batch {batch}: rounds", estimate, shape=shape.name, batch=batch):
            continue
        costs = {r["item"]: r["ms"] for r in cost_rows.get(batch, []) if r.get("ms") is not None} or None
        found = attempt(
            f"{shape.name} batch {batch}: rounds",
            rows,
            save,
            lambda: real_rounds(backend, shape, batch, args, costs, budget, reps),
            shape=shape.name,
            batch=batch,
        )
        rows.extend(found or [])
        save()
    backend = None  # the weights, cache and graphs go before the next shape's
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1b", help="comma-separated: 1b, 8b (default 1b)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, every code path, seconds")
    parser.add_argument("--json", type=Path, default=None, help="write every row to this JSON file")
    parser.add_argument("--budget", type=float, default=None, help="seconds: skip what would not fit, and say so")
    parser.add_argument("--acceptance", type=Path, default=None, help="a --measure-acceptance JSON: expected speedups")
    parser.add_argument(
        "--measure-acceptance", action="store_true", help="on the CPU: each real plan's acceptance on SmolLM2-135M"
    )
    parser.add_argument("--prompts", type=int, default=12, help="--measure-acceptance: prompts (default 12)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens per sequence (default 128; 96 measuring)")
    parser.add_argument("--batch-new-tokens", type=int, default=64, help="rounds at batch 16: tokens per sequence")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="rounds: random prompt length")
    parser.add_argument("--reps", type=int, default=3, help="rounds: repetitions in turns, each with its own prompts")
    parser.add_argument("--repeats", type=int, default=30, help="costs: timed calls of each item")
    parser.add_argument("--context", type=int, default=256, help="costs: positions in the cache before each call")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows: list[dict] = []
    budget = Budget(args.budget, rows)
    if args.smoke:  # the CPU's product-form timing (cpu_linear.py) is no path a GPU runs: F.linear, untimed
        os.environ.setdefault("SPECCOMPILE_CPU_LINEAR", "standard")
    if args.measure_acceptance:
        if args.new_tokens is None:
            args.new_tokens = 16 if args.smoke else 96
        if args.smoke:
            args.prompts = min(args.prompts, 2)
        result = measure_acceptance(args)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result, indent=1))
        return 0
    if args.smoke:
        keys = ["smoke"]
        args.new_tokens = args.new_tokens or 16
        args.batch_new_tokens = min(args.batch_new_tokens, 12)
        args.repeats, args.reps = min(args.repeats, 2), min(args.reps, 1)
        args.context = min(args.context, 32)
    else:
        import torch

        keys = [k.strip() for k in args.shape.split(",") if k.strip()]
        unknown = [k for k in keys if k not in SHAPES or k == "smoke"]
        if unknown:
            parser.error(f"unknown shape(s) {unknown}; choose from 1b, 8b (or --smoke)")
        if not torch.cuda.is_available():
            parser.error("no CUDA GPU visible to torch; use --smoke to run the same code paths on the CPU")
        args.new_tokens = args.new_tokens or 128

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps({"benchmark": "gpu_shapes", "label": LABEL, "rows": rows}, indent=1) + "\n")

    for key in keys:
        run_shape(key, args, rows, budget, save)
    if args.acceptance is not None:
        acceptance = json.loads(args.acceptance.read_text())
        cost_rows = [r for r in rows if r["kind"] == "cost"]
        rows.extend(expected_rows(cost_rows, [r for r in rows if r["kind"] == "round"], acceptance))
    save()
    print_tables(rows)
    return 1 if any(r["kind"] == "error" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
