"""Exporters: the artifact's graphs for backends other than torch.

- ``onnx_graph.py``: the graph builder and its standard variant (ONNX ops only), the ops shared by every
  variant (embedding, MLP, rotary, mask, head);
- ``onnx_fused.py``: the fused variant (ONNX Runtime contrib ops, KV cache in place, optional weight-only
  quantization from ``onnx_quant.py``);
- ``onnx_blocks.py``: the block schedule, written once: which graph a variant builds for a run of blocks,
  and the draft-head graph;
- ``onnx_export.py``: the export, graph per segment of each plan's draft kind, one shared weights file;
- ``tensorrt.py``: TensorRT engines built from the ONNX graphs.
"""
