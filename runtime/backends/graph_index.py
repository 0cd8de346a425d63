"""Which exported graphs compute a segment: the ONNX Runtime and TensorRT backends' shared lookup.

An artifact's ONNX export (and the TensorRT engines built from it) holds one graph per piece of the
model that some plan needs. Each graph computes blocks ``start..stop-1`` (less skipped sublayers) and
ends in logits (the shared head) and/or the hidden state after its last block; *head graphs* take a
hidden state to logits (the shared head, or a plan's draft head). A segment is then one graph, or a
blocks graph followed by a head graph, or, for the full model when no whole-model graph is opened, a
prefix graph followed by the rest.

Graph records carry their ``segment`` (the exporter writes it); for an export whose graph records lack it (an
earlier record format), ``segments_from_plan_records`` reads it from the per-plan records (a reader of that
record format, not of plans: the exporter writes per plan only the graphs its draft kind's segments use).
Numpy only.
"""

from __future__ import annotations

from typing import Any

from ..artifact.manifest import DraftPlan
from ..segments import FINAL_HEAD, Segment, full_model

HIDDEN_OUTPUTS = ("hidden", "last_hidden")

Blocks = tuple  # Segment.blocks_key: (start, stop, skip_attn, skip_mlp, precision)


def _outputs(graph: dict) -> set[str]:
    return {o["name"] for o in graph.get("outputs", [])}


def segments_from_plan_records(record: dict[str, Any], plans: dict[str, DraftPlan], num_layers: int) -> dict[str, dict]:
    """``{graph key: segment record}`` from an old export's per-plan records: what each graph computes."""
    L, found = num_layers, {}
    if all("segment" in graph for graph in record.get("graphs", {}).values()):
        return found
    if "verify" in record.get("graphs", {}):
        found["verify"] = {"start": 0, "stop": L}
    for name, rec in record.get("plans", {}).items():
        plan = plans.get(name)
        if rec.get("kind") == "early_exit" and "prefix" in rec:
            e = rec["exit_layer"]
            found[rec["prefix"]] = {"start": 0, "stop": e}
            found[rec["suffix"]] = {"start": e, "stop": L}
            found[rec["head"]] = {"head_only": True, "head": FINAL_HEAD}
        elif rec.get("kind") == "layer_skip" and plan is not None:
            found[rec["draft"]] = {
                "start": 0,
                "stop": L,
                "skip_attn": sorted(set(plan.skip_attn)),
                "skip_mlp": sorted(set(plan.skip_mlp)),
            }
        if rec.get("draft_head") and plan is not None:
            found[rec["draft_head"]] = {"head_only": True, "head": plan.draft_head_file}
    return found


class GraphIndex:
    """Segments -> the graph keys that compute them, in order."""

    def __init__(
        self, record: dict[str, Any], plans: dict[str, DraftPlan], num_layers: int, opened: set[str] | None = None
    ):
        self.num_layers = num_layers
        graphs: dict[str, dict] = record.get("graphs", {})
        legacy = segments_from_plan_records(record, plans, num_layers)
        self.blocks: dict[tuple[Blocks, str | None], str] = {}  # (blocks, head or None for hidden) -> key
        self.heads: dict[str, str] = {}  # head ("final" or a draft head file) -> head graph key
        self.kv_layers: dict[str, set[int]] = {}
        for key, graph in graphs.items():
            if opened is not None and key not in opened:
                continue
            seg = graph.get("segment") or legacy.get(key)
            if seg is None:
                continue
            self.kv_layers[key] = {
                int(i["name"].split(".")[1])
                for i in graph.get("inputs", [])
                if i["name"].startswith("past_key_values.")
            }
            if seg.get("head_only"):
                self.heads.setdefault(seg["head"], key)
                continue
            blocks = (
                seg["start"],
                seg["stop"],
                tuple(seg.get("skip_attn", ())),
                tuple(seg.get("skip_mlp", ())),
                seg.get("precision"),
            )
            outputs = _outputs(graph)
            if "logits" in outputs:
                self.blocks.setdefault((blocks, FINAL_HEAD), key)
            if outputs & set(HIDDEN_OUTPUTS):
                self.blocks.setdefault((blocks, None), key)
        self._resolved: dict[Segment, list[str] | None] = {}

    def calls(self, segment: Segment) -> list[str] | None:
        """The graph keys that compute ``segment``, in order (None when the export lacks one)."""
        if segment not in self._resolved:
            self._resolved[segment] = self._resolve(segment)
        return self._resolved[segment]

    def _resolve(self, segment: Segment) -> list[str] | None:
        blocks = segment.blocks_key
        exact = self.blocks.get((blocks, segment.head))
        if exact is not None and segment.head is not None and not segment.keep_hidden:
            return [exact]
        body = self.blocks.get((blocks, None))
        if body is None:
            return self._split(segment)
        if segment.head is None:
            return [body]
        head = self.heads.get(segment.head)
        return None if head is None else [body, head]

    def _split(self, segment: Segment) -> list[str] | None:
        """A segment from block 0 with no skips as a prefix graph then the rest (the full model of an
        export whose only graphs are one early exit's: no whole-model graph is opened)."""
        start, stop, skip_attn, skip_mlp, precision = segment.blocks_key
        if start != 0 or skip_attn or skip_mlp or precision or segment.keep_hidden:
            return None
        for (blocks, head), key in sorted(self.blocks.items(), key=lambda item: -item[0][0][1]):
            if head is None and blocks[0] == 0 and 0 < blocks[1] < stop and not any(blocks[2:]):
                rest = self.calls(Segment(blocks[1], stop, head=segment.head))
                if rest is not None:
                    return [key] + rest
        return None

    def check(self, segment: Segment) -> str | None:
        """None when ``segment`` can run on these graphs, else why not (a missing graph, or graphs whose
        KV inputs are not the blocks the segment runs: an export and a manifest from different builds)."""
        calls = self.calls(segment)
        if calls is None:
            return f"the export has no graph for {segment.describe()}"
        heads = set(self.heads.values())
        have = set().union(*(self.kv_layers[key] for key in calls if key not in heads))
        want = {i for i in range(segment.start, segment.stop) if i not in segment.skip_attn}
        if have != want:
            return f"its graphs {calls} cache the KV of blocks {sorted(have)}, it runs {sorted(want)}"
        return None


def full_model_without_verify(
    record: dict[str, Any], plans: dict[str, DraftPlan], num_layers: int | None = None
) -> list[str] | None:
    """The graph keys that compute the full model when the whole-model ``verify`` graph is left unopened, or
    None when it is needed: when the other graphs compose the full model and none of them runs every block
    from the tokens (an export whose plans all exit at one block: prefix + suffix), a backend that packs
    each session's weights separately (ONNX Runtime's pre-packing, TensorRT engines) holds one copy.
    ``num_layers`` None: read from the ``verify`` graph's segment."""
    graphs = record.get("graphs", {})
    if num_layers is None:  # the whole-model graph's segment says (every export writes one)
        num_layers = (graphs.get("verify", {}).get("segment") or {}).get("stop")
        if num_layers is None:
            return None
    without = GraphIndex(record, plans, num_layers, opened=set(graphs) - {"verify"})
    if any(blocks[0] == 0 and blocks[1] == num_layers for blocks, _ in without.blocks):
        return None
    return without.calls(full_model(num_layers))


__all__ = ["GraphIndex", "full_model_without_verify", "segments_from_plan_records"]
