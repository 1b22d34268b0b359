"""A model's own sharding annotations, re-expressed on the program's one mesh.

Model code written for sharding constrains its activations (``with_sharding_constraint``,
Flax's logical axis rules and NNX sharding metadata, which lower to it) and runs parts under
``shard_map`` (an MoE layer over an expert axis). Under context parallelism the program has
one mesh, the CP mesh: the user's mesh with every axis Auto (data, fsdp, tensor, expert and
the CP axes). Each annotation is read in mesh terms and re-expressed there:

* an axis of size 1 shards nothing and is dropped (single-device model code constrains on a
  1-device mesh);
* an axis the program mesh has with the same size keeps its meaning, whatever mesh object
  or device order the annotation named;
* a sequence dim (the whole sequence) gets the CP sharding, whatever the annotation said
  there; a dim holding the sequence merged with others (``[B·S, D]`` tokens) is left to the
  partitioner, since no mesh-axis tuple spells "batch over data, tokens over cp" on one dim;
* an axis of more than one device that the program mesh lacks (or has with another size),
  or the CP axis named on a dim that is not the sequence, is refused
  (:class:`~cptransform.ir.errors.ContextParallelError`) with the mesh to pass instead.

A ``shard_map`` keeps its body and specs and runs on the program mesh when its mesh has the
program's axes; one whose mesh axes all have size 1 runs on the program's devices with those
axes added (its collectives over them are identities); any other mesh is refused.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from cptransform.ir import compat
from cptransform.ir.errors import ContextParallelError


@dataclass(frozen=True)
class ProgramMesh:
    """The program's one mesh, its CP axes and the mesh axes a sequence dim is sharded
    over (one CP axis, or several for a two-axis schedule)."""

    mesh: Mesh
    cp_axes: tuple
    seq: tuple

    @property
    def axes(self) -> dict:
        return dict(zip(self.mesh.axis_names, self.mesh.devices.shape))

    def describe(self) -> str:
        return "{" + ", ".join(f"{a!r}: {n}" for a, n in self.axes.items()) + "}"


def _kept_axes(names: tuple, annotation: compat.MeshAnnotation, program: ProgramMesh,
               where: str) -> tuple:
    """The axes of one spec entry that keep their meaning on the program mesh (size-1 axes
    dropped); refuses an axis the program mesh does not have with the same size."""
    kept = []
    for name in names:
        size = annotation.axes.get(name, 1)
        if size == 1:
            continue
        if program.axes.get(name) != size:
            raise ContextParallelError(
                f"{where} names mesh axis {name!r} of size {size}, which the program's mesh "
                f"{program.describe()} does not have"
                + (f" (its {name!r} has {program.axes[name]} devices)"
                   if name in program.axes else "")
                + ": a context-parallel program runs on one mesh. Pass mesh= with the "
                "model's axes beside the CP axis (e.g. jax.make_mesh((2, 4), ('data', "
                "'cp')) with axis='cp'), and constrain with that mesh's axis names")
        kept.append(name)
    return tuple(kept)


def constraint_spec(annotation: compat.MeshAnnotation, program: ProgramMesh,
                    full_dims: tuple, merged_dims: tuple, where: str) -> P:
    """The spec of a model's ``sharding_constraint`` on the program mesh: its non-CP axes
    kept, the sequence dims (``full_dims``) on the CP axes, the dims holding the sequence
    merged with others (``merged_dims``) left to the partitioner."""
    (entries,) = annotation.specs
    spec = []
    for d, entry in enumerate(entries):
        if d in full_dims:
            spec.append(program.seq if len(program.seq) > 1 else program.seq[0])
            continue
        if entry is None or d in merged_dims:
            spec.append(P.UNCONSTRAINED)
            continue
        kept = _kept_axes(entry, annotation, program, where)
        on_cp = [a for a in kept if a in program.cp_axes]
        if on_cp:
            raise ContextParallelError(
                f"{where} shards dim {d} over the CP axis {on_cp[0]!r}, but that dim does not "
                "carry the sequence: the CP axes shard only the sequence. Name another mesh "
                f"axis there, or pass seq_axes= if dim {d} is the sequence")
        spec.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return P(*spec)


def shard_map_mesh(annotation: compat.MeshAnnotation, program: ProgramMesh,
                   where: str) -> Mesh | None:
    """The mesh a model's ``shard_map`` runs on in the program: ``None`` to keep its own
    (the program's devices in the program's order), the program mesh when its mesh has the
    same axes on other devices or in another order, the program mesh with its size-1 axes
    added when all of its axes have size 1; refused otherwise."""
    if annotation.axes == program.axes:
        ids = tuple(int(d.id) for d in program.mesh.devices.flat)
        return None if annotation.device_ids == ids else program.mesh
    if all(n == 1 for n in annotation.axes.values()):
        extra = [a for a in annotation.axes if a not in program.axes]
        devices = np.asarray(program.mesh.devices).reshape(
            program.mesh.devices.shape + (1,) * len(extra))
        return Mesh(devices, tuple(program.mesh.axis_names) + tuple(extra),
                    axis_types=tuple(program.mesh.axis_types) + (program.mesh.axis_types[0],)
                    * len(extra))
    raise ContextParallelError(
        f"{where} runs on mesh {annotation.axes}, but the program's mesh is "
        f"{program.describe()}: a context-parallel program runs on one mesh. Build the "
        "shard_map on the mesh passed as mesh= (the model's axes beside the CP axis)")
