"""Graph platforms that ship with devgraph: the CPU simulator (``sim``) and the ``torch.cuda`` graph
primitives the CUDA and ROCm plug-ins share (``torch_cuda``). They import only the contract and the root
leaves; a vendor's own platform lives in its plug-in distribution.
"""
