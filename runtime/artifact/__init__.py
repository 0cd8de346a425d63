"""The artifact as data: the manifest's schema (dataclasses checked against JSON), the tuner's measured figures,
the conversion of manifests written by earlier toolkits, and the tokenizer file. The lowest layer of the runtime:
it imports nothing of drafting, decoding or the backends, so an edge box with numpy alone can read an artifact."""
