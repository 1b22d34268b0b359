"""Hybrid (2-D, USP): Ulysses inside groups of ``U`` devices, the ring across ``R`` groups.

``axes = (ulysses_axis, ring_axis)`` with ``cp = U·R``. Device ``(u, r)`` holds sequence
shard ``r·U + u`` (the entry point shards the sequence ring-major), so the all-to-all over
``ulysses_axis`` gives each device of ring group ``r`` the contiguous layout-order range of
shards ``r·U … r·U+U-1`` for ``H/U`` heads. The ring then runs over ``ring_axis`` on those
head-sharded blocks (:func:`cptransform.lowering.ring.ring_attention`); its dense-mask
columns for source ``s`` are the contiguous range ``[s·U·Tkv_loc, (s+1)·U·Tkv_loc)``, which
is what the ring reads for blocks of ``U·Tkv_loc`` keys.

Communication per device: the Ulysses all-to-alls of q, k, v, o over ``U`` (local length
``T/cp``), the gathers of positions / segment ids over ``U`` (not of kv positions that are
the layout's: the ring derives those for its blocks of ``U`` shards), then the ring's rotations of
``T/R`` keys of ``Hkv·f/U`` heads over ``R`` (``f`` the KV-head repeat factor of
:mod:`cptransform.lowering.ulysses`); see :func:`hybrid_statement`.
Needs ``H % U == 0``; any factorisation of ``cp`` works otherwise.
"""
from __future__ import annotations

from dataclasses import replace

from cptransform.analysis.attention_shape import AttentionShape
from cptransform.analysis.block_work import rank_positions
from cptransform.analysis.schedule_statement import Calls, Statement, rotated, shard_grid
from cptransform.lowering.block import Block
from cptransform.lowering.ring import ring, ring_rotation, ring_step, ring_transfers
from cptransform.lowering.schedule import InnerAxis, Schedule, register_schedule
from cptransform.lowering.ulysses import kv_head_repeats, ulysses_around, ulysses_transfers


def hybrid(block: Block, *, spec, axes, kernel):
    """The hybrid schedule over ``axes = (ulysses_axis, ring_axis)`` (see the module doc)."""
    ulysses_axis, ring_axis = axes

    def ring_over_groups(block, spec):
        return ring(block, spec=spec, axes=(ring_axis,), kernel=kernel)

    if spec.kv_positions_layout is not None:
        # The ring derives every step's kv positions from the layout: none to gather.
        block = block.replace(kv_pos=None)
    return ulysses_around(ring_over_groups, block, spec=spec, axis=ulysses_axis)


def _ring_shape(shape: AttentionShape) -> AttentionShape:
    """What the ring across the ``R`` groups sees: ``H/U`` query heads and ``Hkv·f/U`` KV
    heads (``f`` the repeat factor) on every device, ``R`` devices."""
    u = shape.ulysses
    kv = shape.kv_heads * kv_head_repeats(shape.kv_heads, u)
    return replace(shape, heads=shape.heads // u, kv_heads=kv // u, cp=shape.cp // u,
                   ulysses=1)


def hybrid_statement(shape: AttentionShape) -> Statement:
    """Ulysses over ``shape.ulysses`` devices inside (on ``T/R`` tokens), then the ring
    over the ``R = cp / ulysses`` groups across (on the ``H/U`` heads and ``Hkv·f/U`` KV
    heads each device holds after the all-to-all, over the second mesh axis): group ``r``'s
    ``U`` shards (layout order) against every group's, one kernel call per ring step."""
    u, r = shape.ulysses, shape.cp // shape.ulysses
    inner = ulysses_transfers(replace(shape, seq_len=shape.q_padded // r,
                                      kv_seq_len=shape.kv_padded // r, multiple=1, cp=u))
    # Layout positions of the keys are derived by the ring, not gathered.
    gathered = tuple(t for t in inner
                     if shape.explicit_positions or t.name != "kv_positions")
    ring_shape = _ring_shape(shape)
    positions = rank_positions(shape)
    heads = shape.heads // u
    grids = (rotated(f"hybrid ring level: {r} groups of {u} devices, {{layout}} layout",
                     "group", positions.reshape(r, -1), ring_rotation(r), heads),
             shard_grid(f"hybrid Ulysses level: group g's {u} devices each run rows "
                        f"[g·{u}, (g+1)·{u}) for {heads} of {shape.heads} heads",
                        "query shard", positions, Calls.INSIDE, heads))
    return Statement(gathered + ring_transfers(ring_shape, axis=1), grids,
                     ring_step(ring_shape))


def hybrid_feasible(shape: AttentionShape) -> str | None:
    """The query heads must split over the Ulysses degree (any length: the entry point
    pads it)."""
    problem = None
    if shape.heads % shape.ulysses:
        problem = (f"{shape.heads} query heads cannot be split over the Ulysses degree "
                f"{shape.ulysses} (hybrid needs heads % {shape.ulysses} == 0); use a Ulysses "
                f"axis whose size divides {shape.heads}, or schedule='ring'")
    return problem


HYBRID = register_schedule(Schedule("hybrid", mesh_axes=2, run=hybrid,
                                    statement=hybrid_statement, feasible=hybrid_feasible,
                                    order=3, inner=InnerAxis("Ulysses degree", "ring",
                                                             ("uly", "ring"),
                                                             divides_kv_heads=True)))
