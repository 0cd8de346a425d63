"""Plain greedy decoding on ONNX Runtime against the memory-bandwidth floor: speccompile's standard and
fused graphs (fp32, int8, int4) and onnxruntime-genai (fp32, int4) on the same prompts, plus held-out loss
per precision.

    python benchmarks/experiments/onnx_plain.py ARTIFACT [--threads 2] [--new-tokens 64] [--genai-venv DIR]
                                                [--genai-models DIR] [--rounds 3] [--loss-text FILE] [--refcoder]
                                                [--sweep] [--lossless]

ARTIFACT is a SmolLM2 artifact built with ``--backend torch,onnx`` (its canonical weights are re-exported
here, so every variant has the same weights and plans): ``standard`` (ONNX ops only, past KV copied into
each call), ``fused`` (ONNX Runtime contrib ops, KV cache in place) and ``fused`` with ``--quantize
int8`` / ``int4`` (written into ``ARTIFACT-variants/``, the same exporter ``build --quantize`` runs).
Plain decoding runs the ``verify`` graph alone. Figures per row: tokens/s over the 10 prompts (prefill
included), the median 1-token step, the bytes one step reads (every weight a non-Gather node consumes,
plus the KV cache at the step's position) divided by the step time, and that as a fraction of
``--bandwidth`` (this machine's ~80 GB/s), and as a fraction of what ``--threads`` threads can
read here at all (``read_bandwidth``: ~28-31 GB/s for 2 threads on this machine).

The acceptance rows, fused fp32 and int4 against onnxruntime-genai's fp32 and int4, are timed in turns
(``--rounds`` rounds of the prompts, each prompt decoded by one and then the other, the order rotating):
this machine's speed drifts by 10-40% between minutes, so rows timed one after the other can differ by
more than the engines do. onnxruntime-genai runs in its own virtual environment (its model builder
needs transformers >= 5; this project pins < 4.58): ``--genai-venv`` (created with ``--system-site-packages`` and
``pip install onnxruntime-genai onnx_ir "transformers>=5,<6"`` when missing); its models are built from
the HF folder the artifact came from, into ``--genai-models``. Every timing run is meant to be wrapped in
``flock /tmp/speccompile-timing.lock``.

Held-out loss (mean next-token cross-entropy, nats) is measured through the same ORT backend in one
teacher-forced pass per chunk: SmolLM2 on ``--loss-text`` (default: this repository's README.md,
written after SmolLM2's training data was collected), and with ``--refcoder`` the bundled reference
model on its own held-out sample (models/refcoder/heldout_sample.txt).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent.parent  # this script is in benchmarks/experiments/
sys.path.insert(0, str(REPO / "benchmarks"))
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain photosynthesis in simple terms.",
    "Once upon a time, in a small village,",
    "What are the benefits of regular exercise?",
    "Translate to French: Good morning, how are you?",
    "List three uses of machine learning in medicine.",
    "The history of the Roman Empire",
    "How do I make a cup of tea?",
]
# (name, export options); the int4 block size and accuracy level are the --sweep's choice on this machine
VARIANTS = {
    "standard fp32": {"variant": "standard"},
    "fused fp32": {"variant": "fused"},
    "fused fp32 unpacked": {"variant": "fused", "pack": False},  # q/k/v and gate/up as separate matmuls
    "fused int8": {"variant": "fused", "quantize": "int8", "block_size": 32, "accuracy_level": 4},
    "fused int4": {"variant": "fused", "quantize": "int4", "block_size": 32, "accuracy_level": 4},
}


# -- artifacts ------------------------------------------------------------------------------------------
from verify_curve import derive  # noqa: E402  (an artifact with its ONNX graphs re-exported; verify_curve uses it too)


def step_bytes(root: Path, graph: str = "verify") -> int:
    """Bytes of weights one step of ``graph`` reads: every initializer a node other than Gather consumes
    (a Gather reads one embedding row)."""
    import onnx

    from speccompile.runtime.artifact.manifest import read_manifest

    record = read_manifest(root, verify_files=False).backends["onnx"]
    model = onnx.load(str(root / record["graphs"][graph]["file"]), load_external_data=False)
    names = {i.name for i in model.graph.initializer}
    read = {x for n in model.graph.node if n.op_type != "Gather" for x in n.input if x in names}
    return sum(record["tensors"][n]["nbytes"] for n in read)


# -- speccompile plain decoding ---------------------------------------------------------------------------
class StepTimer:
    """The backend protocol, timing each 1-token ``forward`` (a plain decode step)."""

    def __init__(self, backend):
        self.backend, self.steps = backend, []

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def forward(self, tokens, pos):
        start = time.perf_counter()
        out = self.backend.forward(tokens, pos)
        if len(tokens) == 1:
            self.steps.append((time.perf_counter() - start, pos))
        return out


class PlainDecoder:
    """speccompile's plain greedy decoding of an artifact's ``verify`` graph on ONNX Runtime, prompt by prompt,
    timing every 1-token step."""

    def __init__(self, root: Path, threads: int, **kwargs):
        from speccompile.runtime.artifact.manifest import read_manifest
        from speccompile.runtime.backends.onnx import OnnxBackend

        self.root = root
        self.manifest = read_manifest(root, verify_files=False)
        backend = OnnxBackend(
            root, self.manifest.backends["onnx"], self.manifest.config, threads=threads, roles=["verify"], **kwargs
        )
        self.timer = StepTimer(backend)
        self.decode([1, 2, 3, 4], 8)  # warm-up
        self.timer.steps.clear()

    def decode(self, ids: list[int], new_tokens: int) -> tuple[list[int], float]:
        from speccompile.runtime.decoding.speculative import DecodeRequest, decode_all
        from speccompile.runtime.sampling import SamplingParams

        start = time.perf_counter()
        tokens, _ = decode_all(self.timer, DecodeRequest(ids, new_tokens, SamplingParams(), frozenset(), None), None)
        return tokens, time.perf_counter() - start

    def row(self, outputs: list[list[int]], seconds: float) -> dict:
        steps = self.timer.steps
        return table_row(
            outputs,
            seconds,
            [t for t, _ in steps],
            [p for _, p in steps],
            step_bytes(self.root),
            kv_bytes_per_position(self.manifest.config),
        )


def kv_bytes_per_position(config) -> int:
    """Bytes of float32 K and V one position holds, over all layers."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4


def table_row(
    outputs: list[list[int]],
    seconds: float,
    steps: list[float],
    positions: list[int],
    weight_bytes: int,
    kv_per_position: float,
) -> dict:
    """A row: tokens/s over the prompts, the median 1-token step, and the bytes one step reads (the weights,
    plus the KV cache at the steps' mean position)."""
    kv = kv_per_position * float(np.mean(positions)) if positions else 0.0
    return {
        "tokens_per_s": sum(map(len, outputs)) / seconds,
        "ms_per_step": float(np.median(steps)) * 1e3,
        "bytes_per_step": weight_bytes + kv,
        "outputs": outputs,
    }


def run_plain(root: Path, prompt_ids: list[list[int]], new_tokens: int, threads: int, **kwargs) -> dict:
    decoder = PlainDecoder(root, threads, **kwargs)
    outputs, seconds = [], 0.0
    for ids in prompt_ids:
        tokens, elapsed = decoder.decode(ids, new_tokens)
        outputs.append(tokens)
        seconds += elapsed
    return decoder.row(outputs, seconds)


def heldout_loss(root: Path, ids: list[int], threads: int, chunk: int = 512) -> float:
    """Mean next-token cross-entropy (nats) of ``ids`` in teacher-forced chunks of ``chunk`` tokens."""
    from speccompile.runtime.artifact.manifest import read_manifest
    from speccompile.runtime.backends.onnx import OnnxBackend

    manifest = read_manifest(root, verify_files=False)
    backend = OnnxBackend(root, manifest.backends["onnx"], manifest.config, threads=threads, roles=["verify"])
    backend.reserve(chunk)
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, chunk):
        piece = ids[start : start + chunk + 1]
        if len(piece) < 2:
            break
        logits = backend.forward(piece[:-1], 0).astype(np.float64)
        top = logits.max(-1, keepdims=True)
        logz = np.log(np.exp(logits - top).sum(-1)) + top[:, 0]
        total += float((logz - logits[np.arange(len(piece) - 1), piece[1:]]).sum())
        count += len(piece) - 1
    return total / count


# -- onnxruntime-genai ------------------------------------------------------------------------------------
_GENAI_WORKER = r"""
import json, sys, time
import numpy as np
import onnxruntime_genai as og
folder, new_tokens = sys.argv[1], int(sys.argv[2])
model = og.Model(folder)
def generate(ids, n):
    params = og.GeneratorParams(model)
    # min_length: exactly n new tokens, as speccompile's rows decode (no EOS stop); without it 5 of the 10
    # prompts end at EOS after 1 token, and the row's tokens/s is mostly prefill
    params.set_search_options(do_sample=False, max_length=len(ids) + n, min_length=len(ids) + n, batch_size=1)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array(ids, dtype=np.int32))
    out, steps = [], []
    while not gen.is_done() and len(out) < n:
        t = time.perf_counter()
        gen.generate_next_token()
        steps.append(time.perf_counter() - t)
        out.append(int(gen.get_next_tokens()[0]))
    return out, steps[1:]
generate([1, 2, 3, 4], 8)
print(json.dumps({"version": og.__version__}), flush=True)
for line in sys.stdin:
    ids = json.loads(line)
    start = time.perf_counter()
    out, steps = generate(ids, new_tokens)
    print(json.dumps({"tokens": out, "seconds": time.perf_counter() - start, "steps": steps}), flush=True)
"""


_SPECCOMPILE_WORKER = r"""
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[4])
from onnx_plain import PlainDecoder
root, new_tokens, threads = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
decoder = PlainDecoder(root, threads)
print(json.dumps({"version": "speccompile"}), flush=True)
for line in sys.stdin:
    done = len(decoder.timer.steps)
    out, seconds = decoder.decode(json.loads(line), new_tokens)
    steps = decoder.timer.steps[done:]
    print(json.dumps({"tokens": out, "seconds": seconds, "steps": [t for t, _ in steps],
                      "positions": [p for _, p in steps]}), flush=True)
"""


class DecodeWorker:
    """A plain greedy decoder in a process of its own (onnxruntime-genai's in its own virtual environment,
    speccompile's in this interpreter), decoding one prompt per request: two engines in two fresh
    processes, timed in turns (``in_turns``), meet the machine on equal terms."""

    def __init__(
        self, argv: list[str], label: str, new_tokens: int, step_bytes: int, kv_bytes_per_position: float = 0.0
    ):
        self.label, self.new_tokens = label, new_tokens
        self.step_bytes, self.kv_bytes_per_position = step_bytes, kv_bytes_per_position
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.version = self._reply()["version"]
        self.steps: list[float] = []
        self.positions: list[int] = []

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.label} decoding worker exited with code {self.proc.wait()}")
        return json.loads(line)

    def decode(self, ids: list[int], new_tokens: int) -> tuple[list[int], float]:
        assert new_tokens == self.new_tokens
        self.proc.stdin.write(json.dumps(ids) + "\n")
        self.proc.stdin.flush()
        reply = self._reply()
        self.steps += reply["steps"]
        self.positions += reply.get("positions", [])
        return reply["tokens"], reply["seconds"]

    def row(self, outputs: list[list[int]], seconds: float) -> dict:
        return table_row(outputs, seconds, self.steps, self.positions, self.step_bytes, self.kv_bytes_per_position)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def speccompile_worker(root: Path, new_tokens: int, threads: int) -> DecodeWorker:
    from speccompile.runtime.artifact.manifest import read_manifest

    config = read_manifest(root, verify_files=False).config
    argv = [
        sys.executable,
        "-c",
        _SPECCOMPILE_WORKER,
        str(root),
        str(new_tokens),
        str(threads),
        str(Path(__file__).parent),
    ]
    return DecodeWorker(argv, "speccompile", new_tokens, step_bytes(root), kv_bytes_per_position(config))


def genai_worker(python: Path, folder: Path, new_tokens: int) -> DecodeWorker:
    argv = [str(python), "-c", _GENAI_WORKER, str(folder), str(new_tokens)]
    return DecodeWorker(argv, "onnxruntime-genai", new_tokens, genai_step_bytes(folder))


def genai_step_bytes(folder: Path) -> int:
    """Bytes of weights one onnxruntime-genai step reads (as ``step_bytes``: initializers of non-Gather nodes)."""
    import onnx

    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    sizes = {
        i.name: int(np.prod(i.dims, dtype=np.int64)) * onnx.helper.tensor_dtype_to_np_dtype(i.data_type).itemsize
        for i in model.graph.initializer
    }
    gathers = ("Gather", "GatherBlockQuantized")
    return sum(
        sizes[x] for x in {x for n in model.graph.node if n.op_type not in gathers for x in n.input if x in sizes}
    )


def in_turns(decoders: dict, prompt_ids: list[list[int]], new_tokens: int, rounds: int) -> dict[str, dict]:
    """Every decoder decodes every prompt ``rounds`` times, prompt by prompt in turns (the order rotating),
    so that the machine's drifting speed weighs on each alike: the speed ratio of one run. A pause before
    each prompt lets the previous decoder's ONNX Runtime threads stop spinning. Outputs: the first round."""
    names = list(decoders)
    seconds = dict.fromkeys(names, 0.0)
    outputs: dict[str, list] = {name: [] for name in names}
    for r in range(rounds):
        for i, ids in enumerate(prompt_ids):
            shift = (r * len(prompt_ids) + i) % len(names)
            for name in names[shift:] + names[:shift]:
                time.sleep(0.1)
                tokens, elapsed = decoders[name].decode(ids, new_tokens)
                seconds[name] += elapsed
                outputs[name].append(tokens)
    rows = {}
    for name in names:
        rows[name] = decoders[name].row(outputs[name], seconds[name])
        rows[name]["outputs"] = outputs[name][: len(prompt_ids)]
    return rows


def genai_python(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.is_file():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
        subprocess.run(
            [
                str(python),
                "-m",
                "pip",
                "install",
                "--quiet",
                "onnxruntime-genai>=0.18,<1",
                "onnx_ir",
                "transformers>=5,<6",
            ],
            check=True,
        )
    return python


def genai_model(python: Path, hf_folder: Path, out: Path, precision: str, threads: int) -> Path:
    """Build (once) an onnxruntime-genai CPU model with its own builder; pin its intra-op threads."""
    if not (out / "genai_config.json").is_file():
        subprocess.run(
            [
                str(python),
                "-m",
                "onnxruntime_genai.models.builder",
                "-m",
                hf_folder.name,
                "-i",
                str(hf_folder),
                "-o",
                str(out),
                "-p",
                precision,
                "-e",
                "cpu",
                "-c",
                str(out) + ".cache",
            ],
            check=True,
            cwd=out.parent,
            capture_output=True,
        )
    config_path = out / "genai_config.json"
    config = json.loads(config_path.read_text())
    config["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = threads
    config_path.write_text(json.dumps(config, indent=4))
    return out


# -- speculative == plain on the quantized models ---------------------------------------------------------
def rounding_gap(backend, prompt_ids: list[list[int]], k: int = 4) -> float:
    """Largest |logit| difference between a k-token verify call and k 1-token steps over the same positions:
    how far the two kernel paths round apart. A greedy divergence needs a top-2 gap below twice this."""
    worst = 0.0
    for ids in prompt_ids:
        backend.reserve(len(ids) + k)
        backend.forward(ids[:-k], 0)
        together = backend.forward(ids[-k:], len(ids) - k)
        apart = np.stack([backend.forward([t], len(ids) - k + j)[-1] for j, t in enumerate(ids[-k:])])
        worst = max(worst, float(np.abs(together - apart).max()))
    return worst


def lossless(root: Path, prompt_ids: list[list[int]], new_tokens: int, threads: int) -> dict:
    """Speculative greedy output (the artifact's default plan) against the same model's plain greedy output:
    prompts that differ, and the plain model's top-2 logit gap at each divergence."""
    from speccompile.runtime.artifact.manifest import read_manifest
    from speccompile.runtime.backends.onnx import OnnxBackend
    from speccompile.runtime.decoding.speculative import DecodeRequest, decode_all
    from speccompile.runtime.drafting import check_plans
    from speccompile.runtime.sampling import SamplingParams

    manifest = read_manifest(root, verify_files=False)
    plans = check_plans(manifest)
    backend = OnnxBackend.from_artifact(root, manifest, plans, threads=threads)
    plan = plans[manifest.default_plan or next(iter(manifest.plans))]
    probe = backend.replica()
    gaps, accepted, rounds = [], 0, 0
    for ids in prompt_ids:
        request = DecodeRequest(ids, new_tokens, SamplingParams(), frozenset(), None)
        plain, _ = decode_all(backend, request, None)
        spec, stats = decode_all(backend, request, plan)
        accepted, rounds = accepted + stats.accepted, rounds + stats.rounds
        if spec != plain:
            i = next((j for j, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
            probe.reserve(len(ids) + i + 1)
            top = np.sort(probe.forward(ids + plain[:i], 0)[-1])[-2:]
            gaps.append(float(top[1] - top[0]))
    return {
        "plan": plan.name,
        "diverging_prompts": len(gaps),
        "largest_gap_at_divergence": max(gaps, default=None),
        "rounding_gap": rounding_gap(backend, prompt_ids),
        "accepted_per_round": accepted / max(rounds, 1),
    }


# -- main -------------------------------------------------------------------------------------------------
def refcoder_losses(variants_dir: Path, threads: int) -> dict[str, float]:
    """Held-out loss of the bundled reference model per precision (ONNX graphs exported from its weights)."""
    from speccompile.convert import arch_config, canonical_weights
    from speccompile.exporters.onnx_export import export_onnx_weights
    from speccompile.loading import load_source
    from speccompile.runtime.artifact.manifest import Manifest, file_record, write_manifest

    source = load_source("refcoder")
    config = arch_config(source.model)
    weights = canonical_weights(source.model, config)
    ids = source.tokenizer((REPO / "models" / "refcoder" / "heldout_sample.txt").read_text())["input_ids"]
    losses = {}
    for name, options in VARIANTS.items():
        root = variants_dir / ("refcoder-" + name.replace(" ", "-"))
        if not (root / "manifest.json").is_file():
            (root / "tokenizer").mkdir(parents=True, exist_ok=True)
            source.tokenizer.save_pretrained(root / "tokenizer")
            record = export_onnx_weights(config, weights, {}, root / "onnx", "float32", **options)
            files = {
                str(p.relative_to(root)): file_record(root, str(p.relative_to(root)))
                for p in sorted(root.rglob("*"))
                if p.is_file()
            }
            write_manifest(
                root, Manifest(config=config, plans={}, default_plan=None, files=files, backends={"onnx": record})
            )
        losses[name] = heldout_loss(root, ids, threads, chunk=min(512, config.max_position_embeddings))
    return losses


def sweep(artifact: Path, variants_dir: Path, prompt_ids, new_tokens: int, threads: int, loss_ids) -> None:
    """int4 / int8 block size x accuracy level: step time and held-out loss (how VARIANTS was chosen)."""
    # int8 at accuracy level 0 has no fast CPU kernel in onnxruntime 1.32 (~450 ms a step here): not swept
    grid = [("int4", 32, 0), ("int4", 32, 4), ("int4", 64, 4), ("int4", 128, 4), ("int8", 32, 4)]
    for scheme, block, level in grid:
        options = {"variant": "fused", "quantize": scheme, "block_size": block, "accuracy_level": level}
        root = derive(artifact, variants_dir / f"{scheme}-b{block}-a{level}", options)
        row = run_plain(root, prompt_ids[:3], new_tokens, threads)
        loss = heldout_loss(root, loss_ids, threads)
        print(
            f"sweep {scheme} block {block:4d} accuracy_level {level}: {row['tokens_per_s']:6.1f} tok/s, "
            f"{row['ms_per_step']:6.2f} ms/step, held-out loss {loss:.4f}",
            flush=True,
        )


def read_bandwidth(threads: int, nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Bytes/s that ``threads`` threads reach reading one large float32 array (numpy sums, one slice per
    thread; numpy releases the GIL): what a ``threads``-thread matmul-vector step can hope for here,
    usually far below the socket's bandwidth when only a few cores stream."""
    import threading

    data = np.ones(nbytes // 4, dtype=np.float32)
    parts = np.array_split(data, threads)
    data.sum()

    def read(part):
        for _ in range(repeats):
            part.sum()

    workers = [threading.Thread(target=read, args=(part,)) for part in parts]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return nbytes * repeats / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--bandwidth", type=float, default=80e9, help="memory bandwidth floor, bytes/s")
    parser.add_argument("--genai-venv", type=Path, default=Path("/tmp/speccompile-genai-venv"))
    parser.add_argument("--genai-models", type=Path, default=None, help="default: ARTIFACT-variants/")
    parser.add_argument("--no-genai", action="store_true")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the prompts timed in turns with genai")
    parser.add_argument("--loss-text", type=Path, default=REPO / "README.md")
    parser.add_argument("--refcoder", action="store_true", help="also the reference model's held-out loss")
    parser.add_argument("--sweep", action="store_true", help="quantization block size / accuracy level sweep")
    parser.add_argument(
        "--lossless",
        action="store_true",
        help="speculative vs plain greedy output and kernel rounding per variant (no timing)",
    )
    args = parser.parse_args()

    from tokenizers import Tokenizer

    from speccompile.runtime.artifact.manifest import read_manifest

    artifact = args.artifact.resolve()
    variants_dir = artifact.with_name(artifact.name + "-variants")
    variants_dir.mkdir(exist_ok=True)
    tokenizer = Tokenizer.from_file(str(artifact / "tokenizer" / "tokenizer.json"))
    prompt_ids = [tokenizer.encode(p).ids for p in PROMPTS]
    loss_ids = tokenizer.encode(args.loss_text.read_text()).ids
    if args.sweep:
        sweep(artifact, variants_dir, prompt_ids, args.new_tokens, args.threads, loss_ids)
        return
    if args.lossless:
        for name, options in VARIANTS.items():
            root = derive(artifact, variants_dir / name.replace(" ", "-"), options)
            print(f"{name}: {json.dumps(lossless(root, prompt_ids, args.new_tokens, args.threads))}", flush=True)
        return

    rows, outputs = [], {}
    attainable = read_bandwidth(args.threads)
    print(
        f"{args.threads}-thread read bandwidth here: {attainable / 1e9:.1f} GB/s (the floor's {args.bandwidth / 1e9:.0f} "
        "GB/s needs more cores streaming); fractions of both below",
        flush=True,
    )

    def report(name, row, loss=None):
        frac = (
            row["bytes_per_step"] / (row["ms_per_step"] / 1e3) / args.bandwidth if row.get("bytes_per_step") else None
        )
        rows.append((name, row, frac, loss))
        reached = row["bytes_per_step"] / (row["ms_per_step"] / 1e3) / attainable if frac else None
        moved = (
            (
                f"{row['bytes_per_step'] / 1e6:7.1f} MB/step, {frac:.2f} of {args.bandwidth / 1e9:.0f} GB/s, "
                f"{reached:.2f} of the {args.threads}-thread read bandwidth"
            )
            if frac
            else "(bytes per step not counted)"
        )
        print(
            f"{name:28s} {row['tokens_per_s']:7.1f} tok/s {row['ms_per_step']:7.2f} ms/step  {moved}"
            + (f"  held-out loss {loss:.4f}" if loss is not None else ""),
            flush=True,
        )

    for name, options in VARIANTS.items():
        root = derive(artifact, variants_dir / name.replace(" ", "-"), options)
        row = run_plain(root, prompt_ids, args.new_tokens, args.threads)
        outputs[name] = row["outputs"]
        report(f"speccompile ORT {name}", row, heldout_loss(root, loss_ids, args.threads))
        if name == "fused fp32":
            copy = run_plain(root, prompt_ids, args.new_tokens, args.threads, kv_in_place=False)
            report("  same graphs, KV copied", copy)
    if not args.no_genai:
        python = genai_python(args.genai_venv)
        hf_folder = Path(read_manifest(artifact, verify_files=False).source["path"])
        models = args.genai_models or variants_dir
        print(
            f"in turns with onnxruntime-genai ({args.rounds} rounds of the {len(prompt_ids)} prompts, prompt by "
            "prompt, the order rotating):",
            flush=True,
        )
        for precision, ours in (("fp32", "fused fp32"), ("int4", "fused int4")):
            folder = genai_model(python, hf_folder, models / f"genai-{precision}", precision, args.threads)
            decoders = {
                "ours": speccompile_worker(variants_dir / ours.replace(" ", "-"), args.new_tokens, args.threads),
                "genai": genai_worker(python, folder, args.new_tokens),
            }
            try:
                turns = in_turns(decoders, prompt_ids, args.new_tokens, args.rounds)
            finally:
                for worker in decoders.values():
                    worker.close()
            genai = decoders["genai"]
            outputs[f"genai {precision}"] = turns["genai"]["outputs"]
            report(f"speccompile ORT {ours}", turns["ours"])
            report(f"onnxruntime-genai {genai.version} {precision}", turns["genai"])
            ratio = turns["ours"]["tokens_per_s"] / turns["genai"]["tokens_per_s"]
            print(f"  speccompile / onnxruntime-genai, {precision}: {ratio:.3f}x tokens/s", flush=True)
    # compared before standard fp32's first EOS: speccompile's rows decode on past EOS, genai's (min_length)
    # cannot emit it
    eos = read_manifest(artifact, verify_files=False).eos_ids
    reference = [o[: next((i for i, t in enumerate(o) if t in eos), len(o))] for o in outputs["standard fp32"]]
    print(f"standard fp32 tokens before the first EOS: {[len(r) for r in reference]}")
    for name, outs in outputs.items():
        same = sum(a[: len(b)] == b for a, b in zip(outs, reference))
        whole = (
            ""
            if name.startswith("genai")
            else f", all {args.new_tokens} tokens: {sum(a == b for a, b in zip(outs, outputs['standard fp32']))}/{len(outs)}"
        )
        print(f"outputs equal to standard fp32 (before its first EOS): {name}: {same}/{len(reference)}{whole}")
    if args.refcoder:
        for name, loss in refcoder_losses(variants_dir, args.threads).items():
            print(f"refcoder held-out loss {name}: {loss:.4f}")
    print(
        f"(SmolLM2 held-out text: {args.loss_text}, {len(loss_ids)} tokens; {os.cpu_count()} CPUs, "
        f"{args.threads} threads)"
    )


if __name__ == "__main__":
    main()
