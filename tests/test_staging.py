"""One validation on every path, inputs never changed by the forward, StaticInput fills checked up front.

Every path of ``run()``/``verify()`` (a replayed graph, eager past the largest size, eager before
``capture()``, ``disabled``) validates a step the same way, before anything is written, and raises the
same :class:`InputError`.
"""

from __future__ import annotations

import re

import pytest
import torch

from devgraph import ConfigError, GraphRunner, InputError, StaticInput
from devgraph.contract.keys import GraphKey
from devgraph.runner.staging import StaticBuffers

SIZES = [1, 2, 4]
INPUTS = {"x": StaticInput(torch.float32, (4,), fill=0.0), "idx": StaticInput(torch.int64, fill=7)}
W = torch.arange(12, dtype=torch.float32).reshape(4, 3) / 10


def forward(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return x @ W + idx[:, None].float()


def good(n: int) -> dict[str, torch.Tensor]:
    return {"x": torch.ones(n, 4), "idx": torch.arange(n) % 5}


def runner_on(path: str, fn=forward) -> GraphRunner:
    """A runner whose step of 3 rows (or 6 for ``past_largest``) takes ``path``."""
    runner = GraphRunner(
        fn,
        phase="decode",
        inputs=INPUTS,
        device="cpu",
        mode="disabled" if path == "disabled" else "full",
        sizes=SIZES,
    )
    if path != "before_capture":
        runner.capture()
    return runner


PATHS = ["graph", "past_largest", "before_capture", "disabled"]
N_FOR = {"graph": 3, "past_largest": 6, "before_capture": 3, "disabled": 3}

BAD_STEPS = [
    # (what, n, inputs for a step of N rows -> kwargs, fragment of the message)
    (
        "wrong row count",
        "N",
        lambda n: {"x": torch.ones(n + 1, 4), "idx": torch.zeros(n, dtype=torch.int64)},
        "shape",
    ),
    ("n < 0", -1, good, "must be >= 0"),
    ("n = 0", 0, good, "n=0"),
    ("float n", 2.5, good, "must be a Python int"),
    ("str n", "2", good, "must be a Python int"),
    ("bool n", True, good, "must be a Python int"),
    ("tensor n", torch.tensor(2), good, "must be a Python int"),
    (
        "0-dim input",
        None,
        lambda n: {"x": torch.tensor(1.0), "idx": torch.zeros(n, dtype=torch.int64)},
        "0-dim",
    ),
    (
        "list input",
        "N",
        lambda n: {"x": [[0.0] * 4] * n, "idx": torch.zeros(n, dtype=torch.int64)},
        "must be a torch.Tensor",
    ),
    (
        "wrong dtype",
        "N",
        lambda n: {"x": torch.ones(n, 4, dtype=torch.float64), "idx": torch.zeros(n, dtype=torch.int64)},
        "torch.float64",
    ),
    (
        "wrong device",
        "N",
        lambda n: {"x": torch.ones(n, 4, device="meta"), "idx": torch.zeros(n, dtype=torch.int64)},
        "meta",
    ),
    (
        "wrong row shape",
        "N",
        lambda n: {"x": torch.ones(n, 5), "idx": torch.zeros(n, dtype=torch.int64)},
        "shape",
    ),
    ("missing input", "N", lambda n: {"x": torch.ones(n, 4)}, "missing ['idx']"),
    ("extra input", "N", lambda n: {**good(n), "y": torch.ones(n)}, "unexpected ['y']"),
]


def _message(runner: GraphRunner, n, inputs) -> str:
    before = {k: v.clone() for k, v in runner.static_inputs.items()}
    with pytest.raises(InputError) as info:
        runner.run(n, **inputs)
    for name, value in runner.static_inputs.items():
        assert torch.equal(value, before[name]), f"{name} was written before the step was refused"
    return str(info.value)


FORWARD_CALLS: list[int] = []


def counting(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    FORWARD_CALLS.append(x.shape[0])
    return forward(x, idx)


@pytest.fixture(scope="module")
def runners():
    """One runner per path, shared by the bad-step cases (a refused step changes nothing)."""
    built = {path: runner_on(path, counting) for path in PATHS}
    yield built
    for runner in built.values():
        runner.close()


@pytest.mark.parametrize(("what", "n", "make", "fragment"), BAD_STEPS, ids=[b[0] for b in BAD_STEPS])
def test_bad_step_raises_the_same_input_error_on_every_path(runners, what, n, make, fragment):
    messages = {}
    for path, runner in runners.items():
        rows = N_FOR[path]
        FORWARD_CALLS.clear()
        messages[path] = _message(runner, rows if n == "N" else n, make(rows))
        assert FORWARD_CALLS == [], f"{what}: the forward ran on the {path} path"
    assert all(fragment in m for m in messages.values()), messages
    if n != "N":  # the same step on every path: the same words
        assert len(set(messages.values())) == 1, messages
    else:  # the step differs in size only: the same message with the size swapped
        normalised = {re.sub(r"\d+", "#", m) for m in messages.values()}
        assert len(normalised) == 1, messages


@pytest.mark.parametrize("path", PATHS)
def test_verify_without_inputs_is_an_input_error(path):
    runner = runner_on(path)
    with pytest.raises(InputError, match=r"missing \['idx', 'x'\]"):
        runner.verify()
    with pytest.raises(InputError, match="must be a Python int"):
        runner.verify(2.5, **good(3))


@pytest.mark.parametrize("path", PATHS)
def test_forward_mutating_its_inputs_never_reaches_the_caller(path):
    def mutating(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        idx.add_(1)
        return x + idx[:, None]

    runner = runner_on(path, mutating)
    n = N_FOR[path]
    inputs = good(n)
    kept = {k: v.clone() for k, v in inputs.items()}
    out = runner.run(**inputs)
    runner.verify(**inputs)
    for name, value in inputs.items():
        assert torch.equal(value, kept[name]), f"{path}: the forward's in-place update reached {name}"
    torch.testing.assert_close(out, kept["x"] * 2 + (kept["idx"] + 1)[:, None])


@pytest.mark.parametrize("n", [1, 3, 4, 6])
def test_disabled_gives_what_full_gives(n):
    def mutating(x: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        x.add_(1)
        return x @ W, {"idx": idx * 2, "w": W.sum(0)}

    full, disabled = runner_on("graph", mutating), runner_on("disabled", mutating)
    inputs = good(n)
    kept = {k: v.clone() for k, v in inputs.items()}
    a, b = full.run(**inputs), disabled.run(**inputs)
    assert type(a) is type(b) and type(a[1]) is type(b[1]) and a[1].keys() == b[1].keys()
    torch.testing.assert_close(a, b)
    assert all(torch.equal(inputs[k], kept[k]) for k in inputs)


def test_n_defaults_to_the_rows_of_the_first_tokens_input():
    runner = runner_on("graph")
    assert runner.run(**good(3)).shape == (3, 3)
    with pytest.raises(InputError, match="shape"):
        runner.run(2, **good(3))  # n given and disagreeing with the rows


def test_padding_rows_get_each_inputs_fill_and_real_rows_the_inputs():
    runner = runner_on("graph")
    inputs = good(3)
    runner.run(**inputs)
    assert torch.equal(runner.static_inputs["x"][:3], inputs["x"])
    assert torch.equal(runner.static_inputs["idx"][:3], inputs["idx"])
    assert torch.all(runner.static_inputs["x"][3:4] == 0) and torch.all(runner.static_inputs["idx"][3:4] == 7)


def test_edge_fill_repeats_the_last_real_row_and_zero_rows_are_zeroed():
    specs = {"cu": StaticInput(torch.int32, axis="requests", extra_rows=1, fill="edge")}
    buffers = StaticBuffers(specs, {"tokens": 8, "requests": 4}, torch.device("cpu"))
    assert buffers.buffers["cu"].shape == (5,)
    buffers.stage(
        {"requests": 2}, GraphKey.of(8, {"requests": 4}), {"cu": torch.tensor([0, 3, 5], dtype=torch.int32)}
    )
    assert buffers.buffers["cu"].tolist() == [0, 3, 5, 5, 5]
    buffers.reset()
    assert buffers.buffers["cu"].tolist() == [0, 0, 0, 0, 0]


def test_inputs_of_every_dtype_and_rank_land_as_their_own_copies_would_put_them():
    # Each buffer's real rows hold exactly its input (1-D rows of 8, 4, 2 or 1 bytes, 2-D and 3-D rows, a
    # strided view), the padding rows its fill, an "edge" fill the last real row again.
    specs = {
        "ids": StaticInput(torch.int64, fill=-1),
        "lens": StaticInput(torch.int32, axis="requests", fill=0),
        "tables": StaticInput(torch.int32, (5,), axis="requests", fill=0),
        "x": StaticInput(torch.float16, (2, 3), fill=0.0),
        "mask": StaticInput(torch.bool, fill=False),
        "last": StaticInput(torch.int16, axis="requests", extra_rows=1, fill="edge"),
        "strided": StaticInput(torch.float32, (2,), fill=0.5),
    }
    buffers = StaticBuffers(specs, {"tokens": 8, "requests": 4}, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    inputs = {
        "ids": torch.randint(0, 1 << 40, (5,), generator=gen),
        "lens": torch.randint(0, 1 << 20, (3,), generator=gen, dtype=torch.int32),
        "tables": torch.randint(0, 1 << 20, (3, 5), generator=gen, dtype=torch.int32),
        "x": torch.randn(5, 2, 3, generator=gen).half(),
        "mask": torch.rand(5, generator=gen) > 0.5,
        "last": torch.tensor([2, -7, 300, 11], dtype=torch.int16),
        "strided": torch.randn(2, 5, generator=gen).T,  # not contiguous
    }
    buffers.stage({"tokens": 5, "requests": 3}, GraphKey.of(8, {"requests": 4}), inputs)
    for name, value in inputs.items():
        buf = buffers.buffers[name]
        assert torch.equal(buf[: value.shape[0]], value), name
    assert buffers.buffers["ids"][5:].tolist() == [-1] * 3
    assert buffers.buffers["lens"][3:].tolist() == [0] and not buffers.buffers["mask"][5:].any()
    assert buffers.buffers["last"].tolist() == [2, -7, 300, 11, 11]  # the edge: the last real row again
    assert buffers.buffers["strided"][5:].eq(0.5).all()


# -- StaticInput fills and declarations ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("dtype", "fill", "fragment"),
    [
        (torch.uint8, -1, "outside torch.uint8's range"),
        (torch.int8, 128, "outside torch.int8's range"),
        (torch.int64, 1.5, "not an integer"),
        (torch.int32, float("nan"), "not an integer"),
        (torch.bool, 2, "does not fit dtype torch.bool"),
        (torch.bool, 0.5, "does not fit dtype torch.bool"),
        (torch.float16, 1e6, "overflows torch.float16"),
        (torch.float32, "zero", "must be a number"),
        (torch.int64, None, "must be a number"),
    ],
)
def test_fill_that_would_change_value_is_refused(dtype, fill, fragment):
    with pytest.raises(ConfigError, match="StaticInput fill") as info:
        StaticInput(dtype, fill=fill)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"dtype": "float32"}, "dtype must be a torch.dtype"),
        ({"dtype": torch.float32, "shape": (-1,)}, "shape must be a tuple"),
        ({"dtype": torch.float32, "shape": (2.0,)}, "shape must be a tuple"),
        ({"dtype": torch.float32, "shape": "ab"}, "shape must be a tuple"),
        ({"dtype": torch.float32, "host": 1}, "host must be True or False"),
        ({"dtype": torch.float32, "axis": "two words"}, "axis must be a name"),
        ({"dtype": torch.float32, "extra_rows": -1}, "extra_rows must be an int >= 0"),
    ],
)
def test_bad_declaration_is_a_config_error(kwargs, fragment):
    with pytest.raises(ConfigError, match="StaticInput") as info:
        StaticInput(**kwargs)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("dtype", "fill"),
    [
        (torch.uint8, 255),
        (torch.int64, 2.0),
        (torch.bool, True),
        (torch.bool, 0),
        (torch.float16, 0.1),
        (torch.float32, float("-inf")),
        (torch.int32, "edge"),
    ],
)
def test_representable_fills_are_accepted_and_land_unchanged(dtype, fill):
    spec = StaticInput(dtype, fill=fill)
    buffers = StaticBuffers({"a": spec}, {"tokens": 4}, torch.device("cpu"))
    buffers.stage({"tokens": 1}, GraphKey(4), {"a": torch.ones(1, dtype=dtype)})
    pad = buffers.buffers["a"][1:]
    expected = torch.ones(3, dtype=dtype) if fill == "edge" else torch.full((3,), fill, dtype=dtype)
    assert torch.equal(pad, expected)


def test_input_declarations_are_checked_by_the_runner():
    with pytest.raises(ConfigError, match="must be a devgraph.StaticInput"):
        GraphRunner(forward, phase="decode", inputs={"x": torch.float32}, device="cpu", mode="full")
    with pytest.raises(ConfigError, match="run\\(\\)'s own keywords"):
        GraphRunner(forward, phase="decode", inputs={"copy": StaticInput(torch.float32)}, device="cpu")
    with pytest.raises(ConfigError, match="at least one input"):
        GraphRunner(forward, phase="decode", inputs={}, device="cpu")


def test_inputs_that_require_grad_do_not_chain_the_static_buffers_to_autograd():
    layer = torch.nn.Linear(4, 4)  # its output requires grad: an engine that forgot no_grad upstream
    runner = GraphRunner(
        lambda x: x * 2,
        phase="decode",
        inputs={"x": StaticInput(torch.float32, (4,))},
        device="cpu",
        mode="full",
        sizes=[1, 2, 4],
    )
    runner.capture()
    for _ in range(3):
        runner.run(x=layer(torch.ones(3, 4)))
    buffer = runner.static_inputs["x"]
    assert buffer.grad_fn is None and not buffer.requires_grad


def test_a_runner_built_under_inference_mode_runs_outside_it():
    with torch.inference_mode():
        runner = GraphRunner(
            lambda x: x * 2,
            phase="decode",
            inputs={"x": StaticInput(torch.float32, (4,))},
            device="cpu",
            mode="full",
            sizes=[1, 2, 4],
        )
        runner.capture()
    torch.testing.assert_close(runner.run(x=torch.ones(3, 4)), torch.full((3, 4), 2.0))


def test_a_forward_changing_an_input_view_in_place_does_not_reach_later_keys():
    def forward(x: torch.Tensor) -> torch.Tensor:
        x.unsqueeze_(0)  # metadata only, on the runner's alias of its buffer
        return x[0] * 2

    runner = GraphRunner(
        forward,
        phase="decode",
        inputs={"x": StaticInput(torch.float32, (4,))},
        device="cpu",
        mode="disabled",
        sizes=[1, 2, 4],
    )
    out = runner.run(x=torch.ones(3, 4))
    assert out.shape == (3, 4)


@pytest.mark.parametrize(
    ("dtype", "fill"), [(torch.float32, 10**400), (torch.float8_e4m3fn, 1000), (torch.int64, 10**400)]
)
def test_fills_that_overflow_are_refused_in_one_short_line(dtype, fill):
    with pytest.raises(ConfigError, match="overflows|outside") as raised:
        StaticInput(dtype, fill=fill)
    assert len(str(raised.value)) < 200


@pytest.mark.parametrize("path", PATHS)
def test_inputs_written_into_the_static_rows_are_not_copied_and_step_as_a_copy_would(path):
    """``static_rows``: an engine writes a step's input where the graph reads it and run() copies nothing
    for it; the outputs are those of the same inputs passed as the caller's own tensors."""
    runner = runner_on(path)
    n = N_FOR[path]
    expected = runner.run(**good(n), copy=True)
    x_rows = runner.static_rows("x", n)
    idx_rows = runner.static_rows("idx", n)
    if path == "before_capture" or n > max(SIZES):  # nothing captured yet; more rows than the buffers hold
        assert x_rows is None and idx_rows is None
        runner.close()
        return
    assert x_rows is not None and idx_rows is not None
    assert x_rows.data_ptr() == runner.static_inputs["x"].data_ptr() and x_rows.shape == (n, 4)
    # another step first: the buffers hold its values, not this step's
    runner.run(x=torch.full((n, 4), 5.0), idx=torch.full((n,), 3))
    torch.index_select(good(n)["x"], 0, torch.arange(n), out=x_rows)  # a producer writing in place
    idx_rows.copy_(good(n)["idx"])
    copies = []
    original = torch.Tensor.copy_

    def counting_copy(self, src, *args, **kwargs):
        copies.append((self.data_ptr(), src.data_ptr()))
        return original(self, src, *args, **kwargs)

    torch.Tensor.copy_ = counting_copy
    try:
        got = runner.run(x=x_rows, idx=idx_rows, copy=True)
    finally:
        torch.Tensor.copy_ = original
    assert torch.equal(got, expected)
    if path == "graph":  # no input copied into its own buffer (the graph's outputs are copied out)
        buffers = {b.data_ptr() for b in runner.static_inputs.values()}
        assert not [c for c in copies if c[0] in buffers and c[0] == c[1]], copies
    # verify() with the buffer's own rows: its runs each start from the same step
    if path != "disabled":
        result = runner.verify(x=x_rows, idx=idx_rows)
        assert result.ok, result
    runner.close()


def test_no_static_rows_while_a_capture_could_reset_the_buffers_before_the_step():
    """A key captured on first sight (lazy), a capture in the background, released graphs: a capture may come
    between the write and the step, and it resets the buffers; so no rows, and the caller's own tensors."""
    lazy = GraphRunner(forward, phase="decode", inputs=INPUTS, device="cpu", sizes=SIZES, lazy=True)
    lazy.capture()
    assert lazy.static_rows("x", 2) is None
    assert torch.equal(lazy.run(**good(2)), forward(**good(2)))  # the key captured now, and still none
    assert lazy.keys and lazy.static_rows("x", 2) is None
    lazy.close()
    from devgraph.runner.background import BackgroundCapture

    runner = GraphRunner(forward, phase="decode", inputs=INPUTS, device="cpu", sizes=SIZES)
    background = BackgroundCapture([runner])
    background.step()  # one key of three captured
    assert runner.static_rows("x", 1) is None
    background.finish()
    assert runner.static_rows("x", 1) is not None
    runner.release()
    assert runner.static_rows("x", 1) is None
    runner.restore()
    assert runner.static_rows("x", 1) is not None
    runner.close()


def test_static_rows_are_none_where_there_is_no_such_buffer():
    runner = runner_on("graph")
    assert runner.static_rows("x", max(SIZES)).shape == (max(SIZES), 4)
    for name, rows in (("x", max(SIZES) + 1), ("x", 0), ("x", -1), ("nope", 1), ("x", True), ("x", 1.0)):
        assert runner.static_rows(name, rows) is None, (name, rows)
    runner.close()
    assert runner.static_rows("x", 1) is None


def test_a_tensor_on_the_buffer_but_laid_out_otherwise_is_copied():
    buffers = StaticBuffers(
        {"m": StaticInput(torch.float32, (2,), fill=0.0)}, {"tokens": 4}, torch.device("cpu")
    )
    buf = buffers.buffers["m"]
    buf.copy_(torch.arange(8, dtype=torch.float32).view(4, 2))
    # rows 0 and 2 of the buffer as a (2, 2) tensor starting on its first element: not its first rows
    strided = buf.as_strided((2, 2), (4, 1))
    key = GraphKey(2)
    buffers.stage({"tokens": 2}, key, {"m": strided.clone()})
    assert buf[:2].tolist() == [[0.0, 1.0], [4.0, 5.0]]
    buf.copy_(torch.arange(8, dtype=torch.float32).view(4, 2))
    buffers.stage({"tokens": 2}, key, {"m": buf.as_strided((2, 2), (4, 1))})  # overlapping: copied in order
    assert buf[:2].tolist() == [[0.0, 1.0], [4.0, 5.0]]
