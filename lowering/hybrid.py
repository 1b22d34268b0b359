"""Hybrid (2-D, USP): Ulysses inside groups of ``U`` devices, the ring across ``R`` groups.

``axes = (ulysses_axis, ring_axis)`` with ``cp = U·R``. Device ``(u, r)`` holds sequence
shard ``r·U + u`` (the entry point shards the sequence ring-major), so the all-to-all over
``ulysses_axis`` gives each device of ring group ``r`` the contiguous layout-order range of
shards ``r·U … r·U+U-1`` for ``H/U`` heads. The ring then runs over ``ring_axis`` on those
head-sharded blocks (:func:`cptransform.lowering.ring.ring_attention`); its dense-mask
columns for source ``s`` are the contiguous range ``[s·U·Tkv_loc, (s+1)·U·Tkv_loc)``, which
is what the ring reads for blocks of ``U·Tkv_loc`` keys.

Communication per device: the Ulysses all-to-alls of q, k, v, o over ``U`` (local length
``T/cp``), the gathers of positions / segment ids over ``U``, then the ring's rotations of
``T/R`` keys of ``Hkv·f/U`` heads over ``R`` (``f`` the KV-head repeat factor of
:mod:`cptransform.lowering.ulysses`); see :func:`cptransform.analysis.cost_model.hybrid_volume`.
Needs ``H % U == 0``; any factorisation of ``cp`` works otherwise.
"""
from __future__ import annotations

from cptransform.lowering.context_parallel_attention import register_schedule
from cptransform.lowering.ring import ring
from cptransform.lowering.ulysses import ulysses_around


@register_schedule("hybrid", mesh_axes=2)
def hybrid(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias, *, spec, axes, kernel):
    """The hybrid schedule over ``axes = (ulysses_axis, ring_axis)`` (see the module doc)."""
    ulysses_axis, ring_axis = axes

    def ring_over_groups(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias, spec):
        return ring(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias, spec=spec,
                    axes=(ring_axis,), kernel=kernel)

    return ulysses_around(ring_over_groups, q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask,
                          bias, spec=spec, axis=ulysses_axis, schedule="hybrid")
