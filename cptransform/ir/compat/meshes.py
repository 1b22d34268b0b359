"""What a model's own sharding annotations say, read off their equations.

A ``sharding_constraint`` names a sharding (a ``NamedSharding`` over a concrete or abstract
mesh, its spec, the dims left unconstrained); a ``shard_map`` names the mesh its body runs
on, the specs of its operands and results, and the axes it makes manual. Its body can be
traced only inside that mesh's axis environment (``axis_index``, ``psum`` over its axes), so
rewrites keep it as it is (:func:`runs_on_own_mesh`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SHARD_MAP = "shard_map"
SHARDING_CONSTRAINT = "sharding_constraint"
DEVICE_PUT = "device_put"


def runs_on_own_mesh(eqn: Any) -> bool:
    """Whether ``eqn``'s body runs on a mesh of its own (a ``shard_map``): tracing the body
    outside that mesh's axes fails (an unbound axis name), so a rewrite binds the equation
    with its body unchanged."""
    return eqn.primitive.name == SHARD_MAP


@dataclass(frozen=True)
class MeshAnnotation:
    """A model's sharding annotation in mesh terms: the ``axes`` (name → size) of the mesh
    it names, its device ids in mesh order (``None`` for an abstract mesh), and one spec per
    annotated value, each a tuple with one entry per dim: a tuple of axis names, or
    ``None`` where the dim is left to the partitioner (``P.UNCONSTRAINED``)."""

    axes: dict
    device_ids: tuple | None
    specs: tuple


def _entries(spec: Any, ndim: int, unconstrained: frozenset = frozenset()) -> tuple:
    from jax.sharding import PartitionSpec as P
    entries = list(spec) + [()] * (ndim - len(spec))
    out = []
    for d, entry in enumerate(entries[:ndim]):
        if d in unconstrained or entry is P.UNCONSTRAINED:
            out.append(None)
        elif entry is None:
            out.append(())
        else:
            out.append(tuple(entry) if isinstance(entry, (tuple, list)) else (entry,))
    return tuple(out)


def _mesh_facts(mesh: Any) -> tuple[dict, tuple | None]:
    axes = dict(zip(mesh.axis_names, mesh.axis_sizes if hasattr(mesh, "axis_sizes")
                    else mesh.devices.shape))
    from jax.sharding import Mesh
    ids = tuple(int(d.id) for d in mesh.devices.flat) if isinstance(mesh, Mesh) else None
    return axes, ids


def constraint_annotation(eqn: Any) -> MeshAnnotation | None:
    """The annotation of a ``sharding_constraint`` equation, or ``None`` when its sharding
    is not a ``NamedSharding`` (a positional or GSPMD sharding names no mesh axes)."""
    from jax.sharding import NamedSharding
    sharding = eqn.params["sharding"]
    if not isinstance(sharding, NamedSharding):
        return None
    axes, ids = _mesh_facts(sharding.mesh)
    ndim = eqn.invars[0].aval.ndim
    unconstrained = frozenset(eqn.params.get("unconstrained_dims") or ())
    return MeshAnnotation(axes, ids, (_entries(sharding.spec, ndim, unconstrained),))


def device_put_annotations(eqn: Any) -> tuple:
    """Per operand of a ``device_put`` inside a traced function: ``(annotation, memory
    kind)`` when it names a ``NamedSharding`` (a placement on a mesh, like a constraint),
    ``None`` when it names no destination, or the destination itself (a device, another
    sharding) for the caller to refuse."""
    from jax.sharding import NamedSharding
    out = []
    for dest, atom in zip(eqn.params["devices"], eqn.invars):
        if isinstance(dest, NamedSharding):
            axes, ids = _mesh_facts(dest.mesh)
            out.append((MeshAnnotation(axes, ids, (_entries(dest.spec, atom.aval.ndim),)),
                        dest.memory_kind))
        else:
            out.append(dest)
    return tuple(out)


def shard_map_annotation(eqn: Any) -> MeshAnnotation:
    """The mesh and the operand specs (then the result specs) of a ``shard_map``."""
    params = eqn.params
    axes, ids = _mesh_facts(params["mesh"])
    specs = tuple(_entries(s, a.aval.ndim) for s, a in
                  zip(tuple(params["in_specs"]) + tuple(params["out_specs"]),
                      list(eqn.invars) + list(eqn.outvars)))
    return MeshAnnotation(axes, ids, specs)


def shard_map_on(eqn: Any, mesh: Any) -> dict:
    """A ``shard_map`` equation's params with its mesh replaced by ``mesh`` (the same axes
    and sizes, the program's devices): its body and specs stay as they are."""
    params = dict(eqn.params)
    params["mesh"] = mesh
    return params
