"""ROCm's compatibility policy, registered through the ``devgraph_compatibility_rules`` hook.

Core devgraph knows nothing about ROCm; this rule is how the ROCm plug-in tells the resolver that
``breakable`` is not an option there (see :data:`devgraph_rocm.backends.BREAKABLE_REFUSED`).
"""

from __future__ import annotations

from devgraph import CompatibilityRule

__all__ = ["ROCM_NO_BREAKABLE", "ROCM_RULES"]

ROCM_NO_BREAKABLE = CompatibilityRule(
    name="rocm-no-breakable",
    reason="breakable segments are not validated on ROCm (hipGraph capture/end churn); tc_piecewise "
    "gives the same piecewise replay there",
    when=lambda features: features.get("platform") == "rocm",
    downgrade_to="tc_piecewise",
    backends=frozenset({"breakable"}),
)

#: Every rule the ROCm plug-in registers.
ROCM_RULES: tuple[CompatibilityRule, ...] = (ROCM_NO_BREAKABLE,)
