#!/usr/bin/env bash
# Run tests in a throw-away virtual environment, on versions other than the pinned ones (make test-latest,
# make test-hf-range). Never used by `make test` or .ci/run, whose versions come from constraints/ci.txt.
#
#   tools/suite-in-fresh-venv.sh NAME --pip 'PIP INSTALL ARGS' [--pip '...'] -- [PYTEST ARGS...]
#
# Makes build/venvs/NAME anew with $PYTHON (default python3), installs $TORCH (default torch==2.13.0,
# the CPU build on this project's machines; TORCH=torch takes the newest, a CUDA build on Linux), then runs
# one `pip install` per --pip, in order and without constraints, writes what it installed to
# build/venvs/NAME.versions.txt, runs pytest, and removes the environment (KEEP_VENV=1 keeps it). Exits with
# pytest's status.
set -euo pipefail
cd "$(dirname "$0")/.."
name=$1
shift
installs=()
while [[ $# -gt 0 && $1 != -- ]]; do
    [[ $1 == --pip && $# -ge 2 ]] || { echo "usage: $0 NAME --pip 'ARGS' [--pip 'ARGS'] -- [PYTEST ARGS]" >&2; exit 2; }
    installs+=("$2")
    shift 2
done
[[ $# -gt 0 ]] && shift # the --
venv=build/venvs/$name
python=${PYTHON:-python3}
torch=${TORCH:-torch==2.13.0}

rm -rf "$venv"
mkdir -p build/venvs
"$python" -m venv "$venv"
echo "== $name: pip install $torch"
"$venv/bin/python" -m pip install -q "$torch"
for args in "${installs[@]}"; do
    echo "== $name: pip install $args"
    # shellcheck disable=SC2086 # the pip arguments are a list on purpose
    "$venv/bin/python" -m pip install -q --no-build-isolation $args
done
"$venv/bin/python" -m pip freeze --exclude-editable >"$venv.versions.txt"
echo "== $name: $(grep -iE '^(torch|transformers|tokenizers|huggingface.hub|triton|aiohttp|ruff|mypy|pytest)==' \
    "$venv.versions.txt" | tr '\n' ' ')(all in $venv.versions.txt)"
status=0
"$venv/bin/python" -m pytest "$@" || status=$?
[[ ${KEEP_VENV:-0} == 1 ]] || rm -rf "$venv"
echo "== $name: pytest exit status $status"
exit "$status"
