"""The torch backend as the toolkit sees it (``backends/descriptor.py``): the canonical decoder over the artifact's
safetensors weights, or, for a model on the generic path, the model's own modules through transformers.

Imports nothing of torch until ``open``: ``inspect`` checks a torch artifact on a box without torch.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ...artifact.manifest import Manifest
from ...errors import ArtifactError, BackendUnavailableError, quote
from ..descriptor import BackendDescriptor


class TorchDescriptor(BackendDescriptor):
    name = "torch"
    writer = "speccompile.exporters.torch_files:write_torch_files"
    canonical_only = False

    def open(self, root: Path, manifest: Manifest, plans: dict, device: str):
        try:
            from .backend import DTYPES, TorchBackend, check_device
        except ImportError:
            raise BackendUnavailableError(
                "the torch backend needs PyTorch; install it (pip install torch) or use an ONNX artifact"
            ) from None
        check_device(device)
        if manifest.config.decoder == "generic":  # the model's own modules, through transformers
            from .hf_decoder import HF_FOLDER, HFDecoder

            if manifest.backends["torch"].get("hf_folder") != HF_FOLDER:
                raise ArtifactError(
                    f"manifest backends['torch'] of a generic-path artifact must name its model folder "
                    f"{HF_FOLDER!r}; the manifest is damaged: rebuild the artifact"
                )
            decoder = HFDecoder.from_folder(root / HF_FOLDER, DTYPES[manifest.dtype], device)
            return TorchBackend(decoder, device=device)
        record = manifest.backends["torch"]
        scales = record.get("int8_scales_file")
        return TorchBackend.from_files(
            root / record["weights"],
            manifest.config,
            dtype=manifest.dtype,
            device=device,
            int8_scales=None if scales is None else root / scales,
        )

    def check_before_open(self, root: Path, manifest: Manifest) -> None:
        from ..weights_check import REBUILD, check_geometry, compare_geometry, safetensors_shapes

        config = manifest.config
        if config.decoder == "canonical":
            relative = manifest.backends["torch"]["weights"]
            shapes = safetensors_shapes(root / relative, relative)
            check_geometry(config, shapes, f"weights file {quote(relative)}")
            if importlib.util.find_spec("torch") is not None:  # (inspect on a box without torch: the headers alone)
                from .decoder import check_decoder_tensors

                check_decoder_tensors(config, shapes, f"weights file {quote(relative)}", REBUILD)
        elif importlib.util.find_spec("transformers") is not None:  # the generic path
            # its model's own config.json, read without the weights, says what the opened decoder reports
            # (check_after_open): inspect refuses the manifests load refuses
            from .hf_decoder import HF_FOLDER, folder_geometry

            compare_geometry(config, folder_geometry(root / HF_FOLDER), f"{HF_FOLDER}/config.json")


__all__ = ["TorchDescriptor"]
