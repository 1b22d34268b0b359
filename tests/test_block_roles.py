"""``Block``'s role table (lowering/block.py): every field has one, every operand of
``attention_p`` a field, and the slicing the schedules and kernels do by role cuts each
operand along the dim its side says (checked against hand-written slices on random data)."""
import dataclasses

import jax.numpy as jnp
import numpy as np

from cptransform.lowering.block import KEY_FIELDS, ROLES, Block, Side
from cptransform.op.attention_reference import split_operands
from cptransform.op.attention_spec import AttentionSpec, Layout, MaskSpec


def test_every_field_has_a_role_and_every_operand_a_field():
    assert list(ROLES) == [f.name for f in dataclasses.fields(Block)]
    bthd = Layout.parse("BTHD")
    spec = AttentionSpec(bthd, bthd, bthd, scale=1.0, mask=MaskSpec(causal=True))
    operands = set(split_operands(spec, (None,) * 3)) - {"q", "k", "v"}
    assert {r.operand for r in ROLES.values() if r.operand} == operands
    assert KEY_FIELDS == ("k", "v", "kv_pos", "kv_seg")


def _random_block(rng, tq=6, tkv=10):
    def arr(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32)

    def ints(*shape):
        return jnp.asarray(rng.integers(0, 50, shape), jnp.int32)

    return Block(q=arr(2, tq, 4, 8), k=arr(2, tkv, 2, 8), v=arr(2, tkv, 2, 8),
                 q_pos=ints(1, tq), kv_pos=ints(1, tkv), q_seg=ints(2, tq), kv_seg=ints(2, tkv),
                 mask=jnp.asarray(rng.random((2, 1, tq, tkv)) < 0.5), bias=arr(1, 4, tq, tkv),
                 sinks=arr(1, 4), topk=ints(2, 4, tq, 3), q_coord=ints(1, tq),
                 dropout=jnp.asarray(rng.integers(0, 2**31, (2, 4, 4)), jnp.uint32))


def test_query_and_key_slices_cut_each_operand_along_its_side(rng):
    block = _random_block(rng)
    got = block.query_slice(1, 4).key_slice(2, 7)
    want = dict(q=block.q[:, 1:4], k=block.k[:, 2:7], v=block.v[:, 2:7],
                q_pos=block.q_pos[:, 1:4], kv_pos=block.kv_pos[:, 2:7],
                q_seg=block.q_seg[:, 1:4], kv_seg=block.kv_seg[:, 2:7],
                mask=block.mask[:, :, 1:4, 2:7], bias=block.bias[:, :, 1:4, 2:7],
                sinks=block.sinks, topk=block.topk[:, :, 1:4], q_coord=block.q_coord[:, 1:4],
                dropout=block.dropout)
    for name, value in want.items():
        np.testing.assert_array_equal(getattr(got, name), value, err_msg=name)


def test_columns_narrow_only_the_pair_operands(rng):
    block = _random_block(rng, tkv=12)
    got = block.columns(jnp.int32(2), 4)
    for name, role in ROLES.items():
        want = getattr(block, name)[..., 8:12] if role.columns else getattr(block, name)
        np.testing.assert_array_equal(getattr(got, name), want, err_msg=name)
    assert {n for n, r in ROLES.items() if r.columns} == {"mask", "bias"}
    assert {n for n, r in ROLES.items() if r.side is Side.HEADS} == {"sinks", "dropout"}
