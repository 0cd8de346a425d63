"""The CPU product forms (runtime/backends/torch/cpu_linear.py): W @ x^T and the packed products (MKL's, oneDNN's)
compute F.linear's products, are chosen per row count by measurement, and are lossless when forced on for every
row count."""

import mmap
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lossless import assert_same_greedy, run

from speccompile.convert import arch_config, canonical_weights
from speccompile.runtime.artifact.manifest import DraftPlan
from speccompile.runtime.backends.torch.backend import TorchBackend
from speccompile.runtime.backends.torch.cpu_linear import (
    MAX_ROWS,
    PACK_KINDS,
    StreamingLinear,
    WeightPack,
    available_pack_kinds,
    choose_forms,
    fastest_packs,
    packing_missing,
    use_streaming_linears,
)
from speccompile.runtime.backends.torch.decoder import build_decoder, pack_projections


@pytest.mark.parametrize("bias", [False, True])
def test_streaming_linear_computes_f_linear(bias):
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 80, bias=bias)
    layer.__class__ = StreamingLinear
    layer.streaming_rows = frozenset(range(1, MAX_ROWS + 1))
    for rows in (1, 2, 3, 7, 16, 17):  # 17: beyond the chosen counts, F.linear itself
        x = torch.randn(1, rows, 48)
        y = layer(x)
        assert y.shape == (1, rows, 80) and y.is_contiguous()
        torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


needs_a_pack = pytest.mark.skipif(packing_missing() is not None, reason=f"no packed product: {packing_missing()}")
each_pack_kind = pytest.mark.parametrize(
    "kind",
    [
        pytest.param(
            kind, id=kind.kind, marks=pytest.mark.skipif(kind.missing() is not None, reason=kind.missing() or "")
        )
        for kind in PACK_KINDS
    ],
)


def packed_layer(kind, out_features: int = 80, in_features: int = 48, bias: bool = True) -> StreamingLinear:
    torch.manual_seed(0)
    layer = torch.nn.Linear(in_features, out_features, bias=bias)
    layer.__class__ = StreamingLinear
    layer.packed_rows, layer.pack = frozenset(range(1, MAX_ROWS + 1)), kind(layer.weight)
    return layer


@each_pack_kind
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_computes_f_linear(kind, bias):
    """One pack, made for MAX_ROWS rows, serves every row count up to it; beyond, F.linear itself."""
    layer = packed_layer(kind, bias=bias)
    with torch.inference_mode():
        for rows in (1, 2, 3, 7, 16, 17):
            x = torch.randn(1, rows, 48)
            y = layer(x)
            assert y.shape == (1, rows, 80) and y.is_contiguous()
            torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@each_pack_kind
def test_packed_linear_follows_its_weight(kind):
    """A pack is used only for the tensor it packed: a weight replaced, or changed in place, since packing is
    multiplied as it is now (F.linear), never by the stale pack."""
    layer = packed_layer(kind)
    x = torch.randn(1, 4, 48)
    with torch.no_grad():
        layer.weight.mul_(2)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        layer.weight = torch.nn.Parameter(torch.randn(80, 48), requires_grad=False)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@each_pack_kind
def test_pack_is_shared_by_deepcopy(kind):
    """The int8 twin deep-copies the module tree: a pack is shared, never copied (it is as large as its weight)."""
    import copy

    layer = packed_layer(kind)
    assert copy.deepcopy(layer, memo={id(layer.weight): layer.weight, id(layer.bias): layer.bias}).pack is layer.pack


class _LinearPack(WeightPack):
    """A stand-in pack kind for the choice between kinds: F.linear, after ``delay`` seconds a call."""

    kind, delay = "test", 0.0
    _missing: list = [None]

    @staticmethod
    def pack(weight):
        return weight

    def product(self, x, weight, bias, rows):
        if self.delay:
            import time

            time.sleep(self.delay)
        return F.linear(x, weight, bias)


class _SlowPack(_LinearPack):
    kind, delay = "slow", 0.002
    _missing: list = [None]


class _QuickPack(_LinearPack):
    kind = "quick"
    _missing: list = [None]


def test_the_faster_pack_kind_is_kept(monkeypatch):
    """Of the pack kinds this build has, the one whose products took less time is kept, one pack per weight in
    order (each kind is a copy of the weights: never both)."""
    from speccompile.runtime.backends.torch import cpu_linear

    weights = [torch.randn(64, 32), torch.randn(32, 64)]
    for order in ((_SlowPack, _QuickPack), (_QuickPack, _SlowPack)):
        monkeypatch.setattr(cpu_linear, "PACK_KINDS", order)
        assert available_pack_kinds() == list(order)
        packs = fastest_packs(weights, rows=(1, 4), repeats=2)
        assert [type(p) for p in packs] == [_QuickPack, _QuickPack]
        assert [p.ptr for p in packs] == [w.data_ptr() for w in weights]
    monkeypatch.setattr(cpu_linear, "PACK_KINDS", (_SlowPack,))
    assert [type(p) for p in fastest_packs(weights)] == [_SlowPack, _SlowPack]  # the only kind: no timing needed
    monkeypatch.setattr(cpu_linear, "PACK_KINDS", ())
    assert fastest_packs(weights) is None


def test_choice_covers_counts_between_probes():
    weights = [torch.randn(64, 32), torch.randn(32, 64)]
    every = frozenset(range(1, MAX_ROWS + 1))
    assert choose_forms(weights, rows=(1, 4), margin=float("inf")) == (every, frozenset())
    assert choose_forms(weights, rows=(1, 4), margin=0.0) == (frozenset(), frozenset())


@each_pack_kind
def test_packed_choice(kind):
    """The packed form where it is within ``preference`` of the form chosen otherwise, which then gives way; and
    nowhere unless it beats the other forms by ``gain`` at some count (its packs double the weights' memory)."""
    weights = [torch.randn(64, 32), torch.randn(32, 64)]
    packs = [kind(w) for w in weights]
    every = frozenset(range(1, MAX_ROWS + 1))
    assert choose_forms(
        weights, packs, rows=(1, 4), margin=float("inf"), preference=float("inf"), gain=float("inf")
    ) == (frozenset(), every)
    assert choose_forms(weights, packs, rows=(1, 4), margin=float("inf"), preference=float("inf"), gain=0.0) == (
        every,
        frozenset(),
    )
    assert choose_forms(weights, packs, rows=(1, 4), margin=float("inf"), preference=0.0) == (every, frozenset())


def test_environment_override(monkeypatch):
    monkeypatch.setenv("SPECCOMPILE_CPU_LINEAR", "fastest")
    with pytest.raises(ValueError, match="SPECCOMPILE_CPU_LINEAR.*auto, standard, streaming, packed"):
        use_streaming_linears(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    monkeypatch.setenv("SPECCOMPILE_CPU_LINEAR", "standard")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert use_streaming_linears(model) == frozenset()


FORCED = ["streaming"] + (["packed"] if packing_missing() is None else [])


@pytest.mark.parametrize("form", FORCED)
@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_speculative_greedy_equals_plain_with_a_form_forced(family, form, tiny_decoder, monkeypatch):
    monkeypatch.setenv("SPECCOMPILE_CPU_LINEAR", form)
    hf, _ = tiny_decoder(family)
    config = arch_config(hf)
    decoder = build_decoder(config, canonical_weights(hf, config))  # a fresh one: the shared one keeps its choice
    backend = TorchBackend(decoder)
    linears = [m for m in decoder.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is StreamingLinear for m in linears)
    every = frozenset(range(1, MAX_ROWS + 1))
    assert (decoder._streaming_rows, decoder._packed_rows) == (
        (every, frozenset()) if form == "streaming" else (frozenset(), every)
    )
    if form == "packed":  # every product a step runs has its pack; the parts of packed q/k/v and gate/up need none
        stepped = [
            decoder.layers[0].attn._qkv[0],
            decoder.layers[0].attn.o,
            decoder.layers[0].mlp.down,
            decoder.lm_head,
        ]
        assert all(m.pack is not None and m.pack.fits(m.weight) for m in stepped)
        assert decoder.layers[0].attn.q.pack is None
    gen = torch.Generator().manual_seed(5)
    near_ties = accepted = 0
    for length in (4, 19):
        prompt = torch.randint(3, config.vocab_size, (length,), generator=gen).tolist()
        plain, _ = run(backend, prompt, 32)
        for plan in (
            DraftPlan.of(name="exit", exit_layer=config.num_layers // 2, sources={"model": {"max_draft": 5}}),
            DraftPlan.of(name="skip", skip_attn=[1], sources={"model": {"max_draft": 3}}),
        ):
            spec, stats = run(backend, prompt, 32, plan)
            near_ties += assert_same_greedy(decoder, prompt, plain, spec)
            accepted += stats.accepted
    assert near_ties <= 1 and accepted > 0


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_packed_projections_compute_the_same_logits(family, tiny_decoder):
    """q/k/v and gate/up as one product each: same logits, same state dict, q/k/v weights are views."""
    hf, _ = tiny_decoder(family)
    config = arch_config(hf)
    weights = canonical_weights(hf, config)
    reference, decoder = build_decoder(config, weights), build_decoder(config, weights)
    state = {k: v.clone() for k, v in decoder.state_dict().items()}
    packed = pack_projections(decoder)
    assert len(packed) == config.num_layers * (2 if config.mlp == "gated" else 1)
    assert packed[0][1] == (decoder.layers[0].attn.q, decoder.layers[0].attn.k, decoder.layers[0].attn.v)
    assert pack_projections(decoder) == []  # once
    attn = decoder.layers[0].attn
    product, sizes = attn._qkv[:2]
    assert sizes == [attn.q.out_features, attn.k.out_features, attn.v.out_features]
    assert (
        attn.k.weight.data_ptr()
        == product.weight.data_ptr() + sizes[0] * product.weight.stride(0) * product.weight.element_size()
    )
    after = decoder.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)
    tokens = torch.randint(3, config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        torch.testing.assert_close(decoder(tokens), reference(tokens), rtol=1e-5, atol=1e-5)
        # a weight replaced after packing: the packed product is no longer used, the new weight is
        for part in ("q", "v"):
            block = decoder.layers[-1 if part == "v" else 0].attn
            getattr(block, part).weight = torch.nn.Parameter(
                getattr(block, part).weight.detach().clone() * 2, requires_grad=False
            )
            getattr(reference.layers[-1 if part == "v" else 0].attn, part).weight.mul_(2)
            torch.testing.assert_close(decoder(tokens), reference(tokens), rtol=1e-5, atol=1e-5)


def test_torch_backend_packs_the_canonical_decoder_on_cpu(tiny_decoder):
    hf, _ = tiny_decoder("llama")
    config = arch_config(hf)
    decoder = build_decoder(config, canonical_weights(hf, config))
    TorchBackend(decoder)
    assert all("_qkv" in block.attn.__dict__ and "_gate_up" in block.mlp.__dict__ for block in decoder.layers)
    # the packed product takes the q module's class and its chosen row counts (cpu_linear), nothing else
    product = decoder.layers[0].attn._qkv[0]
    assert type(product) is StreamingLinear
    assert (product.streaming_rows, product.packed_rows) == decoder._forms[tuple(product.weight.shape)]
    assert product._forward_hooks is not decoder.layers[0].attn.q._forward_hooks


def test_forms_are_timed_on_a_prefix_sized_by_the_cache(monkeypatch):
    """The timing reads the first weights up to a few times the last-level cache, not all of them: its packs are
    made only for those (a whole second copy of a big model's weights otherwise, for a timing)."""
    from speccompile.runtime.backends.torch import cpu_linear

    weights = [torch.zeros(1024, 1024) for _ in range(8)]  # 4 MiB each
    monkeypatch.setattr(cpu_linear, "MIN_PROBE_BYTES", 1)
    monkeypatch.setattr(cpu_linear, "last_level_cache_bytes", lambda: 2 << 20)
    assert cpu_linear.probe_weights(weights) == weights[:2]  # 4 x 2 MiB reached after the second
    monkeypatch.setattr(cpu_linear, "last_level_cache_bytes", lambda: None)
    assert cpu_linear.probe_weights(weights) == weights


def test_a_weight_larger_than_the_probe_is_timed_on_its_first_rows(monkeypatch):
    """A head over a large vocabulary is timed on a row prefix of the probe's size (a view), not packed whole."""
    from speccompile.runtime.backends.torch import cpu_linear

    head = torch.zeros(4096, 256)  # 4 MiB, 1 KiB a row
    monkeypatch.setattr(cpu_linear, "MIN_PROBE_BYTES", 1)
    monkeypatch.setattr(cpu_linear, "last_level_cache_bytes", lambda: 256 << 10)  # probe: 1 MiB
    (probe,) = cpu_linear.probe_weights([head])
    assert probe.shape == (1024, 256) and probe.data_ptr() == head.data_ptr()
    monkeypatch.setattr(cpu_linear, "last_level_cache_bytes", lambda: 1 << 20)  # 4 MiB: the whole head
    assert cpu_linear.probe_weights([head]) == [head]


@needs_a_pack
def test_forms_are_chosen_per_weight_shape(tiny_decoder, monkeypatch):
    """Each shape gets the forms timed on its own weights, and packs are made only for the shapes where the
    packed form won: a shape where it loses keeps one copy of its weights."""
    from speccompile.runtime.backends.torch import cpu_linear

    hf, _ = tiny_decoder("llama")
    config = arch_config(hf)
    decoder = build_decoder(config, canonical_weights(hf, config))
    every = frozenset(range(1, MAX_ROWS + 1))
    timed: list[tuple[int, ...]] = []

    def by_shape(weights, packs=None):
        shapes = {tuple(w.shape) for w in weights}
        assert len(shapes) == 1 and packs is not None and len(packs) == len(weights)  # one shape per timing
        timed.append(shapes.pop())
        tall = weights[0].shape[0] > weights[0].shape[1]
        return (frozenset(), every) if tall else (every, frozenset())

    monkeypatch.setenv("SPECCOMPILE_CPU_LINEAR", "auto")
    monkeypatch.setattr(cpu_linear, "choose_forms", by_shape)
    TorchBackend(decoder)
    stepped = [decoder.layers[0].attn._qkv[0], decoder.layers[0].attn.o, decoder.layers[0].mlp._gate_up[0]]
    stepped += [decoder.layers[0].mlp.down, decoder.lm_head]
    shapes = {tuple(m.weight.shape) for m in stepped}
    assert sorted(timed) == sorted(shapes) and decoder._forms.keys() == shapes
    packed_bytes = 0
    for module in stepped:
        tall = module.weight.shape[0] > module.weight.shape[1]
        assert (module.streaming_rows, module.packed_rows) == ((frozenset(), every) if tall else (every, frozenset()))
        assert (module.pack is not None) == tall
    for module in {id(m.weight): m for m in decoder.modules() if isinstance(m, StreamingLinear)}.values():
        packed_bytes += module.weight.numel() * 4 if module.pack is not None else 0
    products = [block.attn._qkv[0] for block in decoder.layers] + [block.mlp._gate_up[0] for block in decoder.layers]
    packed_bytes += sum(p.weight.numel() * 4 for p in products if p.pack is not None)
    assert 0 < decoder._packed_bytes == packed_bytes
    assert decoder._streaming_rows == every and decoder._packed_rows == every  # some shape gets each


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/pagemap")
def test_packing_projections_drops_the_mapped_pages_they_replace(tiny_decoder, tmp_path):
    """q/k/v and gate/up re-stored as one product each: their former tensors, mapped from a weights file, leave
    the resident set (a third copy otherwise); the other weights' pages and the outputs stay as they were."""
    hf, _ = tiny_decoder("llama")
    config = arch_config(hf)
    weights = canonical_weights(hf, config)
    page = mmap.PAGESIZE
    offsets, offset = {}, 0
    for name, w in weights.items():
        offsets[name] = offset
        offset += -(-w.numel() * 4 // page) * page  # each tensor on pages of its own
    path = tmp_path / "weights.bin"
    with open(path, "wb") as f:
        for name, w in weights.items():
            f.seek(offsets[name])
            f.write(w.detach().float().contiguous().numpy().tobytes())
        f.truncate(offset)
    mapped = np.memmap(path, dtype=np.uint8, mode="c")  # private, copy on write, as transformers maps
    arrays = {
        name: mapped[offsets[name] : offsets[name] + w.numel() * 4].view(np.float32).reshape(w.shape)
        for name, w in weights.items()
    }
    decoder = build_decoder(config, {name: torch.from_numpy(a) for name, a in arrays.items()}, copy=False)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        before = decoder(ids)
    assert all(_present_pages(a) > 0 for a in arrays.values())
    pack_projections(decoder)
    replaced = [n for n in arrays if n.endswith((".q.weight", ".k.weight", ".v.weight", ".gate.weight", ".up.weight"))]
    kept = [n for n in arrays if n.endswith((".o.weight", ".down.weight"))]
    assert replaced and kept
    with torch.inference_mode():
        after = decoder(ids)
    assert all(_present_pages(arrays[n]) == 0 for n in replaced)
    assert all(_present_pages(arrays[n]) > 0 for n in kept)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def _present_pages(array: np.ndarray) -> int:
    first = array.__array_interface__["data"][0] // mmap.PAGESIZE
    with open("/proc/self/pagemap", "rb", buffering=0) as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read(-(-array.nbytes // mmap.PAGESIZE) * 8), dtype=np.uint64)
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_a_loaded_artifact_holds_its_weights_file_mapped_not_copied(tiny_artifact):
    """Loading on CPU keeps the weights in the file's memory map (pages read as a step needs them): a copy would
    hold every weight twice while loading. The products packed at load are new tensors; the others are the file."""
    from speccompile.runtime.model import read_artifact

    manifest = read_artifact(tiny_artifact)
    path = (tiny_artifact / manifest.backends["torch"]["weights"]).resolve()
    backend = TorchBackend.from_files(path, manifest.config)
    mapped = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == str(path):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                mapped.append((start, end))
    decoder = backend.decoder

    def in_file(t: torch.Tensor) -> bool:
        return any(start <= t.data_ptr() < end for start, end in mapped)

    assert mapped, "the weights file is not mapped"
    assert in_file(decoder.layers[0].attn.o.weight) and in_file(decoder.layers[-1].mlp.down.weight)
    assert in_file(decoder.embed.weight)
    assert not in_file(decoder.layers[0].attn._qkv[0].weight)  # the concatenated product: a new tensor
