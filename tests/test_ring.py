"""Ring schedule: the local-step kernel's backward, block skipping, fully masked rows,
local lengths that are not a tile, derived and explicit positions, and its communication
to the collective. Every mask kind and layout against the reference: ``test_conformance.py``."""
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from schedule_cases import POSITION_MASKS, Case, check_schedule, make_case, position_case, \
    relative_error

from cptransform.op.attention_reference import attention_reference
from cptransform.op.attention_spec import AttentionSpec, Layout, MaskSpec
from cptransform.op.layouts import LAYOUTS
from cptransform.op.mask_terms import BlockKind
from cptransform.analysis.attention_shape import AttentionShape
from cptransform.lowering import kernels as kernels_module
from cptransform.lowering.block import Block
from cptransform.lowering.kernels.chunked import ChunkedKernel, chunk_kinds
from cptransform.lowering.schedule import schedules
from cptransform.lowering.collectives import lower_and_count
from cptransform.lowering.context_parallel_attention import context_parallel_attention
from cptransform.lowering.kernels.xla import XlaKernel

BTHD = Layout.parse("BTHD")


def ring(cp, layout):
    """Keyword arguments of context_parallel_attention for the ring on a ``cp`` mesh."""
    return dict(mesh=make_mesh((cp,), ("cp",)), axes="cp", schedule="ring", layout=layout)


@pytest.mark.slow
def test_causal_zigzag_cp8_mqa(rng):
    case = make_case(rng, "causal", "mqa", seq=32, dv=12)
    check_schedule(case, **ring(8, "zigzag"))


@pytest.mark.slow
@pytest.mark.parametrize("kind,heads,layout", [("dense_causal", "gqa", "zigzag"),
                                               ("bias", "mha", "contiguous")])
def test_bf16(rng, kind, heads, layout):
    case = make_case(rng, kind, heads, dtype=jnp.bfloat16)
    check_schedule(case, **ring(4, layout))


@pytest.mark.slow
@pytest.mark.parametrize("cp,layout,seq", [(4, "contiguous", 12), (2, "zigzag", 12)])
def test_local_length_not_a_multiple_of_a_tile(rng, cp, layout, seq):
    """Local lengths 3 (one tile) and 6 (two tiles of 3, zigzag chunks of 3)."""
    case = make_case(rng, "causal_window", "gqa", seq=seq, dv=12)
    check_schedule(case, **ring(cp, layout))


def _with_empty_rows(case, rows):
    """``case`` with every key hidden from the query ``rows`` of batch element 0."""
    mask = np.array(case.operands[-1])
    mask[0, :, rows, :] = False
    return type(case)(case.operands[:-1] + (jnp.asarray(mask),), case.spec)


@pytest.mark.slow
@pytest.mark.parametrize("empty_rows", ["zero", "uniform"])
def test_fully_masked_rows_match_reference(rng, empty_rows):
    """Rows that see no key: 0 (zero) or the mean of V over all keys (uniform)."""
    case = _with_empty_rows(make_case(rng, "dense_causal", "gqa", seq=16, dv=12,
                                      empty_rows=empty_rows), [0, 5, 13])
    check_schedule(case, **ring(4, "zigzag"))


@pytest.mark.slow
def test_fully_masked_rows_are_exactly_zero_with_zero_gradient(rng):
    rows = [0, 5, 13]
    case = _with_empty_rows(make_case(rng, "dense", "mha", seq=16), rows)
    q, k, v, mask = case.operands

    @jax.jit
    def out_and_dq(q):
        out = context_parallel_attention(q, k, v, mask, spec=case.spec, **ring(4, "striped"))
        return out, jax.grad(lambda q: jnp.sum(jnp.sin(context_parallel_attention(
            q, k, v, mask, spec=case.spec, **ring(4, "striped")))))(q)

    out, dq = out_and_dq(q)
    assert np.all(np.asarray(out[0, rows]) == 0) and np.all(np.asarray(dq[0, rows]) == 0)
    assert np.all(np.isfinite(np.asarray(dq))) and np.any(np.asarray(dq[1, rows]) != 0)


@pytest.mark.slow
def test_kernel_backward_matches_autodiff(rng):
    """The XLA kernel's backward (probabilities recomputed from lse) against jax.vjp of the
    forward, with soft-cap, bias broadcast over heads, GQA, a dense mask and dlse."""
    spec = AttentionSpec(q=BTHD, k=BTHD, v=BTHD, scale=0.4, softcap=3.0, groups=2,
                         mask=MaskSpec(causal=True, dense=True, bias=True))
    normal = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    q, k, v = normal(2, 6, 4, 8), normal(2, 5, 2, 8), normal(2, 5, 2, 12)
    bias = normal(2, 1, 6, 5)
    mask = jnp.asarray(rng.random((1, 4, 6, 5)) < 0.7).at[0, 0, 3].set(False)
    q_pos, kv_pos = jnp.arange(6)[None] + 2, jnp.arange(5)[None]
    kern = XlaKernel()

    def fwd(q, k, v, bias):
        return kern.forward(Block(q, k, v, q_pos, kv_pos, mask=mask, bias=bias), spec)

    do, dlse = normal(2, 6, 4, 12), normal(2, 4, 6)

    @jax.jit
    def both(q, k, v, bias, do, dlse):
        (o, lse), vjp = jax.vjp(fwd, q, k, v, bias)
        want = vjp((do, jnp.where(jnp.isfinite(lse), dlse, 0.0)))
        got = kern.backward(Block(q, k, v, q_pos, kv_pos, mask=mask, bias=bias), o, lse, do,
                            spec, dlse=dlse)
        return got, want

    got, want = both(q, k, v, bias, do, dlse)
    for name, g, w in zip(("dq", "dk", "dv", "dbias"), got, want):
        assert g.shape == w.shape
        assert relative_error(g, w) <= 1e-5, name


class _CountingKernel(ChunkedKernel):
    """The chunked kernel, reporting per rank how many chunk pairs a forward computes (the
    pairs its classification does not skip)."""

    def __init__(self, axes):
        super().__init__(name="counting")
        object.__setattr__(self, "axes", axes)
        object.__setattr__(self, "calls", Counter())

    def __hash__(self):
        return id(self)

    def forward(self, block, spec, running=None):
        computed = jnp.sum(chunk_kinds(block, spec, self.chunk) != BlockKind.SKIP)
        jax.debug.callback(lambda r, n: self.calls.update({int(r): int(n)}),
                           jax.lax.axis_index(self.axes), computed)
        return super().forward(block, spec, running)


@pytest.mark.slow
@pytest.mark.parametrize("layout,per_rank", [("contiguous", [3, 7, 11, 15]),
                                             ("zigzag", [9, 9, 9, 9])])
def test_causal_skips_fully_masked_tiles(rng, monkeypatch, layout, per_rank):
    """cp=4, 2×2 kernel chunks per step (16 per rank): contiguous shards compute 3 pairs on
    the diagonal step and 4 per earlier block; zigzag computes the same 9 on every rank."""
    counting = _CountingKernel("cp")
    monkeypatch.setitem(kernels_module.kernels(), "counting", counting)
    case = make_case(rng, "causal", "gqa", seq=32)
    out = context_parallel_attention(*case.operands, spec=case.spec, kernel="counting",
                                     **ring(4, layout))
    want = attention_reference(*case.operands, spec=case.spec)
    assert relative_error(out, want) <= 1e-5
    assert [counting.calls[r] for r in range(4)] == per_rank
    assert sum(per_rank) == 36 < 64


@pytest.mark.slow
@pytest.mark.parametrize("seq", [32, 29])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", list(POSITION_MASKS))
def test_derived_positions_match_reference(rng, kind, layout, seq):
    """No positions operand: each step derives the arriving block's positions from the
    layout (29 keys are padded to 32; the pad keys' positions continue the real ones)."""
    check_schedule(position_case(rng, kind, seq, explicit=False), **ring(4, layout))


@pytest.mark.slow
@pytest.mark.parametrize("kind,layout,seq", [("causal", "zigzag", 29), ("window", "striped", 32),
                                             ("topk", "contiguous", 29)])
def test_explicit_positions_match_reference(rng, kind, layout, seq):
    """The caller's positions (a permutation, not the layout's) still travel."""
    check_schedule(position_case(rng, kind, seq, explicit=True), **ring(4, layout))


@pytest.mark.slow
@pytest.mark.parametrize("cp,heads,kind,explicit", [
    (2, "mha", "causal", False), (4, "gqa", "segments", False), (8, "mqa", "window", False),
    (4, "gqa", "causal", True), (2, "mha", "window", True)])
def test_communication(cp, heads, kind, explicit):
    """Forward: cp-1 collective-permutes each of K and V (one send), the kv positions (when
    the mask reads them and they are the caller's; the layout's are derived, not sent) and
    segment ids, to the byte of the closed form and the cost model; the backward adds the
    same rotations again plus cp float32 rotations of dK and dV (two sends: the kernel
    accumulates into each in place)."""
    seq, d, dv, batch = 64, 8, 12, 2
    case = make_case(np.random.default_rng(0), kind, heads, seq=seq, dv=dv, batch=batch,
                     dtype=jnp.bfloat16)
    if explicit:
        pos = jnp.arange(seq, dtype=jnp.int32)[None]
        case = Case(case.operands[:3] + (pos, pos) + case.operands[3:],
                    case.spec.replace(positions=True))
    h, hkv = case.operands[0].shape[2], case.operands[1].shape[2]
    kw = ring(cp, "zigzag")
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in case.operands]

    # Operands in layout order: only the ring's own traffic is counted.
    def forward(*xs):
        return context_parallel_attention(*xs, spec=case.spec, **kw, in_layout_order=True)

    def grad(*xs):
        return jax.grad(lambda q, k, v: jnp.sum(forward(q, k, v, *xs[3:]).astype(jnp.float32)),
                        argnums=(0, 1, 2))(*xs[:3])

    segments, reads = kind == "segments", kind != "segments"
    positions = reads and explicit
    loc = seq // cp
    want_shapes = {f"{batch}x{loc}x{hkv}x{d + dv}xbf16": cp - 1}  # K and V in one send
    if positions:
        want_shapes[f"1x{loc}xi32"] = cp - 1
    if segments:
        want_shapes[f"{batch}x{loc}xi32"] = cp - 1
    fwd = lower_and_count(forward, *abstract)
    by_shape = Counter()
    for c in fwd.collectives:
        assert c.kind == "collective_permute"
        by_shape[str(c.operands[0])] += c.count
    assert dict(by_shape) == want_shapes
    closed_form = (cp - 1) * loc * (batch * hkv * (d + dv) * 2 + 4 * positions
                                    + batch * 4 * segments)
    assert fwd.per_device_bytes == closed_form
    expected = schedules()["ring"].volume(AttentionShape(
        seq_len=seq, heads=h, kv_heads=hkv, head_dim=d, v_head_dim=dv, cp=cp, batch=batch,
        dtype_bytes=2, positions=reads, segments=segments, segment_batch=batch,
        explicit_positions=explicit))
    assert fwd.bytes_by_kind() == expected.forward
    bwd = lower_and_count(grad, *abstract)
    assert bwd.counts() == {"collective_permute": 2 * sum(want_shapes.values()) + 2 * cp}
    dkv_bytes = cp * batch * loc * hkv * (d + dv) * 4
    assert bwd.per_device_bytes == 2 * closed_form + dkv_bytes
    assert bwd.per_device_bytes == expected.forward_total + expected.backward_total
