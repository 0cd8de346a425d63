"""Model families as data: one descriptor per family of transformers causal LMs, found by ``model_type``.

``FAMILIES`` maps each supported ``model_type`` to the ``"module:Class"`` of its descriptor (a ``Family``,
``family.py``), imported on first use. A descriptor says where the family keeps its tensors (``layout``) and
which switches of the one canonical decoder reproduce it (``arch_config``); ``speccompile/convert.py``
does the rest generically.

Adding a family is one module and one line: write ``<family>.py`` with a ``Family`` subclass (its
``model_types``, its ``LAYOUT`` or ``layout``, its ``arch_config``), and map each of its model types to it
below. A model type missing here is refused with ``UnsupportedModelError`` and runs on the generic path.
"""

from __future__ import annotations

from speccompile.runtime.registry import Registry

from .family import Family, Layout, UnsupportedModelError


class FamilyRegistry(Registry):
    """The draft registries' table, refusing an unknown model type the way conversion refuses a model
    (``UnsupportedModelError``, which ``choose_path`` turns into the generic path) rather than as an
    unknown artifact entry."""

    def check(self, model_type: str) -> None:
        if model_type not in self:
            raise UnsupportedModelError(
                f"architecture '{model_type}' is not supported; supported model types: {', '.join(self)}"
            )

    def load(self, name: str) -> type[Family]:
        self.check(name)
        return super().load(name)


FAMILIES = FamilyRegistry(
    "model family",
    __name__,
    {
        "llama": ".llama:Llama",
        "mistral": ".llama:Llama",
        "qwen2": ".llama:Qwen2",
        "qwen3": ".llama:Qwen3",
        "gemma": ".llama:Gemma",
        "phi3": ".llama:Phi3",
        "gpt2": ".gpt2:GPT2",
        "gpt_neox": ".gpt_neox:GPTNeoX",
        "opt": ".opt:OPT",
        "smollm3": ".llama:SmolLM3",
        "olmo2": ".llama:Olmo2",
        "phi": ".phi:Phi",
        "cohere": ".cohere:Cohere",
        "gemma3_text": ".gemma3:Gemma3",
        "mixtral": ".mixtral:Mixtral",
        "falcon": ".falcon:Falcon",
    },
)
"""``model_type`` -> ``"module:Class"`` of its descriptor (several types may share one class)."""


def family_for(model_type: str) -> Family:
    """The descriptor of ``model_type``; ``UnsupportedModelError`` (one line) for a type without one."""
    return FAMILIES.load(model_type)()


__all__ = ["FAMILIES", "Family", "Layout", "UnsupportedModelError", "family_for"]
