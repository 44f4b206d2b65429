"""The model ``devgraph serve`` serves: a random-weight preset, or a local Hugging Face checkpoint.

``source.py`` (``--model``: a preset or a directory, read in stages), ``hf_config.py`` (config.json in the
reference model's terms, or refused with every reason), ``weights.py`` (safetensors, lazily, into the
fused reference weights), ``generation.py`` (stop ids and sampling defaults), ``text.py`` (the tokenizer
interface), ``hf_tokenizer.py`` (the checkpoint's tokenizer and chat template through transformers, an
optional package), ``template_render.py`` and ``template_worker.py`` (chat templates rendered bounded, in
worker processes) and ``byte_tokenizer.py`` (the presets' bytes-as-tokens).
"""

from devgraph.serve.checkpoint.source import DEFAULT_CHECKPOINT_CONTEXT, Built, ModelSource, open_model

__all__ = ["DEFAULT_CHECKPOINT_CONTEXT", "Built", "ModelSource", "open_model"]
