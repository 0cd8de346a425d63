"""Weight-only block quantization of the fused graphs' linear layers (``MatMulNBits``)."""

from __future__ import annotations

import functools
import re
from typing import Any

import numpy as np

CONTRIB = "com.microsoft"
QUANT_BITS = {"int8": 8, "int4": 4}
DEFAULT_BLOCK_SIZE = 32
# What ``Quantizer.tensors`` names a weight's quantized copy: ``<canonical>.<tag>[.scales|.zero_points]``, the tag
# being the scheme, with a precision self-draft's block size and symmetry after it (``int4.b128s``)
QUANTIZED_COPY = re.compile(r"\.int[48](\.b\d+s?)?(\.scales|\.zero_points)?$")
DEFAULT_ACCURACY_LEVEL = 4  # int8 activations: onnxruntime's fast CPU MatMulNBits path (int8 at level 0 has none);
# lossless only because the fused graphs make a k-row call compute what k one-row calls do (FusedGraph.padding)


class Quantizer:
    """Weight-only block quantization of linear weights for ``MatMulNBits``, with onnxruntime's own
    kernels (``quantize_matmul_4bits`` / ``quantize_matmul_8bits``: what
    ``onnxruntime.quantization.matmul_nbits_quantizer`` calls, without its onnx_ir dependency).

    Each quantized weight is added to the shared weights under a derived name
    (``<canonical>.int4``, ``.int4.scales``, ``.int4.zero_points``), so it is written once to
    ``weights.bin`` however many graphs use it; the float weight is then used by no graph (except the
    embedding table, which stays a float ``Gather``)."""

    def __init__(
        self, scheme: str, block_size: int, accuracy_level: int, symmetric: bool = False, tag: str | None = None
    ):
        if scheme not in QUANT_BITS:
            raise ValueError(f"unknown quantization {scheme!r}; use one of {sorted(QUANT_BITS)}")
        if block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"quantization block size must be a power of two >= 16, not {block_size}")
        self.scheme, self.bits, self.block_size = scheme, QUANT_BITS[scheme], block_size
        self.accuracy_level, self.symmetric = accuracy_level, symmetric
        # what the derived tensors' names end in: the scheme for a quantized target; a precision self-draft
        # names its block size and symmetry too, so drafts of other grids in the same file never share tensors
        self.tag = tag or scheme

    def record(self) -> dict[str, Any]:
        return {
            "scheme": self.scheme,
            "bits": self.bits,
            "block_size": self.block_size,
            "symmetric": self.symmetric,
            "accuracy_level": self.accuracy_level,
            "op": f"{CONTRIB}.MatMulNBits",
            "quantizer": "onnxruntime quantize_matmul_%dbits" % self.bits,
        }

    def tensors(self, weights: dict[str, np.ndarray], name: str) -> tuple[str, str, str | None]:
        """Names of (packed, scales, zero_points or None) for canonical weight ``name`` [out, in]."""
        from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

        base = f"{name}.{self.tag}"
        zp_name = None if self.symmetric else f"{base}.zero_points"
        if base not in weights:
            w = weights[name]
            n, k = w.shape
            bs = self.block_size
            k_blocks = (k + bs - 1) // bs
            wt = np.zeros((k_blocks * bs, n), np.float32)  # [K, N] as MatMul sees it, zero-padded to whole blocks
            wt[:k] = w.T
            kpack = 8 // self.bits
            packed = np.zeros((n, k_blocks, bs // kpack), np.uint8)
            scales = np.zeros((n, k_blocks), np.float32)
            zero_points = np.zeros((n, (k_blocks + kpack - 1) // kpack), np.uint8)
            quantize = quantize_matmul_4bits if self.bits == 4 else quantize_matmul_8bits
            quantize(packed, wt, scales, zero_points, bs, n, k, self.symmetric)
            weights[base], weights[f"{base}.scales"] = packed, scales.astype(w.dtype)
            if zp_name is not None:
                weights[zp_name] = zero_points
        return base, f"{base}.scales", zp_name

    def attributes(self, in_features: int, out_features: int) -> dict[str, int]:
        """A ``MatMulNBits`` node's attributes for a product of this scheme."""
        return {
            "K": in_features,
            "N": out_features,
            "bits": self.bits,
            "block_size": self.block_size,
            "accuracy_level": self.accuracy_level,
        }

    def one_row_path_differs(self, in_features: int, out_features: int) -> bool:
        """``one_row_path_differs`` for this quantizer's scheme, measured once per process and shape (a build
        exports its graphs several times)."""
        return one_row_path_differs(
            self.scheme, self.block_size, self.accuracy_level, self.symmetric, in_features, out_features
        )


@functools.cache
def one_row_path_differs(
    scheme: str, block_size: int, accuracy_level: int, symmetric: bool, in_features: int, out_features: int
) -> bool:
    """Whether this CPU's ``MatMulNBits`` computes a row alone (M = 1) differently from the same row among others
    (M >= 2), measured on a random weight of the model's shape. MLAS takes a one-row kernel for some schemes on some
    CPUs and not on others (which: docs/history.md, 'Figures behind the code's constants'): its result is slightly
    apart, which the next product's int8 activations turn into whole quantization steps. Where it does, the target
    graph gives every product at least two rows (``FusedGraph.pad_products``); a verify's rows then compute exactly
    the steps they replace. Rows of calls of 2, 3, 5 and 8 rows are compared with one another too: a difference
    there is not one padding row can remove (the artifact's load-time self-check,
    ``runtime/backends/onnx/selfcheck.py``, refuses to speculate where a verify still differs)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = {"w": (rng.standard_normal((out_features, in_features)) * 0.05).astype(np.float32)}
    quantizer = Quantizer(scheme, block_size, accuracy_level, symmetric)
    packed, scales, zero_points = quantizer.tensors(weights, "w")
    names = [packed, scales] + ([zero_points] if zero_points else [])
    node = helper.make_node(
        "MatMulNBits", ["x", *names], ["y"], domain=CONTRIB, **quantizer.attributes(in_features, out_features)
    )
    graph = helper.make_graph(
        [node],
        "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", in_features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", out_features])],
        [numpy_helper.from_array(weights[name], name) for name in names],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(CONTRIB, 1)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = rng.standard_normal((8, in_features)).astype(np.float32)
    many = {m: session.run(None, {"x": x[:m]})[0] for m in (2, 3, 5, 8)}
    if any(not np.array_equal(many[m], many[8][:m]) for m in (2, 3, 5)):
        return False  # rows differ among multi-row calls too: no padding makes a verify its steps
    alone = np.concatenate([session.run(None, {"x": x[i : i + 1]})[0] for i in range(8)])
    return not np.array_equal(alone, many[8])


__all__ = [
    "CONTRIB",
    "DEFAULT_ACCURACY_LEVEL",
    "DEFAULT_BLOCK_SIZE",
    "QUANTIZED_COPY",
    "QUANT_BITS",
    "Quantizer",
    "one_row_path_differs",
]
