"""The layers of devgraph, as data: the one table that docs/architecture.md shows (its tables are rendered
from here by ``python tools/layers.py docs --write``) and that tests/test_layers.py checks the code against.

Unit names: ``devgraph.runner.*`` is a folder and everything in it; a name without ``.*`` is exactly that
module (``devgraph`` is the package's own ``__init__.py``: the face). Inside an ordered folder (``ORDERS``)
names are relative to the folder: ``capture.advice`` is ``devgraph.runner.capture.advice``, ``__init__`` the
folder's own ``__init__.py``. A module belongs to the longest name that covers it; a module that no name
covers fails the check, and so does a name that covers no module.

After modules move (a folder split, a module renamed), ``python tools/layers.py`` names every module without
a row and every row without a module; ``python tools/layers.py propose devgraph.runner`` prints the levels
today's imports allow, a start for the folder's row in ``ORDERS`` (read it before pasting: the order is a
design, and a proposal only follows what the code does now).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "APPLICATIONS",
    "FACE",
    "FACE_PENDING",
    "LAYERS",
    "ORDERS",
    "PLUGIN_MAY_IMPORT",
    "PLUGIN_ROOTS",
    "Row",
]


@dataclass(frozen=True)
class Row:
    "One row of the table: its units and what they hold."

    units: tuple[str, ...]
    what: str


#: Bottom to top. A unit imports its own modules and the units of lower layers; units of one layer do not
#: import each other.
LAYERS: tuple[tuple[Row, ...], ...] = (
    (
        Row(
            ("devgraph.errors", "devgraph._version", "devgraph.messages", "devgraph._moved"),
            "exception types; the version; how messages show values (`shorten`, `kind`, `describe_error`) "
            "and the texts several layers and plug-ins share (the host-sync cause and advice); the old names "
            "of renamed modules (`_moved.py`: importable with a deprecation warning)",
        ),
    ),
    (
        Row(
            ("devgraph.extras", "devgraph.console", "devgraph.jsonfile"),
            "optional packages and the extra that installs them; how commands talk on a terminal (one-line "
            "errors, exit codes); JSON files a user names (a trace, tuned sizes, a checkpoint's config) read "
            "with one error for each way they can be wrong (`jsonfile.py`)",
        ),
    ),
    (
        Row(
            ("devgraph.contract.*",),
            "what a vendor implements and model code sees: `backend.py` (the backend ABC, "
            "`BackendOptions`), `platform.py` (the platform graph API), `keys.py` (`GraphKey`, `Batch`: one "
            "step, and `bucket_index`: the one bucketing rule), `inputs.py` (`StaticInput`), `phases.py`, "
            "`modes.py` (the words of the flag), `context.py` (the forward context), `breaks.py` (break ops)",
        ),
    ),
    (
        Row(
            ("devgraph.strategies.*",),
            "`full`, `breakable`, `tc_piecewise`, `eager`, their base, `compiling` (one compile for every "
            "size, and `CompilingStrategy`: the compile hooks `full` and `tc_piecewise` share), `adaptive` "
            "(a compile per size where one across sizes fails), `choice` (compiled or plain per key: both "
            "timed, the faster kept), `inplace` (writes into a view of an input kept in place for "
            "inductor), `regions` (the repeated block compiled once), `artifacts` (warm restarts), "
            "`precompile` (the compiled forward saved whole: warm starts without re-tracing), "
            "`compile_time` (start-up seconds by compile phase), `segments` (the segmented replay plan: "
            "graph segments and the break calls between them)",
        ),
        Row(
            ("devgraph.platforms.*",),
            "`sim/` (the CPU simulated graph: its capture, the device rules it enforces, the dispatch "
            "modes it runs under, its device memory), `torch_cuda.py` (the `torch.cuda` graph primitives "
            "the CUDA and ROCm plug-ins share) and `accelerator.py` (the vendor-neutral `accelerator` "
            "platform on `torch.accelerator.Graph`, registered by the built-in plug-in)",
        ),
        Row(
            ("devgraph.ranks.*",),
            "what a runner needs from `torch.distributed`: rank, the capture handshake (`handshake.py`), "
            "the per-step key check, data-parallel key agreement (`dp.py`; on a shared-memory board for "
            "ranks of one host (`shared_board.py`), on the device or on the gloo control group: "
            "`transport.py`), teardown",
        ),
    ),
    (
        Row(
            ("devgraph.registry.*",),
            "hook specifications, what a registration must satisfy, compatibility rules, the `Registry` "
            "(`plugins.py`), the built-in plug-in, `register_backend`",
        ),
    ),
    (
        Row(
            ("devgraph.flag.*",),
            "`--device-graph-mode`: the values a phase may hold (`values.py`, which asks the registry for "
            "the mode names and for which of them compile), size lists (`sizes.py`), recorded steps "
            "(`trace.py`) and sizes tuned to them (`tuning.py`), the parsed flag (`config.py`), and the "
            "factory (`factory.py`: device → platform, (phase, flag, features) → backend, `create_backend`)",
        ),
    ),
    (
        Row(
            ("devgraph.runner.*",),
            "`GraphRunner` (`graph_runner.py`: the front door, the lock, validation, "
            "`run`/`submit`/`verify`, delegation) and the pieces it delegates to, one owner each (their "
            "order is below): `options.py` (the keywords, `RunnerOptions`, resolved once into a frozen "
            "`RunnerPlan`), `life.py` (`GraphLife`: the graph sets, pool, guard, pending keys and released "
            "record, one `LifeState`, the transitions), `stepping.py` (`Stepper`: one step), `dispatch.py` "
            "(deciding: a function of the step, the life's `Readiness` and the `KeySet`s), `schedule.py`, "
            "`staging.py`, `memory.py` (graph bytes, exact and estimated), `background.py` "
            "(`BackgroundCapture`, which drives lives key by key), `shared_pool.py` (`GraphPool`), "
            "`handle.py` (`StepHandle`, `HostCopy`), `stats.py`, `state.py`, `verify.py`, `inspection.py`, "
            "`metrics.py`;"
            " `capture/` (capturing keys: `job.py` the capture loop and its report, `graph_set.py` one "
            "strategy's graphs, `sets.py` the primary and fallback sets, `pending.py`, `lazy.py`, "
            "`advice.py`, `probe.py`, `undeclared.py`); `guard/` (the address guard: events, paths to "
            "tensors, the observed run and the hazards it shows, host values baked at capture "
            "(`host_values.py`): the sanitizer); `outputs/` (pytree helpers, the output layout)",
        ),
    ),
    (
        Row(
            ("devgraph.reference.*", "devgraph.integrations.*"),
            "the reference model (model, RoPE and its scalings, attention, kernels, encoder, tensor "
            "parallelism); adapters for other people's model code (Hugging Face)",
        ),
    ),
    (Row(("devgraph.testing.*",), "the conformance kit and its pytest plug-in"),),
    (
        Row(
            ("devgraph.serve.*",),
            "the serving application as one unit (its order is below): `engine/` (paged KV, continuous "
            "batching, chunked prefill, the overlapped scheduler), `structured/` (constrained decoding: "
            "grammars, their limits and masks), `checkpoint/` (the model served: a Hugging Face checkpoint's "
            "config, weights, tokenizer, chat template and generation config, or a random-weight preset), "
            "`startup.py` (the timed start-up: the engine built from the arguments, by rank 0 and by each "
            "worker), `api/` (the OpenAI HTTP API), `tp/` (serving over several ranks), "
            "`bench/` (the load generator), `cli.py` (the arguments of `devgraph serve` and `devgraph bench "
            "serve`), `__main__.py`",
        ),
    ),
    (
        Row(
            ("devgraph.cli.*",),
            "the `devgraph` command: `main.py`, `info.py`, `demo.py`, `tp_demo.py`, `tune.py`; it reaches "
            "`serve/` only when it builds its parser",
        ),
    ),
    (
        Row(
            ("devgraph", "devgraph.__main__"),
            "the face: every public name (`devgraph.GraphRunner`, ...) and `python -m devgraph`",
        ),
    ),
)

#: The face: the module whose names are public. Applications and plug-ins import a public name from it,
#: never from the module that defines it; the library below it never imports it (it is what loads them).
FACE = "devgraph"

#: The applications on top of the library. Each imports a public name from the face (``from devgraph
#: import GraphRunner``), so a module of the library can move without touching them.
APPLICATIONS: tuple[str, ...] = (
    "devgraph.reference.*",
    "devgraph.integrations.*",
    "devgraph.testing.*",
    "devgraph.serve.*",
    "devgraph.cli.*",
)

#: Applications whose imports ``tools/face_imports.py`` has not rewritten yet (a branch that moves many
#: imports at once may list its folders here until it lands). The check lists their face violations apart
#: and fails once one has none (then its entry goes). Empty: every application imports from the face.
FACE_PENDING: tuple[str, ...] = ()

#: Bottom to top, per ordered folder: a unit imports its own modules and the units of lower levels; units
#: of one level do not import each other. A folder's own ``__init__`` sits on top (it may re-export).
ORDERS: dict[str, tuple[tuple[str, ...], ...]] = {
    "devgraph.runner": (
        # what every part reads: declared state, the key schedule, metrics, outputs, the address guard,
        # the shared pool and the step handle
        ("state", "schedule", "metrics", "handle", "shared_pool", "outputs.*", "guard.*", "capture.advice"),
        ("options", "dispatch", "verify", "capture.undeclared"),  # the plan resolved once; deciding
        ("staging", "stats", "capture.job"),
        ("capture.lazy", "capture.probe", "capture.pending", "inspection"),
        ("capture.graph_set",),  # one strategy's graphs
        ("capture.sets",),  # the primary and the fallback set
        ("memory",),
        ("life",),  # the graph life: one owner, one state, the transitions
        ("stepping",),  # one step: decide, agree, guard, replay
        ("graph_runner",),  # the front door
        ("background",),  # drives runners' lives key by key
        ("__init__", "capture"),
    ),
    "devgraph.serve": (
        ("engine.*", "checkpoint.*"),  # the engine and the model it serves: no HTTP, no ranks
        ("structured.*",),  # constrained decoding: the engine sees only its seam, engine/grammar.py
        ("startup",),  # the timed start-up: the engine built from the arguments (rank 0 and the workers)
        ("api.*",),  # the OpenAI API
        ("tp.*",),  # serving over several ranks: workers start up as rank 0 does
        ("api.server",),  # the server: the API, the engine loop and the ranks together
        ("bench.*",),  # the load generator speaks the API's protocol
        ("cli",),
        ("__main__", "__init__"),
    ),
}

#: Where plug-in distributions live: each folder holds one (its packages beside a pyproject.toml).
PLUGIN_ROOTS: tuple[str, ...] = ("backends/*", "docs/examples/*")

#: What a plug-in may import of devgraph besides the face: the strategies it subclasses, the platforms
#: CUDA-like devices share, and the texts messages share. A public name still comes from the face.
PLUGIN_MAY_IMPORT: tuple[str, ...] = ("devgraph.strategies.*", "devgraph.platforms.*", "devgraph.messages")
