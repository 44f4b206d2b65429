"""``VerifyResult``: a step's graph output against eager output on the same inputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from devgraph.contract.keys import GraphKey
from devgraph.runner.outputs.trees import flatten, max_abs, max_abs_diff, tensor_leaves

__all__ = ["VerifyResult", "compare", "default_rtol"]


@dataclass(frozen=True)
class VerifyResult:
    """Graph output vs eager output for one step.

    ``max_abs_diff``: against eager run on the runner's own padded static buffers: same kernels, same
    shapes, so it is 0 unless the graph baked in state that eager reads afresh (an input the forward
    reads outside the runner, or host state such as a forward-context value under ``full``).
    ``max_abs_diff_unpadded``: against eager on the caller's ``n`` rows. This also catches staging bugs
    (an input not copied, padding leaking into real rows); kernels picked for a different row count may
    round differently. ``ok`` holds when the structures match (containers, tensor shapes and the values of
    non-tensor leaves), at least one tensor was compared, and both differences are within
    ``rtol * scale`` (``scale`` = max |eager|).
    """

    n: int
    key: GraphKey | None
    replayed: bool
    max_abs_diff: float
    max_abs_diff_unpadded: float
    scale: float
    rtol: float
    leaves: int = 0
    structure_matches: bool = True

    @property
    def size(self) -> int | None:
        """The padded token count that replayed (``None``: the step ran eagerly)."""
        return self.key.tokens if self.key is not None else None

    @property
    def ok(self) -> bool:
        if not self.structure_matches or self.leaves == 0:
            return False
        bound = self.rtol * max(self.scale, 1e-30)
        return self.max_abs_diff <= bound and self.max_abs_diff_unpadded <= bound


def default_rtol(outputs: Any) -> float:
    """2e-2 when any floating output is 16-bit, else 1e-4."""
    low_precision = any(t.element_size() <= 2 and t.is_floating_point() for t in tensor_leaves(outputs))
    return 2e-2 if low_precision else 1e-4


def compare(
    n: int, key: GraphKey | None, graph: Any, padded: Any, unpadded: Any, rtol: float | None
) -> VerifyResult:
    """Build the :class:`VerifyResult` of one verified step."""
    leaves = len(tensor_leaves(unpadded))
    same_structure = _structure(graph) == _structure(unpadded)
    return VerifyResult(
        n,
        key,
        key is not None,
        max_abs_diff(graph, padded),
        max_abs_diff(graph, unpadded),
        max_abs(unpadded),
        rtol if rtol is not None else default_rtol(unpadded),
        leaves,
        same_structure,
    )


def _structure(tree: Any) -> Any:
    """Containers, tensor shapes, and the values of plain leaves (a graph returns the Python values of
    its capture: a count computed from the padded size differs from eager's)."""
    leaves, spec = flatten(tree)
    plain = (int, float, str, bool, type(None))
    return spec, [
        tuple(t.shape) if isinstance(t, torch.Tensor) else (t if isinstance(t, plain) else type(t))
        for t in leaves
    ]
