"""``Block``'s role table (lowering/block.py): every field has one, every operand of
``attention_p`` a field, and the slicing the schedules and kernels do by role cuts each
operand along the dim its side says (checked against hand-written slices on random data)."""
import dataclasses
import pathlib
import re

import jax.numpy as jnp
import numpy as np

from cptransform.lowering.block import KEY_FIELDS, Block
from cptransform.op.attention_spec import ROLES
from cptransform.op.operand_roles import Side
from cptransform.op.attention_spec import AttentionSpec, Layout, MaskSpec


def test_every_field_has_a_role_and_every_operand_a_field():
    assert sorted(ROLES) == sorted(f.name for f in dataclasses.fields(Block))
    bthd = Layout.parse("BTHD")
    every = MaskSpec(causal=True, segments=True, dense=True, bias=True, topk=True, chunk=4,
                     coordinate_band=(-2, 2), q_padding=True, kv_padding=True,
                     region_padding=(None, 0))
    spec = AttentionSpec(bthd, bthd, bthd, scale=1.0, mask=every, positions=True, sinks=True)
    # Every operand an attention with every term and feature has is some field's operand.
    assert set(spec.operand_names()) - {"q", "k", "v", "dropout_seed"} \
        == {r.operand for r in ROLES.values() if r.operand} - {"dropout_seed"}
    # A term's roles are those of the operands it reads beyond the positions.
    for term in every.terms():
        assert {r.operand for r in term.roles.values()} \
            == set(term.operands) - {"q_positions", "kv_positions"}
    assert KEY_FIELDS == ("k", "v", "kv_pos", "kv_seg", "kv_valid", "kv_inside", "kv_outside")


def _random_block(rng, tq=6, tkv=10):
    def arr(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32)

    def ints(*shape):
        return jnp.asarray(rng.integers(0, 50, shape), jnp.int32)

    return Block(q=arr(2, tq, 4, 8), k=arr(2, tkv, 2, 8), v=arr(2, tkv, 2, 8),
                 q_pos=ints(1, tq), kv_pos=ints(1, tkv), q_seg=ints(2, tq), kv_seg=ints(2, tkv),
                 mask=jnp.asarray(rng.random((2, 1, tq, tkv)) < 0.5), bias=arr(1, 4, tq, tkv),
                 sinks=arr(1, 4), topk=ints(2, 4, tq, 3), q_coord=ints(1, tq),
                 q_valid=jnp.asarray(rng.random((2, tq)) < 0.8),
                 kv_valid=jnp.asarray(rng.random((1, tkv)) < 0.8),
                 dropout=jnp.asarray(rng.integers(0, 2**31, (2, 4, 4)), jnp.uint32))


def test_query_and_key_slices_cut_each_operand_along_its_side(rng):
    block = _random_block(rng)
    got = block.query_slice(1, 4).key_slice(2, 7)
    want = dict(q=block.q[:, 1:4], k=block.k[:, 2:7], v=block.v[:, 2:7],
                q_pos=block.q_pos[:, 1:4], kv_pos=block.kv_pos[:, 2:7],
                q_seg=block.q_seg[:, 1:4], kv_seg=block.kv_seg[:, 2:7],
                mask=block.mask[:, :, 1:4, 2:7], bias=block.bias[:, :, 1:4, 2:7],
                sinks=block.sinks, topk=block.topk[:, :, 1:4], q_coord=block.q_coord[:, 1:4],
                q_valid=block.q_valid[:, 1:4], kv_valid=block.kv_valid[:, 2:7],
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


def test_a_mask_kind_is_named_only_where_it_is_defined_matched_and_carried():
    """The coordinate band, the newest mask kind, is named (any spelling) only in its term,
    its spec field, its matcher rule and the Block field: every other layer reads it
    through the operand roles (docs/architecture.md, "Mask terms and operand roles")."""
    root = pathlib.Path(__file__).resolve().parents[1]
    spelled = re.compile(r"coordinate_band|CoordinateBand|q_coord|coordinates|coordinate band",
                         re.I)
    naming = sorted(str(p.relative_to(root)) for top in ("cptransform", "passes", "lowering")
                    for p in (root / top).rglob("*.py") if spelled.search(p.read_text()))
    assert naming == [
        "cptransform/analysis/mask_parts.py", "cptransform/analysis/mask_predicates.py",
        "cptransform/analysis/mask_values.py", "cptransform/op/attention_spec.py",
        "cptransform/op/mask_terms.py", "lowering/block.py",
        "passes/match_attention/candidate.py", "passes/match_attention/emit.py"]
