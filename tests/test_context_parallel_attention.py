"""The context-parallel entry point: operand layouts, positions, layout order, the schedule
contract, automatic mesh axes, and clear errors for bad input."""
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from schedule_cases import check_schedule, make_case, relative_error

from cptransform.op.attention import AttentionShapeError
from cptransform.op.attention_reference import attend, attention_reference
from cptransform.op.attention_spec import AttentionSpec, Layout, MaskSpec
from cptransform.lowering import schedule as schedule_module
from cptransform.lowering.block import Block
from cptransform.lowering.kernels import kernel_choices
from cptransform.lowering.context_parallel_attention import ContextParallelError, \
    context_parallel_attention
from cptransform.lowering.schedule import Schedule, fill_empty_rows_sharded
from cptransform.op.layouts import LAYOUTS, SequenceLayout


def _reference(case):
    return jax.jit(partial(attention_reference, spec=case.spec))(*case.operands)


@pytest.mark.slow
def test_any_layout_batch_dims_and_given_positions(rng):
    """BHTD-style layouts with two batch dims, a K/V without heads dim (MQA), and given
    (offset, per-batch) positions for a causal+window mask, against attention_reference."""
    seq, cp = 16, 2
    q_lay, kv_lay = Layout.parse("BBHTD"), Layout.parse("BBTD")
    spec = AttentionSpec(q=q_lay, k=kv_lay, v=kv_lay, scale=0.35, groups=4, positions=True,
                         mask=MaskSpec(causal=True, window=(6, None)))
    normal = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    q, k, v = normal(2, 1, 4, seq, 8), normal(2, 1, seq, 8), normal(2, 1, seq, 12)
    q_pos = jnp.asarray(np.arange(seq)[None, None] + np.array([[[3]], [[9]]]), jnp.int32)
    kv_pos = jnp.arange(seq, dtype=jnp.int32)[None, None] + 5
    case = type(make_case(rng))((q, k, v, q_pos, kv_pos), spec)
    check_schedule(case, mesh=make_mesh((cp,), ("cp",)), axes="cp", schedule="ring",
                   layout="zigzag")


@pytest.mark.slow
def test_in_layout_order_keeps_the_layout_order(rng):
    case = make_case(rng, "causal", "gqa", seq=16)
    lay = SequenceLayout("zigzag", 16, 4)
    permuted = [lay.permute(x, axis=1) for x in case.operands]
    out = jax.jit(lambda *xs: context_parallel_attention(
        *xs, spec=case.spec, mesh=make_mesh((4,), ("cp",)), axes="cp", layout="zigzag",
        in_layout_order=True))(*permuted)
    want = lay.permute(_reference(case), axis=1)
    assert relative_error(out, want) <= 1e-5


@pytest.mark.slow
def test_other_mesh_axes_stay_automatic(rng):
    """Batch sharded over a 'data' axis that the schedule never names."""
    mesh = make_mesh((4, 2), ("cp", "data"))
    case = make_case(rng, "causal", "mha", seq=16)
    batch_sharded = NamedSharding(mesh, P("data"))
    operands = [jax.device_put(x, batch_sharded) for x in case.operands]
    fn = jax.jit(lambda *xs: context_parallel_attention(*xs, spec=case.spec, mesh=mesh,
                                                        axes="cp", layout="striped"))
    out = fn(*operands)
    assert relative_error(out, _reference(case)) <= 1e-5


@pytest.mark.slow
def test_schedule_contract(rng, monkeypatch):
    """A schedule written from the documented contract alone (gather all keys, attend)
    reproduces the reference: shapes, positions of the rank and mask columns in layout
    order are what the contract promises."""
    seen = {}

    def gather_all(block, *, spec, axes, kernel):
        seen.update(q=block.q.shape, mask=block.mask.shape, q_pos=block.q_pos.shape, axes=axes)
        everything = lambda x: jax.lax.all_gather(x, axes, axis=1, tiled=True)  # noqa: E731
        gathered = block.with_keys(jax.tree.map(everything, block.keys()))
        o, lse = kernel.forward(gathered, spec)
        o = fill_empty_rows_sharded(spec, o, lse, gathered, (), gathered.k.shape[1])
        return o.astype(block.q.dtype)

    record = Schedule("gather_all", mesh_axes=1, run=gather_all, statement=None,
                      feasible=lambda shape: None)
    monkeypatch.setitem(schedule_module.SCHEDULES, "gather_all", record)
    case = make_case(rng, "dense_causal", "gqa", seq=24, batch=2, empty_rows="uniform")
    check_schedule(case, mesh=make_mesh((4,), ("cp",)), axes="cp", schedule="gather_all",
                   layout="zigzag", grad=False)
    assert seen == dict(q=(2, 6, 8, 8), mask=(2, 8, 6, 24), q_pos=(1, 6), axes=("cp",))


@pytest.mark.slow
def test_attend_is_the_local_kernel_forward(rng):
    """The default kernel's forward equals attention_reference.attend (one definition of a
    block), up to float32 rounding: it accumulates over key chunks."""
    from cptransform.lowering.kernels import get_kernel

    bthd = Layout.parse("BTHD")
    spec = AttentionSpec(q=bthd, k=bthd, v=bthd, scale=1 / math.sqrt(8),
                         mask=MaskSpec(causal=True))
    q, k, v = (jnp.asarray(rng.normal(size=(1, 4, 2, 8)), jnp.float32) for _ in range(3))
    pos = jnp.arange(4)[None]
    for got, want in zip(get_kernel("auto").forward(Block(q, k, v, pos, pos), spec),
                         attend(spec, q, k, v, pos, pos)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.fixture
def small(rng):
    return make_case(rng, "causal", "gqa", seq=16)


def _run(case, **kw):
    options = dict(mesh=make_mesh((4,), ("cp",)), axes="cp")
    options.update(kw)
    return context_parallel_attention(*case.operands, spec=case.spec, **options)


@pytest.mark.parametrize("option,value,message", [
    ("schedule", "spiral", r"unknown schedule 'spiral'; use one of .*ring"),
    ("layout", "diagonal", r"unknown layout 'diagonal'; use one of " + ", ".join(LAYOUTS) + "$"),
    ("kernel", "cuda", r"unknown kernel 'cuda' \(did you mean 'cudnn'\?\); use one of "
                       + ", ".join(kernel_choices()) + "$"),
    ("axes", "model", r"CP axes \('model',\) must be .* mesh axes \('cp',\)"),
])
def test_unknown_options_list_the_known_ones(small, option, value, message):
    with pytest.raises(ValueError, match=message):
        _run(small, **{option: value})


def test_layout_order_needs_a_divisible_length(rng):
    """Operands already in layout order cannot be padded (the pad slots would fall inside
    the shards): refused, naming the multiple. In natural order any length runs
    (tests/test_uneven_lengths.py)."""
    case = make_case(rng, "causal", "mha", seq=12)
    with pytest.raises(ContextParallelError, match=r"divisible by 8 \(got 12 queries"):
        context_parallel_attention(*case.operands, spec=case.spec,
                                   mesh=make_mesh((4,), ("cp",)), axes="cp", layout="zigzag",
                                   in_layout_order=True)


def test_bad_operand_shapes_are_named(small):
    q, k, v = small.operands
    with pytest.raises(AttentionShapeError, match=r"q and k head dims differ: 8 vs 6"):
        context_parallel_attention(q, k[..., :6], v, spec=small.spec,
                                   mesh=make_mesh((4,), ("cp",)), axes="cp")


@pytest.mark.parametrize("schedule,axes,message", [
    # Ring ranks are axis_index over the axes in the given order, the sequence is sharded
    # over them reversed: over two axes a dense mask's columns would belong to other ranks.
    ("ring", ("a", "b"), r"'ring' runs over 1 mesh axis, got \('a', 'b'\)"),
    ("ulysses", ("a", "b"), r"'ulysses' runs over 1 mesh axis, got \('a', 'b'\); put the CP"),
    ("allgather", ("a", "b"), r"'allgather' runs over 1 mesh axis, got \('a', 'b'\)"),
    ("hybrid", ("a",), r"'hybrid' runs over 2 mesh axes, got \('a',\); give axes="),
])
def test_schedule_axis_count_is_checked_before_shard_map(small, schedule, axes, message):
    mesh = make_mesh((2, 2), ("a", "b"))
    with pytest.raises(ContextParallelError, match=message):
        context_parallel_attention(*small.operands, spec=small.spec, mesh=mesh, axes=axes,
                                   schedule=schedule)
