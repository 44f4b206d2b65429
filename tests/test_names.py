"""Module names: a basename stands in two folders of devgraph/ only where the two modules hold one concept in
two places (docs/architecture.md, "Names"). A new module whose name another module already has, for another
concept, fails here: name it after what it holds."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import devgraph

ROOT = Path(devgraph.__file__).parent

#: Basenames that repeat on purpose, and the one concept each names.
SAME_CONCEPT: dict[str, str] = {
    "__init__.py": "a package's own module",
    "__main__.py": "``python -m`` of the package and of the server",
    "attention.py": "a reference model's attention: the decoder's (paged) and the vision encoder's",
    "batch.py": "a step's batch made into model inputs: the engine's scheduled step, the encoder's images",
    "config.py": "the settings of the folder's subject: the parsed flag, both reference models, the engine",
    "engine.py": "the serving engine and its tensor-parallel rank-0 subclass",
    "inputs.py": "a step's inputs: how one is declared (the contract), the reference model's own",
    "metrics.py": "Prometheus metrics: a runner's and the server's",
    "model.py": "a reference model: the decoder, the vision encoder, the decoder sharded over ranks",
    "platform.py": "a platform graph API: the contract and the CPU simulator's implementation of it",
    "regions.py": "regional compilation: the repeated block a strategy compiles once, the HF fast path's",
    "stats.py": "counters: a runner's and the engine's",
}


def _basenames() -> dict[str, list[str]]:
    places: dict[str, list[str]] = defaultdict(list)
    for path in sorted(ROOT.rglob("*.py")):
        places[path.name].append(str(path.relative_to(ROOT.parent)))
    return places


def test_a_repeated_basename_names_one_concept() -> None:
    repeated = {name: where for name, where in _basenames().items() if len(where) > 1}
    unexplained = {name: where for name, where in repeated.items() if name not in SAME_CONCEPT}
    assert not unexplained, (
        f"modules of one name for different concepts: {unexplained}; name the new module after what it "
        "holds (or, if both really hold one concept, add the name to SAME_CONCEPT with that concept)"
    )


def test_the_renamed_modules_left_no_file_of_their_old_name() -> None:
    """The names the issue listed (loop.py, plan.py, startup.py, pool.py) now stand once or not at all."""
    places = _basenames()
    for name in ("loop.py", "plan.py", "startup.py", "pool.py", "capture.py", "values.py", "rules.py"):
        assert len(places.get(name, [])) <= 1, (name, places[name])
