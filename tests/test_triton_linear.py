"""The decode step's Triton matrix-vector kernel (devgraph.reference.kernels.triton_linear) and the op the
reference decoder's projections go through (devgraph.reference.fused.linear).

CPU: which tiling or cuBLAS each shape gets; every tiling assembles for a Hopper GPU with Triton's own
ptxas, the tensor-core forms pipelined (``cp.async``); under ``TRITON_INTERPRET=1`` in a child process every
tiling against a float64 product (float16 and float32: the interpreter multiplies bfloat16 tiles wrongly),
at row counts and widths that are not multiples of a tile, with a bias, and the shapes it must hand to
``F.linear`` handed over; the op checked by ``torch.library.opcheck``; a tiny model's projections counted
through the kernel. GPU (``cuda`` marker): bfloat16 at the shapes the sweep timed, replayed in a CUDA graph
bit for bit.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F

triton_linear = pytest.importorskip(
    "devgraph.reference.kernels.triton_linear", reason="triton is not installed (the kernel is Triton)"
)


def test_each_shape_class_gets_its_tiling_or_cublas():
    c = triton_linear.CONFIGS
    pick = triton_linear.config_for
    # One row: Qwen3-0.6B's narrow projections and a tensor-parallel half of 8B's qkv on the CUDA cores,
    # 8B's output projection and down projections on the tensor cores, an LM head in wide tiles.
    assert pick(1, 1024, 2048) == pick(1, 4096, 1024) == pick(1, 3072, 4096) == c["one_row"]
    assert pick(1, 4096, 4096) == pick(1, 4096, 2048) == c["few_rows"]
    assert pick(1, 4096, 14336) == pick(8, 4096, 7168) == c["long_k"]
    assert pick(1, 128256, 4096) == c["wide"]
    # Several rows: the narrowest on the CUDA cores up to four rows, then cuBLAS; deep ones on long_k.
    assert pick(2, 1024, 3072) == c["one_row"] and pick(4, 1024, 2048) == c["small_rows"]
    assert pick(8, 1024, 2048) is None
    assert pick(2, 4096, 4096) == pick(16, 3072, 4096) == c["long_k"]
    assert pick(2, 4096, 1024) == pick(16, 4096, 1024) == c["few_rows"]
    # cuBLAS: 8B's qkv and every gate/up at any row count, an LM head past one row, 8B's halved output
    # projection at several rows, past 16 rows.
    for rows in (1, 2, 16):
        assert pick(rows, 6144, 4096) is None and pick(rows, 28672, 4096) is None
        assert pick(rows, 14336, 4096) is None and pick(rows, 6144, 1024) is None
    assert pick(2, 128256, 4096) is None and pick(2, 4096, 2048) is None
    assert pick(17, 1024, 1024) is None and pick(0, 1024, 1024) is None
    assert triton_linear.MAX_ROWS == 16  # the tensor-core form pads to 16 rows: no more fit


def test_every_rule_names_a_tiling_or_cublas_and_what_it_was_measured_on():
    for rule in triton_linear.RULES:
        assert rule.config is None or rule.config in triton_linear.CONFIGS, rule
        assert rule.measured and 1 <= rule.rows[0] <= rule.rows[1] <= triton_linear.MAX_ROWS, rule


def test_float32_stays_on_cublas_unless_a_tiling_is_asked_for(monkeypatch):
    asked = []
    monkeypatch.setattr(triton_linear, "config_for", lambda *shape: asked.append(shape))
    x, w = torch.randn(1, 64), torch.randn(8, 64)
    assert torch.equal(triton_linear.linear(x, w), torch.nn.functional.linear(x, w))
    assert asked == []  # no tiling looked up: float32 is not the sweep's


def _cubin(config, rows: int = 1) -> str:  # type: ignore[no-untyped-def]
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:  # pragma: no cover - a Triton without the ahead-of-time API
        pytest.skip(f"this Triton has no ahead-of-time compile API ({exc})")
    signature = {name: "*bf16" for name in ("x_ptr", "w_ptr", "b_ptr", "out_ptr")}
    signature |= {name: "i32" for name in ("rows", "n", "k", "stride_x", "stride_w", "stride_o")}
    # Exactly what linear() launches for this tiling and row count: its kernel and compile-time arguments.
    kernel, launch = triton_linear._launch(config, rows, torch.bfloat16, False)
    constants = {name: value for name, value in launch.items() if not name.startswith("num_")}
    options = {name: value for name, value in launch.items() if name.startswith("num_")}
    signature |= {name: "constexpr" for name in constants}
    # What a launch from torch tensors specializes: 16-byte aligned pointers, sizes divisible by 16.
    aligned = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 5, 6, 7, 8, 9)}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=aligned)
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    except (RuntimeError, FileNotFoundError) as exc:
        if "ptxas" in str(exc).lower():  # a Triton wheel without its CUDA assembler
            pytest.skip(f"Triton's ptxas is not usable here: {exc}")
        raise
    assert len(compiled.asm["cubin"]) > 0
    return str(compiled.asm["ptx"])


@pytest.mark.parametrize("name", ["one_row", "small_rows", "few_rows", "long_k", "wide"])
def test_every_tiling_assembles_for_a_hopper_gpu(name):
    config = triton_linear.CONFIGS[name]
    ptx = _cubin(config, rows=4 if name == "small_rows" else 1)
    if config.form == "dot":
        # The weight tiles are copied asynchronously, stages ahead: the pipelining the sweep timed.
        assert "cp.async" in ptx and "mma" in ptx
    else:
        assert "ld.global.v4" in ptx  # 16-byte loads of the weight rows


_SCRIPT = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from devgraph.reference.kernels import triton_linear as tl_
    from devgraph.reference import fused

    torch.manual_seed(0)
    checked = 0
    for dtype in (torch.float16, torch.float32):
        for rows, n, k in [(1, 37, 100), (1, 70, 1030), (3, 33, 300), (16, 40, 513), (5, 8, 16)]:
            x = torch.randn(rows, k).to(dtype)
            w = (torch.randn(n, k) * k**-0.5).to(dtype)
            b = torch.randn(n).to(dtype)
            for bias in (None, b):
                want = x.double() @ w.double().T + (0 if bias is None else bias.double())
                for name, config in tl_.CONFIGS.items():
                    got = tl_.linear(x, w, bias, config=config)
                    assert got.dtype == dtype and got.shape == (rows, n), (name, got.shape)
                    err = float((got.double() - want).abs().max() / want.abs().max())
                    assert err < (2e-3 if dtype == torch.float16 else 1e-5), (name, dtype, rows, n, k, err)
                    checked += 1
    # Operands the kernel does not read as it assumes are F.linear's, bit for bit. Three rows and 24
    # columns: a shape the table gives a tiling, so each case reaches the operand checks.
    assert tl_.config_for(3, 24, 64) is not None
    w = torch.randn(24, 64, dtype=torch.float16)
    b = torch.randn(24, dtype=torch.float16)
    x = torch.randn(3, 64, dtype=torch.float16)
    for xi, wi, bi in (
        (torch.randn(64, 3, dtype=torch.float16).T, w, None),  # rows of x not contiguous
        (x, torch.randn(64, 24, dtype=torch.float16).T, None),  # rows of the weight not contiguous
        (x, w, torch.randn(48, dtype=torch.float16)[::2]),  # a strided bias
        (torch.randn(2, 3, 64, dtype=torch.float16), w, None),  # three dimensions
        (torch.randn(17, 64, dtype=torch.float16), w, None),  # more rows than a tile
    ):
        assert torch.equal(tl_.linear(xi, wi, bi), F.linear(xi, wi, bi))
    x16 = torch.randn(2, 64, dtype=torch.float16)
    for call in (lambda: tl_.linear(x16, w.float()), lambda: F.linear(x16, w.float())):
        try:  # mixed dtypes: F.linear's own refusal, not a kernel reading float32 as float16
            call()
        except RuntimeError:
            pass
        else:
            raise AssertionError("mixed dtypes were not refused")
    try:
        tl_.linear(torch.randn(17, 64, dtype=torch.float16), w, config=tl_.CONFIGS["few_rows"])
    except ValueError as exc:
        assert "at most 16 rows" in str(exc)
    else:
        raise AssertionError("a tiling asked for 17 rows was not refused")
    # The op: schema, fake, and its registration checked by torch.
    x = torch.randn(3, 64, dtype=torch.float16)
    torch.library.opcheck(fused._linear_op, (x, w, None))
    torch.library.opcheck(fused._linear_op, (x, w, torch.randn(24, dtype=torch.float16)))
    # A tiny model's projections, each through the kernel's entry point (four a layer, and the LM head),
    # and its decode steps of 1 and 3 requests close to the torch form's on the same weights.
    from devgraph.reference import ReferenceConfig, ReferenceModel, make_decode_batch
    calls = []
    inner = tl_.linear
    tl_.linear = lambda *a, **k: calls.append(a[1].shape) or inner(*a, **k)
    logits = {}
    for kernels in ("triton", "torch"):
        config = ReferenceConfig.preset("tiny", max_requests=4, dtype=torch.float16, kernels=kernels,
                                        qkv_bias=True)
        model = ReferenceModel(config, seed=0)
        for n in (1, 3):
            model.randomize_cache(seed=n)
            logits[kernels, n] = model.decode_step(**make_decode_batch(model, n, seed=n)).float()
        if kernels == "triton":
            assert len(calls) == 2 * (4 * config.num_layers + 1), calls
    for n in (1, 3):
        ref = logits["torch", n]
        error = float((logits["triton", n] - ref).norm() / ref.norm())
        assert error < 1e-2, (n, error)
    print("linear ok", checked)
    """
)


def test_every_tiling_equals_a_float64_product_under_the_interpreter(run_under_triton_interpreter):
    assert "linear ok 100" in run_under_triton_interpreter(
        _SCRIPT
    )  # 2 dtypes x 5 shapes x 2 biases x 5 tilings


def test_eagerly_a_step_the_kernel_never_takes_skips_the_op(monkeypatch):
    from devgraph.reference import fused

    ran = []
    monkeypatch.setattr(fused, "_linear_op", lambda *args: ran.append(args[0].shape) or F.linear(*args))
    w = torch.randn(24, 64)
    for x in (torch.randn(17, 64), torch.randn(2, 3, 64)):  # a prefill's rows; three dimensions
        assert torch.equal(fused.linear(x, w, None, True), F.linear(x, w))
    assert ran == []
    fused.linear(torch.randn(3, 64), w, None, True)  # a decode step's rows: through the op
    assert ran == [(3, 64)]


def test_the_torch_form_is_f_linear():
    from devgraph.reference.fused import linear

    x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
    assert torch.equal(linear(x, w, b, False), torch.nn.functional.linear(x, w, b))


# -- GPU ---------------------------------------------------------------------------------------------
SHAPES = [(6144, 4096), (4096, 14336), (3072, 4096), (1024, 2048), (4096, 1024), (128256, 4096)]


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16])
def test_on_the_gpu_every_shape_lands_near_a_float32_product_and_replays_exactly(rows):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    for n, k in SHAPES:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k**-0.5
        want = x.float() @ w.float().T
        eager = triton_linear.linear(x, w)
        err = float((eager.float() - want).abs().max() / want.abs().max())
        assert err < 1e-2, (rows, n, k, err)
        assert torch.equal(triton_linear.linear(x, w), eager)  # no split over K: the same bits each run
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = triton_linear.linear(x, w)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, eager), (rows, n, k)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["one_row", "small_rows", "few_rows", "long_k", "wide"])
def test_on_the_gpu_each_tiling_masks_odd_widths_and_adds_a_bias(name):
    # A vocabulary slice of a tensor-parallel rank is rarely a multiple of a tile (151936 / 8 = 18992), and
    # depths need not be either: the compiled kernels' masked, pipelined loads must read no row twice.
    config = triton_linear.CONFIGS[name]
    gen = torch.Generator(device="cuda").manual_seed(7)
    for dtype in (torch.float16, torch.bfloat16):
        for rows, n, k in ((1, 18992, 1000), (3, 37, 4100), (4 if name == "small_rows" else 16, 1001, 520)):
            if config.form == "sum" and rows > 4:
                continue  # the CUDA-core forms hold at most four rows in registers
            x = torch.randn(rows, k, device="cuda", dtype=dtype, generator=gen)
            w = torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) * k**-0.5
            b = torch.randn(n, device="cuda", dtype=dtype, generator=gen)
            want = x.float() @ w.float().T + b.float()
            got = triton_linear.linear(x, w, b, config=config)
            err = float((got.float() - want).abs().max() / want.abs().max())
            assert err < 1e-2, (name, dtype, rows, n, k, err)
