"""The CPU product forms are timed once per machine and kept (``runtime/backends/torch/product_forms_store.py``):
a second load of the same shapes reads the first load's choice instead of timing, so both choose the same; another
machine's key, an unreadable file or ``SPECCOMPILE_CPU_LINEAR_STORE=0`` time again."""

from __future__ import annotations

import json

import pytest
import torch

from speccompile.runtime.backends.torch import cpu_linear, product_forms_store
from speccompile.runtime.backends.torch.backend import TorchBackend


@pytest.fixture
def store_file(tmp_path, monkeypatch):
    path = tmp_path / "cpu_linear.json"
    monkeypatch.setenv("SPECCOMPILE_CPU_LINEAR_STORE", str(path))
    monkeypatch.setenv("SPECCOMPILE_CPU_LINEAR", "auto")
    return path


@pytest.fixture
def timings(monkeypatch):
    """Counts the load-time timings, and makes each one choose differently from the one before (as noisy timings
    can), so that a load that times instead of reading the kept choice shows."""
    calls = [0]

    def choose(weights, packs=None, **_):
        calls[0] += 1
        every = frozenset(range(1, cpu_linear.MAX_ROWS + 1))
        return (every, frozenset()) if calls[0] % 2 else (frozenset(), frozenset())

    monkeypatch.setattr(cpu_linear, "choose_forms", choose)
    return calls


def load(tiny_decoder, family="llama"):
    """A backend's decoder built afresh from the transformers model (the forms are chosen once per decoder, and the
    fixture's shared decoder may have had its chosen by another test)."""
    from speccompile.convert import arch_config, canonical_weights
    from speccompile.runtime.backends.torch.decoder import build_decoder

    hf, _ = tiny_decoder(family)
    config = arch_config(hf)
    return TorchBackend(build_decoder(config, canonical_weights(hf, config))).decoder


def test_a_second_load_reads_the_first_loads_choice(tiny_decoder, store_file, timings):
    first = load(tiny_decoder)
    timed = timings[0]
    assert timed > 0 and store_file.exists()
    second = load(tiny_decoder)
    assert timings[0] == timed  # nothing timed again
    assert second._forms == first._forms
    entries = json.loads(store_file.read_text())["machines"]
    assert list(entries) == [product_forms_store.machine_entry_key()]
    assert len(entries[product_forms_store.machine_entry_key()]) == len(first._forms)


def test_another_machine_or_an_unreadable_file_times_again(tiny_decoder, store_file, timings, monkeypatch):
    load(tiny_decoder)
    timed = timings[0]
    monkeypatch.setattr(product_forms_store, "machine_entry_key", lambda: "another CPU; torch x, 2 threads")
    load(tiny_decoder)
    assert timings[0] == 2 * timed
    assert len(json.loads(store_file.read_text())["machines"]) == 2  # both machines' choices kept
    store_file.write_text("{not json")
    load(tiny_decoder)
    assert timings[0] == 3 * timed and json.loads(store_file.read_text())["version"] == product_forms_store.VERSION


def test_the_store_turned_off_times_every_load(tiny_decoder, timings, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECCOMPILE_CPU_LINEAR_STORE", "0")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    load(tiny_decoder)
    timed = timings[0]
    load(tiny_decoder)
    assert timings[0] == 2 * timed > 0
    assert not any(tmp_path.rglob("*.json"))


def test_kept_forms_decode_what_timed_forms_decode(tiny_decoder, store_file):
    from lossless import run

    prompt = [5, 9, 17, 33, 2, 8]
    with torch.inference_mode():
        first, _ = run(TorchBackend(load(tiny_decoder, "gpt2")), prompt, 12)
        again, _ = run(TorchBackend(load(tiny_decoder, "gpt2")), prompt, 12)
    assert first == again
