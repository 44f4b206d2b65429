"""The NPU ``full`` backend: one NPU graph per batch size, with host-side argument update at replay.

Ascend attention kernels (``npu_fused_infer_attention_score``, ``_npu_paged_attention``, ...) take the
per-request sequence lengths as a host-side list, baked into the captured task. Updating a device
tensor does not change it; the graph must re-issue those ops with the new list before each replay,
through ``NPUGraph.update(cpu_update_input=[{"actual_seq_lengths_kv": [...]}])`` — what SGLang's NPU
graph runner and vllm-ascend do. Here the engine declares the lengths as a host-side runner input::

    GraphRunner(model.forward, phase="decode", device="npu",
                inputs={"input_ids": StaticInput(torch.int64), ...,
                        "actual_seq_lengths_kv": StaticInput(torch.int64, fill=0, host=True)})

and :meth:`NpuFullGraphBackend.replay` reads that CPU buffer (real rows, then the fill in padding rows)
and calls ``update`` before ``replay``. The op keyword defaults to the input's name; map other names
with the backend option ``host_update`` (``{"seq_lens": "actual_seq_kvlen"}``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from devgraph import ConfigError, GraphKey, ReplayError, StaticInput
from devgraph.strategies import FullGraphBackend
from devgraph.strategies.full import FullEntry

if TYPE_CHECKING:
    from devgraph_npu.platform import NpuPlatform

__all__ = ["NpuFullGraphBackend"]

logger = logging.getLogger(__name__)


class NpuFullGraphBackend(FullGraphBackend):
    """One Ascend NPU graph per batch size; host-side inputs re-issue attention ops via ``NPUGraph.update``.

    Options (``BackendOptions.extra``): ``host_update``, a mapping of host-side input name -> op keyword
    to update (default: every ``StaticInput(host=True)``, under its own name).
    """

    name = "full"
    platform: NpuPlatform

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # (host-side input name, op keyword, its StaticInput) per input updated before each replay
        self._host_updates: tuple[tuple[str, str, StaticInput], ...] = ()
        self._updatable: dict[GraphKey, bool] = {}

    @property
    def host_updates(self) -> Mapping[str, str]:
        """Host-side input name -> op keyword updated before each replay."""
        return {name: keyword for name, keyword, _ in self._host_updates}

    def prepare(self, inputs: Mapping[str, StaticInput], keys: Sequence[GraphKey] = ()) -> None:
        host_inputs = [name for name, spec in inputs.items() if spec.host]
        mapping = self.options.extra.get("host_update")
        if mapping is None:
            mapping = {name: name for name in host_inputs}
        if not isinstance(mapping, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()
        ):
            raise ConfigError(
                f"npu:full option host_update must map input names to op keywords, got {mapping!r}"
            )
        unknown = sorted(set(mapping) - set(host_inputs))
        if unknown:
            raise ConfigError(
                f"npu:full option host_update names {unknown}, which are not host-side inputs of the "
                f"{self.phase} runner (host-side: {host_inputs or 'none'}); declare them as "
                "StaticInput(..., host=True)"
            )
        if mapping and not self.platform.supports_host_update():
            raise ConfigError(
                "host-side inputs need NPUGraph.update, and this torch-npu's torch.npu.graph has no "
                "auto_dispatch_capture: upgrade torch-npu, or drop host=True inputs"
            )
        self._host_updates = tuple((name, keyword, inputs[name]) for name, keyword in mapping.items())

    def _capture(self, key: GraphKey, forward_fn: Callable[[], Any]) -> FullEntry:
        entry = super()._capture(key, forward_fn)
        if self._host_updates:
            records = self.platform.update_records(entry.graph)
            keywords = {kw for _, kw, _ in self._host_updates}
            updatable = records is None or any(keywords & rec for rec in records)
            if not updatable:
                logger.warning(
                    "npu:full %s: host-side inputs %s were declared but the capture recorded no op "
                    "called with those keywords (recorded ops: %d); NPUGraph.update has nothing to re-issue, "
                    "so attention will replay with its capture-time lengths. Pass the lengths to the "
                    "attention op as keyword arguments (e.g. actual_seq_lengths_kv=...) and use an op "
                    "torch-npu can update",
                    key,
                    sorted(keywords),
                    len(records or []),
                )
            self._updatable[key] = updatable
        return entry

    def host_update_input(self, key: GraphKey, static_inputs: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """The ``cpu_update_input`` entry for a replay of ``key``: each host buffer's rows for the key
        (real rows, then the padding fill), as Python lists."""
        update: dict[str, Any] = {}
        for name, keyword, spec in self._host_updates:
            buf = static_inputs[name]
            if buf.device.type != "cpu":
                raise ReplayError(
                    f"host-side input {name!r} is on {buf.device}; NPUGraph.update reads host memory "
                    "(declare it StaticInput(..., host=True))"
                )
            update[keyword] = buf[: spec.rows(key.size(spec.axis))].tolist()
        return update

    def replay(self, key: GraphKey, static_inputs: Mapping[str, torch.Tensor]) -> Any:
        entry = self._entries.get(key)
        if entry is not None and self._host_updates and self._updatable.get(key, True):
            update = self.host_update_input(key, static_inputs)
            try:
                self.platform.update_graph(cast(FullEntry, entry).graph, [update])
            except Exception as exc:
                raise ReplayError(
                    f"NPUGraph.update of the graph for {key} with host-side inputs {sorted(update)} "
                    f"failed: {type(exc).__name__}: {exc}"
                ) from exc
        return super().replay(key, static_inputs)

    def cleanup(self) -> None:
        super().cleanup()
        self._updatable.clear()
