"""The parts of ``bench_serve_checkpoint.py``: ``plan`` (the GPU and smoke settings), ``build`` (the
checkpoint, its tokenizer and the prompt set), ``hf`` (transformers: the eager oracle and the compiled
static-cache baseline), ``servers`` (one ``devgraph serve --model`` subprocess per configuration) and
``report`` (token agreement, targets, the PNG)."""
