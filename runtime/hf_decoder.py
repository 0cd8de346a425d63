"""The generic torch path: any transformers causal LM whose decoder layers form a list, run through its
own modules, behind the same interface as the canonical ``Decoder`` (``runtime/decoder.py``).

Nothing here knows a family's insides. Every operation is one call of the model's own ``forward`` with
three small interventions, so masks, positions, rotary tables, softcapping and logit scaling are always
the model's own code:

- the layer list is swapped for the blocks that should run (whole-block skipping, early exit, or the
  verifier's blocks E..L-1); each layer keeps its ``layer_idx``, so it reads and writes its own KV slot;
- a forward pre-hook on the first block that runs replaces its input with a given hidden state (to
  start mid-stack), or, when no block runs, on the final norm (to apply the head to a hidden state);
- a forward hook on the last block that runs keeps its output (the exit hidden state).

The KV cache is transformers' own ``Cache`` of full-length ``StaticLayer``s: every layer writes at the
absolute positions of the call and the model masks keys by position, so rolling back after a rejection is
just starting the next call at an earlier position (DESIGN.md section 3). Sliding-window layers get a full
layer too (the window is applied by the model's mask), because a ring buffer cannot be cut back.

Only imported by the torch backend of an artifact built on this path (it imports transformers).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from .errors import ArtifactError
from .manifest import ArchConfig

HF_FOLDER = "weights"  # where a generic artifact keeps the model's config.json and model.safetensors


class LayerStackError(Exception):
    """The model has no list of decoder layers this path can drive (raised with the reason)."""


def find_layer_stack(model: nn.Module) -> tuple[nn.Module, str, nn.ModuleList]:
    """The ``ModuleList`` of decoder layers: the longest list of modules of one class inside the model
    (found by walking the module tree, not by a table of names), and the module that holds it."""
    best = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if len({type(m) for m in module}) != 1 or isinstance(module[0], (nn.Linear, nn.Embedding)):
            continue
        if best is None or len(module) > len(best[2]):
            parent_name, _, attr = name.rpartition(".")
            best = (model.get_submodule(parent_name) if parent_name else model, attr, module)
    if best is None:
        raise LayerStackError("no list of decoder layers found in the module tree")
    return best


@dataclass
class Pending:
    """Tokens whose embedding the model's own forward computes (``embed_tokens`` returns this)."""

    tokens: Tensor  # [B, T]
    pos: int

    @property
    def shape(self):
        return self.tokens.shape


def _first(output):
    return output[0] if isinstance(output, (tuple, list)) else output


class HFDecoder(nn.Module):
    """A transformers ``*ForCausalLM`` behind the canonical decoder's interface, over whole blocks."""

    whole_blocks = True  # a plan may skip whole blocks only (skip_attn == skip_mlp)

    def __init__(self, model: nn.Module, model_type: str | None = None):
        super().__init__()
        self.model = model.eval()
        self.parent, self.attr, stack = find_layer_stack(model)
        self.layers = list(stack)
        self._full = stack
        self.embed = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        if self.embed is None or self.lm_head is None:
            raise LayerStackError("the model has no input or output embedding to draft with")
        accepted = set(inspect.signature(model.forward).parameters)
        self._kwargs = {k for k in ("cache_position", "position_ids", "logits_to_keep", "use_cache", "past_key_values")
                        if k in accepted}
        if "past_key_values" not in self._kwargs:
            raise LayerStackError("the model's forward takes no past_key_values, so its KV cache cannot be driven")
        self._stacks: dict[tuple[int, ...], nn.ModuleList] = {}
        self.config = self._arch_config(model_type or model.config.model_type)
        self.final_norm = self._find_final_norm()
        self.cache_kind = self._choose_cache()

    # -- construction ------------------------------------------------------------------------------
    def _arch_config(self, model_type: str) -> ArchConfig:
        hf = self.model.config.get_text_config(decoder=True) if hasattr(self.model.config, "get_text_config") else self.model.config
        hidden = self.embed.weight.shape[1]
        heads = getattr(hf, "num_attention_heads", None) or 1
        kv_heads = getattr(hf, "num_key_value_heads", None) or heads
        head_dim = getattr(hf, "head_dim", None) or max(1, hidden // heads)
        return ArchConfig(
            model_type=model_type, vocab_size=self.lm_head.weight.shape[0], hidden_size=hidden,
            num_layers=len(self.layers), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            intermediate_size=getattr(hf, "intermediate_size", None) or 4 * hidden,
            max_position_embeddings=getattr(hf, "max_position_embeddings", None) or 2048,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)), decoder="generic",
        )

    @torch.inference_mode()
    def _find_final_norm(self) -> nn.Module:
        """The module the model calls first, after its last block, on a hidden-sized tensor: the final
        norm. The head is applied to a hidden state by substituting that module's input (the lm_head
        itself when the model has no final norm)."""
        inside = {id(m) for layer in self.layers for m in layer.modules()} | {id(self._full), id(self.model)}
        calls, done = [], []
        hooks = [self.layers[-1].register_forward_hook(lambda *_: done.append(True))]
        for module in self.model.modules():
            if id(module) not in inside:
                hooks.append(module.register_forward_pre_hook(
                    lambda m, args, kwargs: calls.append(m) if done and not calls and args and isinstance(args[0], Tensor)
                    and args[0].shape[-1] == self.config.hidden_size else None, with_kwargs=True))
        try:
            self.model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=self.embed.weight.device), use_cache=False)
        finally:
            for hook in hooks:
                hook.remove()
        return calls[0] if calls else self.lm_head

    CACHE_KINDS = ("static", "dynamic")

    @property
    def prefix_reuse(self) -> bool:
        """Whether the verifier of an early-exit plan may reuse the draft's blocks 0..E-1 (static cache
        only: a dynamic cache's mask length comes from block 0, which must then hold every position)."""
        return self.cache_kind == "static"

    @torch.inference_mode()
    def _choose_cache(self) -> str:
        """Static layers when the model masks by position (most families); a dynamic cache cut back to
        each call's start position when the model sizes its mask from the cache's length (older code
        such as Falcon's). Checked on the model itself: incremental logits must equal one parallel pass."""
        device = self.embed.weight.device
        ids = torch.arange(3, 10, device=device)[None] % self.config.vocab_size
        reference = self._call(Pending(ids, 0), 0, None, tuple(range(len(self.layers))))
        failures = []
        for kind in self.CACHE_KINDS:
            self.cache_kind = kind
            try:
                cache = self.new_cache(16)
                parts = [self._call(Pending(ids[:, :4], 0), 0, cache, tuple(range(len(self.layers))))]
                parts.append(self._call(Pending(ids[:, 4:5], 4), 4, cache, tuple(range(len(self.layers)))))
                self._call(Pending(ids[:, 5:7], 5), 5, cache, tuple(range(len(self.layers))))  # then roll back
                parts.append(self._call(Pending(ids[:, 5:7], 5), 5, cache, tuple(range(len(self.layers)))))
                diff = float((torch.cat(parts, dim=1) - reference).abs().max())
            except Exception as exc:  # a model that cannot run this cache fails in its own way
                failures.append(f"{kind} cache: {type(exc).__name__}")
                continue
            if diff <= 1e-3 * max(1.0, float(reference.abs().max())):
                return kind
            failures.append(f"{kind} cache: incremental logits differ by {diff:.1e}")
        raise LayerStackError("its KV cache cannot be cut back to a length (" + "; ".join(failures) + ")")

    @classmethod
    def from_folder(cls, folder: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> "HFDecoder":
        """The model saved in a generic artifact (config.json + safetensors; never remote code)."""
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, trust_remote_code=False,
                                                         use_safetensors=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ArtifactError(f"cannot load the generic model in {folder} ({exc}); rebuild the artifact") from None
        return cls(model.to(device))

    # -- the canonical decoder's interface -----------------------------------------------------------
    def new_cache(self, max_len: int, dtype=None, device=None):
        """A KV cache of full-length static layers, one per block (see the module docstring)."""
        from transformers.cache_utils import Cache, DynamicCache, StaticLayer

        if self.cache_kind == "dynamic":
            cache = DynamicCache()
        else:
            cache = Cache(layers=[StaticLayer(max_cache_len=max_len) for _ in self.layers])
        cache.max_len = max_len  # what TorchBackend.reserve reads
        return cache

    def embed_tokens(self, tokens: Tensor, pos: int) -> Pending:
        return Pending(tokens, pos)

    def run_blocks(self, h, pos: int, cache, start: int = 0, stop: int | None = None,
                   skip_attn=frozenset(), skip_mlp=frozenset(), attention=None) -> Tensor:
        """Blocks start..stop-1 (less the skipped ones) on ``h`` at positions pos..; returns the hidden
        state after the last block that ran."""
        if set(skip_attn) != set(skip_mlp):
            raise ArtifactError("the generic torch path skips whole blocks only (skip_attn must equal skip_mlp)")
        if attention is not None:
            raise NotImplementedError("the generic path has no per-sublayer attention override")
        stop = len(self.layers) if stop is None else stop
        run = tuple(i for i in range(start, stop) if i not in skip_attn)
        if not run:
            if isinstance(h, Pending):
                return self.embed(h.tokens)
            return h
        if self.cache_kind == "dynamic" and cache is not None and run[0] != 0:
            raise ArtifactError("with this model's dynamic KV cache every call must run block 0 (it sizes the mask)")
        if isinstance(h, Pending) and start != 0:
            raise ValueError("token embeddings can only enter the first block")
        kept = []
        hook = self.layers[run[-1]].register_forward_hook(lambda m, args, out: kept.append(_first(out)))
        try:
            self._call(h, pos, cache, run, logits_to_keep=1)
        finally:
            hook.remove()
        return kept[-1]

    def head(self, h: Tensor) -> Tensor:
        """The model's own final norm, lm_head and logit post-processing, on hidden states ``[B, T, d]``."""
        return self._call(h, 0, None, ())

    def forward(self, tokens: Tensor, pos: int = 0, cache=None) -> Tensor:
        return self._call(Pending(tokens, pos), pos, cache, tuple(range(len(self.layers))))

    # -- one call of the model's forward ---------------------------------------------------------------
    def _stack(self, run: tuple[int, ...]) -> nn.ModuleList:
        if len(run) == len(self.layers):
            return self._full
        if run not in self._stacks:
            self._stacks[run] = nn.ModuleList(self.layers[i] for i in run)
        return self._stacks[run]

    def _call(self, h, pos: int, cache, run: tuple[int, ...], logits_to_keep: int = 0) -> Tensor:
        substitute = None if isinstance(h, Pending) else h
        tokens = h.tokens if isinstance(h, Pending) else torch.zeros(h.shape[:2], dtype=torch.long, device=h.device)
        t = tokens.shape[1]
        kwargs = {"input_ids": tokens}
        positions = torch.arange(pos, pos + t, device=tokens.device)
        if "cache_position" in self._kwargs:
            kwargs["cache_position"] = positions
        if "position_ids" in self._kwargs:
            kwargs["position_ids"] = positions[None].expand(tokens.shape[0], -1)
        if "logits_to_keep" in self._kwargs and logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        if "use_cache" in self._kwargs:
            kwargs["use_cache"] = cache is not None
        if cache is not None:
            kwargs["past_key_values"] = cache
            if self.cache_kind == "dynamic":
                cache.crop(pos)  # roll back: this call rewrites positions pos.. of every block it runs
        hooks = []
        if substitute is not None:
            target = self.layers[run[0]] if run else self.final_norm

            def replace(module, args, kw):
                if args:
                    return (substitute,) + tuple(args[1:]), kw
                return args, {**kw, "hidden_states": substitute}

            hooks.append(target.register_forward_pre_hook(replace, with_kwargs=True))
        setattr(self.parent, self.attr, self._stack(run))
        try:
            return self.model(**kwargs).logits
        finally:
            setattr(self.parent, self.attr, self._full)
            for hook in hooks:
                hook.remove()
