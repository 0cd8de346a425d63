"""The generic torch path: any transformers causal LM whose decoder layers form a list, run through its
own modules, behind the same interface as the canonical ``Decoder`` (``runtime/backends/torch/decoder.py``).

Nothing here knows a family's insides. Every operation is one call of the model's own ``forward`` with
three small interventions, so masks, positions, rotary tables, softcapping and logit scaling are always
the model's own code:

- each block that should not run (whole-block skipping, early exit, or the verifier's blocks E..L-1) is
  replaced, for the call, by a stand-in that returns its input hidden state unchanged, in the block's own
  output format, and answers any attribute the model reads off the block (its attention type) from the
  block; the list keeps its length and order, so code that indexes per-layer settings by position in the
  list (``config.layer_types[i]``) and each layer's ``layer_idx`` (its own KV slot) stay right;
- a forward pre-hook on the first block that runs replaces its input with a given hidden state (to
  start mid-stack), or, when no block runs, on the final norm (to apply the head to a hidden state);
- forward hooks on the blocks that run keep the last one's output (the exit hidden state).

The KV cache is transformers' own ``Cache`` of full-length ``StaticLayer``s: every layer writes at the
absolute positions of the call and the model masks keys by position, so rolling back after a rejection is
just starting the next call at an earlier position (docs/design.md section 3). Sliding-window layers get a full
layer too (the window is applied by the model's mask), because a ring buffer cannot be cut back. Models
that size their mask from the cache's fill level (older code such as Falcon's) get a ``DynamicCache`` cut
back to each call's start position instead; models that build a padding mask from that fill level (older
code such as BART's decoder) are also given an all-ones 2-D attention mask of the call's true length, and
models that derive position ids their own way (RoBERTa's padding offset) are not given any.
Which of these a model needs is decided on the model itself at construction: a probe replays what the
runtime does (prompt, decode, early-exit draft and verify with a rejected round in between, whole-block
skip, rollback) and must reproduce the model's own parallel pass.

Only imported by the torch backend of an artifact built on this path (it imports transformers).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ...artifact.manifest import ArchConfig
from ...errors import ArtifactError

HF_FOLDER = "weights"  # where a generic artifact keeps the model's config.json and model.safetensors


class LayerStackError(Exception):
    """The model has no list of decoder layers this path can drive (raised with the reason)."""


def find_layer_stack(model: nn.Module) -> tuple[nn.Module, str, nn.ModuleList]:
    """The ``ModuleList`` of decoder layers and the module that holds it, found by walking the module tree
    (not by a table of names): the longest list of blocks (modules with parameters, not single linear or
    embedding layers) that is not nested inside another such list's blocks, so a mixture-of-experts list
    inside a block never wins over the blocks themselves; a list of one class wins a tie. A list may mix
    block classes (decoders that interleave cross-attention blocks)."""
    candidates = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if any(isinstance(m, (nn.Linear, nn.Embedding)) or next(m.parameters(), None) is None for m in module):
            continue
        candidates.append((name, module))
    outer = [
        (name, module)
        for name, module in candidates
        if not any(name.startswith(other + ".") and name != other for other, _ in candidates)
    ]
    if not outer:
        raise LayerStackError("no list of decoder layers found in the module tree")
    name, stack = max(outer, key=lambda c: (len(c[1]), len({type(m) for m in c[1]}) == 1))
    parent_name, _, attr = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), attr, stack


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


class _Skipped(nn.Module):
    """Stands in for a block that does not run in a call: returns its input hidden state unchanged, in the
    block's output format (a tensor, or a tuple whose first element is the hidden state), and answers any
    other attribute from the block (held, not registered)."""

    def __init__(self, block: nn.Module, tuple_len: int):
        super().__init__()
        object.__setattr__(self, "_block", block)
        params = [
            p
            for p in inspect.signature(block.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        self._hidden_name = params[0].name if params else "hidden_states"
        self._tuple_len = tuple_len

    def forward(self, *args, **kwargs):
        h = args[0] if args else kwargs.get(self._hidden_name, kwargs.get("hidden_states"))
        return (h,) + (None,) * (self._tuple_len - 1) if self._tuple_len else h

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_block"), name)


def _text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _heads(hf, hidden: int) -> tuple[int, int, int]:
    """(heads, kv heads, head size) as the generic decoder records them from a transformers config."""
    heads = getattr(hf, "num_attention_heads", None) or 1
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    return heads, kv_heads, getattr(hf, "head_dim", None) or max(1, hidden // heads)


def folder_geometry(folder: Path) -> dict[str, int | None]:
    """The geometry a generic artifact's model states in its config.json (read without its weights): what
    ``HFDecoder.config`` reports once the model is loaded, None where the config does not say."""
    from transformers import AutoConfig

    try:
        hf = _text_config(AutoConfig.from_pretrained(str(folder), trust_remote_code=False))
    except (OSError, ValueError, KeyError) as exc:
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ArtifactError(
            f"cannot read the generic model's config in {folder} ({why}); rebuild the artifact"
        ) from None
    hidden = getattr(hf, "hidden_size", None)
    heads, kv_heads, head_dim = _heads(hf, hidden or 1)
    return {
        "vocab_size": getattr(hf, "vocab_size", None),
        "hidden_size": hidden,
        "num_layers": getattr(hf, "num_hidden_layers", None),
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim if hidden else None,
    }


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
        # a model that multiplies by its input embedding itself (no output module) shares it as the head
        head = model.get_output_embeddings()
        self.lm_head = head if head is not None else self.embed
        if self.embed is None or getattr(self.lm_head, "weight", None) is None:
            raise LayerStackError("the model has no input or output embedding to draft with")
        accepted = set(inspect.signature(model.forward).parameters)
        self._kwargs = {
            k
            for k in ("cache_position", "position_ids", "logits_to_keep", "use_cache", "past_key_values")
            if k in accepted
        }
        if "past_key_values" not in self._kwargs:
            raise LayerStackError("the model's forward takes no past_key_values, so its KV cache cannot be driven")
        self._mask = False  # pass an all-ones 2-D attention mask of the call's length (see _choose_cache)
        self._positions = "position_ids" in self._kwargs  # pass position_ids (see _choose_cache)
        self._tuple_len = 0  # a block's output: 0 for a tensor, else the length of its tuple
        self._stacks: dict[tuple[int, ...], nn.ModuleList] = {}
        self.final_norm, hidden = self._find_final_norm()
        self.config = self._arch_config(model_type or model.config.model_type, hidden)
        self.cache_kind = "static"
        self._choose_cache("attention_mask" in accepted)

    # -- construction ------------------------------------------------------------------------------
    def _arch_config(self, model_type: str, hidden: int) -> ArchConfig:
        hf = _text_config(self.model.config)
        heads, kv_heads, head_dim = _heads(hf, hidden)
        return ArchConfig(
            model_type=model_type,
            vocab_size=self.lm_head.weight.shape[0],
            hidden_size=hidden,
            num_layers=len(self.layers),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=getattr(hf, "intermediate_size", None) or 4 * hidden,
            max_position_embeddings=getattr(hf, "max_position_embeddings", None) or 2048,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            decoder="generic",
        )

    @torch.inference_mode()
    def _find_final_norm(self) -> tuple[nn.Module, int]:
        """The module the model calls first, after the last block that runs, on a tensor of the blocks'
        width: the final norm. The head is applied to a hidden state by substituting that module's input (the lm_head
        itself when the model has no final norm). Also returns that width (the hidden size: it may differ
        from the embeddings', as in ELECTRA), and records the blocks' output format for ``_Skipped``."""
        inside = {id(m) for layer in self.layers for m in layer.modules()} | {id(self._full), id(self.model)}
        calls, width = [], []

        def block(module, args, output):  # the latest block that ran: what follows it is the head
            if module is self.layers[0]:
                self._tuple_len = len(output) if isinstance(output, (tuple, list)) else 0
            width[:] = [_first(output).shape[-1]]
            calls.clear()

        def after(module, args, kwargs):
            if width and not calls and args and isinstance(args[0], Tensor) and args[0].shape[-1] == width[0]:
                calls.append(module)

        hooks = [layer.register_forward_hook(block) for layer in self.layers]
        hooks += [
            m.register_forward_pre_hook(after, with_kwargs=True) for m in self.model.modules() if id(m) not in inside
        ]
        try:
            self.model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=self.embed.weight.device), use_cache=False)
        finally:
            for hook in hooks:
                hook.remove()
        if not width:
            raise LayerStackError("the model's forward did not run its layer list")
        return (calls[0] if calls else self.lm_head), width[0]

    CACHE_KINDS = ("static", "dynamic")

    @property
    def prefix_reuse(self) -> bool:
        """Whether the verifier of an early-exit plan may reuse the draft's blocks 0..E-1 (static cache
        only: a dynamic cache's mask length comes from block 0, which must then hold every position)."""
        return self.cache_kind == "static"

    @torch.inference_mode()
    def _choose_cache(self, takes_mask: bool) -> None:
        """Static layers when the model masks by position (most families); a dynamic cache cut back to
        each call's start position when the model sizes its mask or positions from the cache's length
        (older code such as Falcon's or RoBERTa's); either with an explicit all-ones attention mask when
        the model builds a padding mask from the cache's fill level (BART-style decoders); with explicit
        position ids unless the model derives its own (RoBERTa's padding offset). The first combination
        with which ``_probe`` reproduces the model's own parallel pass wins."""
        failures = []
        for positions in (True, False) if self._positions else (False,):
            for kind in self.CACHE_KINDS:
                for mask in (False, True) if takes_mask else (False,):
                    self.cache_kind, self._mask, self._positions = kind, mask, positions
                    label = kind + (" + mask" if mask else "") + ("" if positions else " without position ids")
                    try:
                        diff, scale = self._probe()
                    except Exception as exc:  # a model that cannot run this cache fails in its own way
                        failures.append(f"{label}: {type(exc).__name__}: {' '.join(str(exc).split())[:120]}")
                        continue
                    if diff <= 1e-3 * max(1.0, scale):
                        return
                    failures.append(f"{label}: incremental logits differ by {diff:.1e}")
        unique = list(dict.fromkeys(failures))
        raise LayerStackError(
            "its KV cache cannot be cut back to a length ("
            + "; ".join(unique[:4])
            + (f"; {len(unique) - 4} more" if len(unique) > 4 else "")
            + ")"
        )

    def _probe(self) -> tuple[float, float]:
        """Replay the runtime's calls on one cache and compare with one parallel pass of the full model: a
        prompt, a decode step, an early-exit draft of two tokens and its verify (blocks 0..E-1 on the
        fresh tokens and E..L-1 on all when prefix reuse applies, else the full model), a rejected round,
        a whole-block-skip draft, and the rewrite of their positions, leaving stale entries behind.
        Returns (max |diff|, max |reference|)."""
        device = self.embed.weight.device
        n, vocab = len(self.layers), self.config.vocab_size
        ids = torch.arange(3, 13, device=device)[None] % vocab
        junk = (ids + 7) % vocab
        reference = self.model(input_ids=ids).logits  # the model's own call, none of our arguments
        cache = self.new_cache(ids.shape[1] + 1)  # tight: a mask sized from a stale fill level overflows it
        exit_layer = max(1, n // 2)
        parts = [self.forward(ids[:, :4], 0, cache), self.forward(ids[:, 4:5], 4, cache)]
        h5 = self.run_blocks(Pending(ids[:, 5:6], 5), 5, cache, 0, exit_layer)  # draft two tokens
        self.run_blocks(Pending(junk[:, 6:7], 6), 6, cache, 0, exit_layer)
        if self.prefix_reuse:
            fresh = self.run_blocks(Pending(ids[:, 6:8], 6), 6, cache, 0, exit_layer)
            parts.append(self.head(self.run_blocks(torch.cat((h5, fresh), 1), 5, cache, exit_layer)))
        else:
            parts.append(self.forward(ids[:, 5:8], 5, cache))
        self.forward(junk[:, 8:11], 8, cache)  # a round whose tokens all get rejected
        if n > 2:  # a whole-block skip draft at 8
            self.run_blocks(Pending(junk[:, 8:9], 8), 8, cache, skip_attn={1}, skip_mlp={1})
        parts.append(self.forward(ids[:, 8:10], 8, cache))
        return float((torch.cat(parts, dim=1) - reference).abs().max()), float(reference.abs().max())

    @classmethod
    def from_folder(cls, folder: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> "HFDecoder":
        """The model saved in a generic artifact (config.json + safetensors; never remote code)."""
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(folder), dtype=dtype, trust_remote_code=False, use_safetensors=True
            )
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

    def run_blocks(
        self,
        h,
        pos: int,
        cache,
        start: int = 0,
        stop: int | None = None,
        skip_attn=frozenset(),
        skip_mlp=frozenset(),
        keys_values=None,
    ) -> Tensor:
        """Blocks start..stop-1 (less the skipped ones) on ``h`` at positions pos..; returns the hidden
        state after the last block that ran."""
        if set(skip_attn) != set(skip_mlp):
            raise ArtifactError("the generic torch path skips whole blocks only (skip_attn must equal skip_mlp)")
        if keys_values is not None:
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
        kept = []  # the output of the last block that ran (a model may pass over a block, e.g. cross-attention)
        hooks = [self.layers[i].register_forward_hook(lambda m, args, out: kept.append(_first(out))) for i in run]
        try:
            self._call(h, pos, cache, run, logits_to_keep=1)
        finally:
            for hook in hooks:
                hook.remove()
        return kept[-1]

    def head(self, h: Tensor) -> Tensor:
        """The model's own final norm, lm_head and logit post-processing, on hidden states ``[B, T, d]``."""
        return self._call(h, 0, None, ())

    def forward(self, tokens: Tensor, pos: int = 0, cache=None) -> Tensor:
        return self._call(Pending(tokens, pos), pos, cache, tuple(range(len(self.layers))))

    # -- one call of the model's forward ---------------------------------------------------------------
    def _stack(self, run: tuple[int, ...]) -> nn.ModuleList:
        """The full-length layer list of a call: the blocks in ``run``, stand-ins for the others."""
        if len(run) == len(self.layers):
            return self._full
        if run not in self._stacks:
            keep = set(run)
            self._stacks[run] = nn.ModuleList(
                layer if i in keep else _Skipped(layer, self._tuple_len) for i, layer in enumerate(self.layers)
            )
        return self._stacks[run]

    def _call(self, h, pos: int, cache, run: tuple[int, ...], logits_to_keep: int = 0) -> Tensor:
        substitute = None if isinstance(h, Pending) else h
        tokens = h.tokens if isinstance(h, Pending) else torch.zeros(h.shape[:2], dtype=torch.long, device=h.device)
        t = tokens.shape[1]
        kwargs = {"input_ids": tokens}
        positions = torch.arange(pos, pos + t, device=tokens.device)
        if "cache_position" in self._kwargs:
            kwargs["cache_position"] = positions
        if self._positions:  # a copy per row: some models add an offset in place
            kwargs["position_ids"] = positions[None].repeat(tokens.shape[0], 1)
        if "logits_to_keep" in self._kwargs and logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        if "use_cache" in self._kwargs:
            kwargs["use_cache"] = cache is not None
        if self._mask:
            kwargs["attention_mask"] = torch.ones(tokens.shape[0], pos + t, dtype=torch.long, device=tokens.device)
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

            hooks.append(target.register_forward_pre_hook(replace, with_kwargs=True, prepend=True))
        setattr(self.parent, self.attr, self._stack(run))
        try:
            return self.model(**kwargs).logits
        finally:
            setattr(self.parent, self.attr, self._full)
            for hook in hooks:
                hook.remove()
