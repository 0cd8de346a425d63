"""Long inputs: time to first token, decode speed after it, and both speedups, plain against speculative.

    python benchmarks/long_context.py                                   # SmolLM2-135M, 256..7K tokens, torch and onnx
    python benchmarks/long_context.py --lengths 2048,7168 --backends onnx --json long.json
    python benchmarks/long_context.py --artifact torch=artifacts/a-torch,onnx=artifacts/a-onnx
    python benchmarks/long_context.py --smoke                           # the bundled refcoder, short inputs
    python benchmarks/long_context.py --lengths 256,2048,7168 --json long.json --record NAME   # README's long rows
    python benchmarks/long_context.py --lengths 2048,7168 --backends onnx --peers openvino   # and OpenVINO GenAI
    python benchmarks/long_context.py --lengths 2048,7168 --backends onnx --peers llamacpp   # and llama.cpp

The inputs are text nobody here wrote: the source of Python standard-library modules, read from the running
interpreter's standard-library folder (``sysconfig``). Two tasks at every length N:

- ``continue``: a module's first N tokens, continued (a source file to complete);
- ``qa``: a module cut so that, with a question about the first function defined in it (about the code when
  it defines none), the prompt is about N tokens (a document to ask about), in the model's chat template when
  the artifact has one.

Each input is decoded greedily, plainly and speculatively (the artifact's default plan, or ``--plan``), in
alternating turns in one process (plain then speculative for one input, speculative then plain for the next),
through the runtime's public API (``speccompile.runtime.load`` and ``stream``). Time to first token is the
time to the first streamed chunk (the prompt read, the first token picked); decode tokens/s counts the tokens
after the first over the time after it; the whole-request speedup is plain's time over speculative's for the
same inputs, prompt reading included. Every speculative output is compared with the plain one.

Prints one markdown table (a row per backend, task and length) and, with ``--json FILE``, writes the rows and
every request. Progress goes to stderr. Without ``--artifact`` the SmolLM2 artifacts ``artifacts/smollm2-torch``
and ``artifacts/smollm2-onnx`` are used, built as ``benchmarks/real_model.py`` builds them when missing.
``--smoke`` builds the bundled refcoder (one artifact, both backends, lookup plans only) into a temporary
folder and runs short inputs, so that CI runs the script end to end.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

# Standard-library modules large enough for 7K-token inputs, present in CPython 3.10 to 3.13. Continuations
# take the even ones, questions the odd ones, so the two tasks never share a text.
MODULES = [
    "argparse.py",
    "inspect.py",
    "tarfile.py",
    "typing.py",
    "subprocess.py",
    "pydoc.py",
    "doctest.py",
    "difflib.py",
    "logging/__init__.py",
    "unittest/mock.py",
    "mailbox.py",
    "configparser.py",
]
LENGTHS = [256, 1024, 2048, 4096, 7168]
SMOKE_LENGTHS = [128, 512]
QUESTION = "What does the function `{name}` in this code do? Answer in two sentences."
QUESTION_NO_FUNCTION = "What does this code do? Answer in two sentences."


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def stdlib_sources() -> list[tuple[str, str]]:
    """(module file, its text) for every module of ``MODULES`` this interpreter has."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(name, (root / name).read_text(encoding="utf-8")) for name in MODULES if (root / name).is_file()]


def first_function(code: str) -> str | None:
    """The first top-level function defined in ``code`` (else the first method), for the question."""
    found = re.search(r"^def ([A-Za-z_]\w*)\(", code, re.M) or re.search(r"^\s+def ([A-Za-z_]\w*)\(", code, re.M)
    return found.group(1) if found else None


class Inputs:
    """The benchmark's prompts (token ids) for one artifact's tokenizer: ``make(task, length, k)``."""

    def __init__(self, model):
        self.model = model
        self.tokenizer = model.tokenizer
        self.sources = stdlib_sources()
        self.template, self.message = None, None
        try:
            from speccompile.server.openai_api import ChatMessage, ChatTemplate

            self.template, self.message = ChatTemplate.from_artifact(Path(model.root)), ChatMessage
        except ImportError:  # the server's extras are not installed: questions as plain text
            pass

    def _texts(self, task: str) -> list[tuple[str, str]]:
        return self.sources[0::2] if task == "continue" else self.sources[1::2]

    def count(self, task: str) -> int:
        return len(self._texts(task))

    def make(self, task: str, length: int, k: int) -> tuple[str, list[int]]:
        """The ``k``-th input of ``task`` at about ``length`` tokens: (module file, prompt ids)."""
        name, text = self._texts(task)[k]
        ids = self.tokenizer.encode(text)
        if len(ids) < length:
            raise SystemExit(f"{name} is {len(ids)} tokens, shorter than the input length {length}")
        if task == "continue":
            return name, ids[:length]
        name_asked = first_function(self.tokenizer.decode(ids[:length]))
        question = QUESTION.format(name=name_asked) if name_asked else QUESTION_NO_FUNCTION
        overhead = len(self._question_ids("", question))
        code = self.tokenizer.decode(ids[: max(length - overhead, 1)])
        return name, self._question_ids(code, question)

    def _question_ids(self, code: str, question: str) -> list[int]:
        if self.template is None:
            return self.tokenizer.encode(f"{code}\n\n# Question: {question}\n# Answer:")
        return self.template.prompt_ids([self.message(role="user", content=f"{code}\n\n{question}")])


def timed(model, prompt: list[int], max_new_tokens: int, speculate: bool, plan: str | None) -> dict:
    """One request through ``stream``: time to the first chunk, then the rest."""
    start = time.perf_counter()
    stream = model.stream(prompt, max_new_tokens=max_new_tokens, speculate=speculate, plan=plan)
    first_at, first_tokens = None, 0
    for chunk in stream:
        if first_at is None:
            first_at, first_tokens = time.perf_counter(), len(chunk.token_ids)
    end = time.perf_counter()
    result = stream.result
    stats = result.stats
    first_at = end if first_at is None else first_at
    return {
        "token_ids": result.token_ids,
        "ttft_s": first_at - start,
        "decode_tokens": len(result.token_ids) - first_tokens,
        "decode_s": end - first_at,
        "total_s": end - start,
        "rounds": stats.rounds if speculate else None,
        "accepted": stats.accepted if speculate else None,
    }


def bench_backend(
    backend: str, artifact: Path, args, plan: str | None, prompts: dict | None = None
) -> tuple[list[dict], dict]:
    """Every input of every task and length on one backend, plain and speculative in turns; each input's ids go
    into ``prompts`` by (task, length) for the peers."""
    from speccompile.runtime import load

    model = load(artifact, backend=backend)
    chosen = plan or model.manifest.default_plan
    info = {"artifact": str(artifact), "plan": chosen, "plain_reason": None if chosen else model.plain_reason}
    info["eos_ids"] = sorted(model.manifest.eos_ids)
    too_long = [n for n in args.lengths if n + args.max_new_tokens > model.context]
    if too_long:
        raise SystemExit(
            f"--lengths {too_long} plus {args.max_new_tokens} new tokens exceed the model's context ({model.context})"
        )
    inputs = Inputs(model)
    warm = inputs.make("continue", min(args.lengths), 0)[1]
    for speculate in (False, True):  # untimed: sessions, caches and allocations settle
        timed(model, warm, min(8, args.max_new_tokens), speculate, chosen)
    requests = []
    turn = 0
    for length in args.lengths:
        for task in args.tasks:
            for k in range(min(args.inputs, inputs.count(task))):
                name, prompt = inputs.make(task, length, k)
                if prompts is not None:
                    prompts.setdefault((task, length), {})[name] = prompt
                runs = {}
                order = (False, True) if turn % 2 == 0 else (True, False)
                turn += 1
                for speculate in order:
                    runs[speculate] = timed(model, prompt, args.max_new_tokens, speculate, chosen)
                plain, spec = runs[False], runs[True]
                request = {
                    "backend": backend,
                    "task": task,
                    "length": length,
                    "source": name,
                    "prompt_tokens": len(prompt),
                    "identical": plain["token_ids"] == spec["token_ids"],
                    "plain": {key: v for key, v in plain.items() if key != "token_ids"},
                    "speculative": {key: v for key, v in spec.items() if key != "token_ids"},
                    "new_tokens": len(spec["token_ids"]),
                }
                requests.append(request)
                log(
                    f"{backend} {task} {length}: {name}, {len(prompt)} prompt tokens, first token "
                    f"{plain['ttft_s']:.2f} s / {spec['ttft_s']:.2f} s, request {plain['total_s']:.2f} s / "
                    f"{spec['total_s']:.2f} s (plain / speculative), identical {request['identical']}"
                )
    return requests, info


def openvino_rows(prompts: dict, args, scratch: Path) -> list[dict]:
    """OpenVINO GenAI on the same token ids, in its own venv (``benchmarks/peer_compare.py`` sets it up): its
    continuous-batching pipeline with one stream (the prompt read in its dynamic split-fuse chunks), fp32 weights
    and an fp32 KV cache (the fp32 model's computation), plainly and with its prompt lookup; rows shaped like ours,
    "plain" its plain decoding and "speculative" its prompt lookup."""
    from peer_compare import DEFAULT_VENVS, openvino_model, venv
    from smollm2 import ensure_model

    venvs = Path(args.venvs or DEFAULT_VENVS)
    python = venv(venvs, "openvino", ["optimum-intel[openvino]", "openvino-genai"])
    folder = openvino_model(venvs, Path(ensure_model()), "fp32")
    rows = []
    for (task, length), by_name in prompts.items():
        group = list(by_name.values())
        ids_file = scratch / "openvino_ids.json"
        ids_file.write_text(json.dumps({"warm": [group[0][:64]], "1": group}))
        log(f"OpenVINO GenAI {task} {length}: {len(group)} input(s) ...")
        command = [str(python), str(HERE / "peers" / "openvino_cb_peer.py"), str(folder), str(ids_file)]
        command += ["--streams", "1", "--requests", str(len(group)), "--max-new-tokens", str(args.max_new_tokens)]
        command += ["--threads", "2", "--kv-cache-precision", "f32"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            log(f"OpenVINO GenAI failed: {done.stderr[-1500:]}")
            continue
        report = json.loads(done.stdout)
        runs = {
            mode: sorted(report[mode]["1"]["requests"], key=lambda r: r["id"]) for mode in ("plain", "prompt_lookup")
        }
        label = f"OpenVINO GenAI {report['versions']['openvino_genai'].split('-')[0]} (lookup)"
        rows.append(peer_row(label, task, length, group, runs["plain"], runs["prompt_lookup"]))
    return rows


def llamacpp_rows(prompts: dict, eos_ids: list[int], args, scratch: Path) -> list[dict]:
    """llama.cpp on the same token ids, in its own venv (``benchmarks/peer_compare.py`` builds it): the GGUF of the
    same fp32 weights, a float32 KV cache (the fp32 model's computation) and its fused attention on, read in its
    default batches of 512 tokens; plainly and with llama-cpp-python's prompt lookup, rows shaped like ours."""
    from peer_compare import DEFAULT_VENVS, checkpoint_gguf, llamacpp_gguf, llamacpp_python

    venvs = Path(args.venvs or DEFAULT_VENVS)
    python = llamacpp_python(venvs)
    model = llamacpp_gguf(venvs, checkpoint_gguf(None), "f32")
    rows = []
    for (task, length), by_name in prompts.items():
        group = list(by_name.values())
        ids_file = scratch / "llamacpp_ids.json"
        ids_file.write_text(json.dumps(group))
        log(f"llama.cpp {task} {length}: {len(group)} input(s) ...")
        context = max(map(len, group)) + args.max_new_tokens + 16
        command = [str(python), str(HERE / "peers" / "llamacpp_peer.py"), "bench", str(model), str(ids_file)]
        command += ["--max-new-tokens", str(args.max_new_tokens), "--threads", "2", "--n-ctx", str(context)]
        command += ["--kv-f32", "--flash-attn", "--eos", ",".join(map(str, eos_ids))]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            log(f"llama.cpp failed: {done.stderr[-1500:]}")
            continue
        report = json.loads(done.stdout)
        label = f"llama.cpp (llama-cpp-python {report['versions']['llama_cpp_python']}, lookup)"
        rows.append(
            peer_row(label, task, length, group, report["plain"]["requests"], report["prompt_lookup"]["requests"])
        )
    return rows


def peer_row(label: str, task: str, length: int, group: list, plain: list[dict], lookup: list[dict]) -> dict:
    """A peer's row shaped like ours from its requests (``ids``, ``ttft`` and ``latency`` each): "plain" its
    plain decoding, "speculative" its prompt lookup."""

    def decode(requests: list[dict]) -> float | None:
        return rate(sum(len(r["ids"]) - 1 for r in requests), sum(r["latency"] - r["ttft"] for r in requests))

    return {
        "backend": label,
        "task": task,
        "length": length,
        "inputs": len(group),
        "prompt_tokens": round(sum(map(len, group)) / len(group)),
        "ttft_plain_s": sum(r["ttft"] for r in plain) / len(group),
        "ttft_speculative_s": sum(r["ttft"] for r in lookup) / len(group),
        "decode_plain_tokens_per_s": decode(plain),
        "decode_speculative_tokens_per_s": decode(lookup),
        "decode_speedup": ratio(decode(lookup), decode(plain)),
        "request_speedup": ratio(sum(r["latency"] for r in plain), sum(r["latency"] for r in lookup)),
        "identical": sum(a["ids"] == b["ids"] for a, b in zip(plain, lookup)),
        "mean_accepted": None,
    }


def rate(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 and tokens > 0 else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def summarize(requests: list[dict]) -> list[dict]:
    """One row per backend, task and length: means over its inputs, rates over their summed tokens and times."""
    rows: dict[tuple, list[dict]] = {}
    for r in requests:
        rows.setdefault((r["backend"], r["task"], r["length"]), []).append(r)
    out = []
    for (backend, task, length), group in rows.items():
        plain = [r["plain"] for r in group]
        spec = [r["speculative"] for r in group]

        def total(runs, key):
            return sum(run[key] for run in runs)

        plain_rate = rate(total(plain, "decode_tokens"), total(plain, "decode_s"))
        spec_rate = rate(total(spec, "decode_tokens"), total(spec, "decode_s"))
        rounds = total(spec, "rounds") if all(s["rounds"] is not None for s in spec) else 0
        out.append(
            {
                "backend": backend,
                "task": task,
                "length": length,
                "inputs": len(group),
                "prompt_tokens": round(sum(r["prompt_tokens"] for r in group) / len(group)),
                "ttft_plain_s": total(plain, "ttft_s") / len(group),
                "ttft_speculative_s": total(spec, "ttft_s") / len(group),
                "decode_plain_tokens_per_s": plain_rate,
                "decode_speculative_tokens_per_s": spec_rate,
                "decode_speedup": ratio(spec_rate, plain_rate),
                "request_speedup": ratio(total(plain, "total_s"), total(spec, "total_s")),
                "identical": sum(r["identical"] for r in group),
                "mean_accepted": (total(spec, "accepted") + rounds) / rounds if rounds else None,
            }
        )
    return out


def figure(value, digits: int = 1, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def print_table(rows: list[dict], args, infos: dict) -> None:
    print(f"\n{args.label}, {args.max_new_tokens} new tokens, greedy, {args.inputs} input(s) per task and length\n")
    print(
        "| backend | task | prompt tokens | first token plain (s) | first token speculative (s) | decode plain "
        "tokens/s | decode speculative tokens/s | decode speedup | request speedup | identical | mean accepted |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['backend']} | {r['task']} | {r['prompt_tokens']} | {figure(r['ttft_plain_s'], 2)} | "
            f"{figure(r['ttft_speculative_s'], 2)} | {figure(r['decode_plain_tokens_per_s'])} | "
            f"{figure(r['decode_speculative_tokens_per_s'])} | {figure(r['decode_speedup'], 2, 'x')} | "
            f"{figure(r['request_speedup'], 2, 'x')} | {r['identical']}/{r['inputs']} | "
            f"{figure(r['mean_accepted'], 2)} |"
        )
    print()
    for backend, info in infos.items():
        plan = info["plan"] or f"none: {info['plain_reason']}"
        print(f"{backend}: {info['artifact']}, plan {plan}")


def artifacts_from(option: str | None, backends: list[str], build) -> dict[str, Path]:
    """``--artifact``: one folder for every backend, or ``BACKEND=FOLDER`` pairs; else the default artifacts,
    built by ``build(backend, folder)`` when missing."""
    if option:
        pairs = [part.split("=", 1) for part in option.split(",")]
        if all(len(p) == 1 for p in pairs) and len(pairs) == 1:
            return {b: Path(pairs[0][0]) for b in backends}
        named = {p[0]: Path(p[1]) for p in pairs if len(p) == 2}
        missing = [b for b in backends if b not in named]
        if missing or len(named) != len(pairs):
            raise SystemExit(f"--artifact: give one folder, or BACKEND=FOLDER for each of {','.join(backends)}")
        return named
    out = {}
    for backend in backends:
        folder = REPO / "artifacts" / f"smollm2-{backend}"
        if not (folder / "manifest.json").is_file():
            build(backend, folder)
        out[backend] = folder
    return out


def build_smollm2(backend: str, folder: Path) -> None:
    from real_model import SMOLLM2_CALIBRATION, speccompile
    from smollm2 import ensure_model

    speccompile(
        "build",
        ensure_model(),
        "-o",
        folder,
        "--backend",
        backend,
        "--calibration",
        SMOLLM2_CALIBRATION,
        "--calibration-tokens",
        96,
        "--force",
        "--quiet",
    )


def build_smoke(folder: Path) -> Path:
    """The bundled refcoder, both backends, lookup plans only, at the smallest tuning budget: seconds."""
    from speccompile.build import BuildOptions, build

    options = BuildOptions(
        model=None,
        out=folder,
        method="lookup",
        retrieval=False,
        trees=False,
        backends=("onnx", "torch"),
        calibration_tokens=8,
        confirm_prompts=1,
        confirm_tokens=8,
        time_budget=5,
        show_progress=False,
        force=True,
    )
    build(options, log=lambda message: None)
    return folder


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default=None, help=f"input lengths in tokens (default {LENGTHS})")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--backends", default="torch,onnx")
    parser.add_argument("--tasks", default="continue,qa", help="continue, qa or both")
    parser.add_argument("--inputs", type=int, default=2, help="inputs per task and length (default 2)")
    parser.add_argument("--artifact", default=None, help="FOLDER (every backend) or BACKEND=FOLDER,...")
    parser.add_argument("--plan", default=None, help="plan to speculate with (default: the artifact's default)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows and every request here")
    parser.add_argument("--smoke", action="store_true", help="the bundled refcoder, short inputs: under a minute")
    parser.add_argument(
        "--peers",
        default="",
        help="openvino, llamacpp or both: also OpenVINO GenAI / llama.cpp (each in its own venv, fp32 weights and KV "
        "cache) on the same inputs",
    )
    parser.add_argument("--venvs", default=None, help="where the peers' venvs live (default artifacts/peers)")
    parser.add_argument(
        "--record",
        default=None,
        help="also write the results record benchmarks/results/NAME.json (needs --json) and render README's table",
    )
    args = parser.parse_args(argv)
    try:
        lengths = [int(n) for n in args.lengths.split(",")] if args.lengths else None
    except ValueError:
        parser.error(f"--lengths takes comma-separated whole numbers, got {args.lengths!r}")
    if lengths is not None and any(n < 16 for n in lengths):
        parser.error("--lengths: every input must be at least 16 tokens")
    if args.record and not args.json:
        parser.error("--record needs --json FILE (the record is made from it)")
    if args.max_new_tokens < 2 or args.inputs < 1:
        parser.error("--max-new-tokens must be at least 2 and --inputs at least 1")
    args.tasks = [t for t in args.tasks.split(",") if t]
    if not args.tasks or any(t not in ("continue", "qa") for t in args.tasks):
        parser.error(f"--tasks takes continue, qa or both, got {','.join(args.tasks)!r}")
    args.peers = [p for p in args.peers.split(",") if p]
    if any(p not in ("openvino", "llamacpp") for p in args.peers) or (args.peers and args.smoke):
        parser.error("--peers takes openvino, llamacpp or both (SmolLM2 only, not with --smoke)")
    args.backends = [b for b in args.backends.split(",") if b]
    if not args.backends or any(b not in ("torch", "onnx") for b in args.backends):
        parser.error("--backends takes torch, onnx or both")
    if args.smoke:
        args.lengths = lengths or SMOKE_LENGTHS
        if args.max_new_tokens == parser.get_default("max_new_tokens"):
            args.max_new_tokens = 16
        args.inputs = min(args.inputs, 1)
    else:
        args.lengths = lengths or LENGTHS
    return args


def main(argv=None) -> None:
    from speccompile.runtime import SpeccompileError
    from speccompile.runtime.machine import cpu_description

    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="long-context-") as scratch:
        plan = args.plan
        if args.smoke:
            import torch

            # refcoder's steps are dominated by per-op overhead: one thread is faster and immune to a busy machine
            torch.set_num_threads(1)
        if args.smoke and not args.artifact:
            log("building the bundled refcoder (lookup plans, both backends) ...")
            args.artifact = str(build_smoke(Path(scratch) / "refcoder"))
        if args.smoke:
            manifest = json.loads((Path(args.artifact.split("=")[-1]) / "manifest.json").read_text())
            plan = plan or manifest["default_plan"] or next(iter(manifest["plans"]), None)
        args.label = "refcoder (smoke)" if args.smoke else "SmolLM2-135M-Instruct"
        folders = artifacts_from(args.artifact, args.backends, build_smollm2)
        requests, infos, prompts = [], {}, {}
        for backend in args.backends:
            log(f"{backend}: {folders[backend]}")
            try:
                done, infos[backend] = bench_backend(backend, folders[backend], args, plan, prompts)
            except SpeccompileError as exc:  # an artifact that does not load, a prompt the model cannot take
                raise SystemExit(f"{backend}: {exc}") from None
            requests += done
        rows = summarize(requests)
        if "openvino" in args.peers:
            rows += openvino_rows(prompts, args, Path(scratch))
        if "llamacpp" in args.peers:
            eos_ids = next(iter(infos.values()))["eos_ids"]
            rows += llamacpp_rows(prompts, eos_ids, args, Path(scratch))
    print_table(rows, args, infos)
    if args.json:
        report = {
            "model": args.label,
            "max_new_tokens": args.max_new_tokens,
            "lengths": args.lengths,
            "backends": infos,
            "machine": cpu_description(),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "rows": rows,
            "requests": requests,
        }
        args.json.write_text(json.dumps(report, indent=2))
    if args.record:
        import render_results

        notes = f"{args.max_new_tokens} new tokens, greedy, {args.inputs} input(s) per task and length; " + "; ".join(
            f"{backend}: plan {info['plan'] or 'none'}" for backend, info in infos.items()
        )
        path = render_results.from_long_context(args.record, f"python benchmarks/{report['command']}", args.json, notes)
        render_results.main_render()
        log(f"recorded {path}")


if __name__ == "__main__":
    main()
