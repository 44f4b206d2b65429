"""The parts of :mod:`devgraph.integrations.transformers` (import that module, not these).

* :mod:`~devgraph.integrations.hf.lib`: the transformers package, imported on first use; the tested range.
* :mod:`~devgraph.integrations.hf.features`: what the integration needs from transformers, found by
  signature and attribute (the cache keyword, the output field, the static layers' write position), and
  the refusal that names the installed version, the missing piece and the supported range.
* :mod:`~devgraph.integrations.hf.cache`: one static cache sized once, with per-batch-size views.
* :mod:`~devgraph.integrations.hf.support`: which models are refused and which ``generate()`` calls fall
  back to Hugging Face's own loop.
* :mod:`~devgraph.integrations.hf.decode_loop`: the decode loop handed to ``generate(custom_generate=...)``.
* :mod:`~devgraph.integrations.hf.fast`: the opt-in fast path (compiled regions, packed GQA, windows),
  built from :mod:`~devgraph.integrations.hf.regions` (the compiled functions) and
  :mod:`~devgraph.integrations.hf.patching` (the dispatchers installed in the model).
* :mod:`~devgraph.integrations.hf.decoder`: :class:`DevgraphDecoder`, which ties them together.
"""
