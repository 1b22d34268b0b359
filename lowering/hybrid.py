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
:mod:`cptransform.lowering.ulysses`); see :func:`hybrid_volume`.
Needs ``H % U == 0``; any factorisation of ``cp`` works otherwise.
"""
from __future__ import annotations

from dataclasses import replace

from cptransform.analysis.attention_shape import AttentionShape
from cptransform.analysis.block_work import Work, rank_positions, work_of
from cptransform.analysis.cost_model import CommVolume
from cptransform.analysis.local_memory import shard_bytes
from cptransform.lowering.block import Block
from cptransform.lowering.ring import ring, ring_memory, ring_volume
from cptransform.lowering.schedule import InnerAxis, Schedule, register_schedule
from cptransform.lowering.ulysses import kv_head_repeats, ulysses_around, ulysses_volume


def hybrid(block: Block, *, spec, axes, kernel):
    """The hybrid schedule over ``axes = (ulysses_axis, ring_axis)`` (see the module doc)."""
    ulysses_axis, ring_axis = axes

    def ring_over_groups(block, spec):
        return ring(block, spec=spec, axes=(ring_axis,), kernel=kernel)

    if spec.kv_positions_layout is not None:
        # The ring derives every step's kv positions from the layout: none to gather.
        block = block.replace(kv_pos=None)
    return ulysses_around(ring_over_groups, block, spec=spec, axis=ulysses_axis)


def hybrid_volume(shape: AttentionShape) -> CommVolume:
    """Ulysses over ``shape.ulysses`` devices inside (on ``T/R`` tokens), the ring over the
    ``R = cp / ulysses`` groups across (on the ``H/U`` heads and ``Hkv·f/U`` KV heads each
    device holds after the all-to-all)."""
    u, r = shape.ulysses, shape.cp // shape.ulysses
    inner = ulysses_volume(replace(shape, seq_len=shape.q_padded // r,
                                   kv_seq_len=shape.kv_padded // r, multiple=1, cp=u))
    # Layout positions of the keys are derived by the ring, not gathered.
    gathered = tuple(t for t in inner.transfers
                     if shape.explicit_positions or t.name != "kv_positions")
    outer = ring_volume(_ring_shape(shape))
    # The ring's rotations run over the second mesh axis (the ring axis).
    return CommVolume("hybrid", gathered + tuple(replace(t, axis=1) for t in outer.transfers))


def _ring_shape(shape: AttentionShape) -> AttentionShape:
    """What the ring across the ``R`` groups sees: ``H/U`` query heads and ``Hkv·f/U`` KV
    heads (``f`` the repeat factor) on every device, ``R`` devices."""
    u = shape.ulysses
    kv = shape.kv_heads * kv_head_repeats(shape.kv_heads, u)
    return replace(shape, heads=shape.heads // u, kv_heads=kv // u, cp=shape.cp // u,
                   ulysses=1)


def hybrid_work(shape: AttentionShape) -> Work:
    """Group ``r``'s ``U`` shards (layout order) for ``H/U`` heads against every group's,
    one kernel call per ring step."""
    u, r = shape.ulysses, shape.cp // shape.ulysses
    groups = rank_positions(shape).reshape(r, -1)
    return work_of(shape, [[(q, k) for k in groups] for q in groups], shape.heads // u)


def hybrid_memory(shape: AttentionShape) -> int:
    """Its shards, then the ring's memory on the head-sharded blocks of ``S/R`` tokens."""
    return shard_bytes(shape) + ring_memory(_ring_shape(shape))


def hybrid_feasible(shape: AttentionShape) -> str | None:
    """The query heads must split over the Ulysses degree (any length: the entry point
    pads it)."""
    problem = None
    if shape.heads % shape.ulysses:
        problem = (f"{shape.heads} query heads cannot be split over the Ulysses degree "
                f"{shape.ulysses} (hybrid needs heads % {shape.ulysses} == 0); use a Ulysses "
                f"axis whose size divides {shape.heads}, or schedule='ring'")
    return problem


HYBRID = register_schedule(Schedule("hybrid", mesh_axes=2, run=hybrid, volume=hybrid_volume,
                                    feasible=hybrid_feasible, overlaps=True, order=3,
                                    work=hybrid_work, memory=hybrid_memory,
                                    steps=lambda shape: shape.cp // shape.ulysses,
                                    inner=InnerAxis("Ulysses degree", "ring", ("uly", "ring"),
                                                    divides_kv_heads=True)))
