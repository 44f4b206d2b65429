"""Adapters that put other people's model code behind devgraph.

Each adapter imports its library lazily, on first use, so ``import devgraph`` never pulls it in:

* :mod:`devgraph.integrations.transformers`: Hugging Face ``generate()`` with its decode steps on device
  graphs (``pip install 'devgraph[transformers]'``; see docs/huggingface.md).
"""
