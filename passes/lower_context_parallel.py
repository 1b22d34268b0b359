"""Pass ``lower-context-parallel``: ``attention_p`` → the planned schedule under shard_map.

Each attention becomes :func:`~cptransform.lowering.context_parallel_attention.
context_parallel_attention` with the schedule, layout and local-step kernel written on its
equation by ``plan-context-parallel``: a ``shard_map`` island over the CP mesh axes only.
Everything else stays in the program for XLA's SPMD partitioner; inputs and every
intermediate whose dim is the whole sequence get a sharding constraint on that dim (other
dims unconstrained, so a data axis keeps its batch sharding), so no stray all-gather of
activations appears between attentions. A ``seq_window_p`` (an op
reading a bounded window of neighbours) on the sequence runs under ``shard_map`` with a halo
exchange (:mod:`cptransform.lowering.seq_window`; the pass log gives its bytes); a windowed
op ``match-windows`` could not wrap is refused there, never left to the partitioner. The
model's own sharding constraints and ``shard_map`` regions are re-expressed on the CP mesh
(:mod:`cptransform.lowering.model_shardings`): their non-CP axes kept, sequence dims on the
CP axes.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from cptransform.analysis.primitives import INLINABLE, Family, names_of
from cptransform.analysis.seq_axes import SeqAxes
from cptransform.analysis.sequence_groups import sharded_dim
from cptransform.analysis.sharded_sequence import LOCAL
from cptransform.analysis.seq_axes_summary import analyse
from cptransform.ir import compat
from cptransform.ir.errors import ContextParallelError, PipelineError
from cptransform.ir.facts import Fact
from cptransform.ir.module import Module, iter_eqns
from cptransform.ir.pipeline import Pass, PassResult
from cptransform.ir.rewrite import Rewriter, trace_like
from cptransform.lowering.context_parallel_attention import (context_parallel_attention,
                                                              sequence_mesh_axes)
from cptransform.lowering.model_shardings import ProgramMesh, constraint_spec, shard_map_mesh
from cptransform.lowering.seq_permute import collective_permutable, permuted_sequence
from cptransform.lowering.recurrence import passed_recurrence
from cptransform.lowering.seq_window import halo_bytes, windowed_op
from cptransform.op.attention import attention_p
from cptransform.op.attention_reference import attention_reference
from cptransform.op.recurrence import Method, recurrence_p
from cptransform.op.seq_permute import seq_permute_p
from cptransform.op.seq_window import seq_window_p

#: Windowed ops left unwrapped by match-windows: refused on a sharded sequence.
RAW_WINDOWS = names_of(Family.WINDOW) - {seq_window_p.name}
ELEMENTWISE = names_of(Family.ELEMENTWISE)


@functools.lru_cache(maxsize=256)
def _schedule_call(spec, mesh, cp_axes: tuple, in_layout_order: bool):
    """:func:`context_parallel_attention` for one planned attention, as one ``jax.jit``
    per distinct ``(spec, mesh, axes, order)`` (the spec carries the schedule, layout and
    kernel).

    The layers of a Python loop hold equal attentions: through one jitted function JAX
    traces the schedule once and reuses that jaxpr, and its caches then linearize and lower
    it to StableHLO once too (XLA inlines the calls, so the compiled program is the same).
    The 4-layer Llama loop of ``bench/compile_cost.py`` took 9.2 s to
    ``jit(value_and_grad(...)).lower`` without this and 5.5 s with it (one A/B run while
    another job loaded the machine)."""
    return jax.jit(functools.partial(
        context_parallel_attention, spec=spec, mesh=mesh, axes=cp_axes,
        schedule=spec.schedule, layout=spec.layout,
        # Read only for a spec planned without a kernel (one written by hand): "auto", as
        # plan-context-parallel's default.
        kernel="auto", in_layout_order=in_layout_order))


class _Lowerer(Rewriter):
    """Re-trace with attention replaced and sequence shardings constrained."""

    def __init__(self, axes: SeqAxes, mesh, cp_axes, reordered: bool,
                 index_of: dict[int, int], sharded: int | None = None):
        super().__init__(inlinable=INLINABLE)
        self.index_of = index_of
        self.reordered = reordered
        self.axes, self.mesh = axes, mesh
        self.cp_axes = tuple(cp_axes)
        self.log: list[str] = []
        self.seq = sequence_mesh_axes(self.cp_axes)
        self.sharded = sharded  # which sequence carries the sharding (planner), or None
        self.cp = math.prod(mesh.shape[a] for a in self.cp_axes)  # devices over the CP axes
        self.program = ProgramMesh(mesh, self.cp_axes, self.seq)

    def constrain(self, value, atom):
        if not hasattr(value, "shape"):
            return value
        dims = self.sharded_dims(atom)
        return self.shard(value, dims[0]) if dims else value

    def sharded_dims(self, atom) -> tuple[int, ...]:
        """The dims of ``atom`` that may carry the CP sharding, first choice first: its
        whole sequence dims (those of the sharded sequence first, where the planner chose
        one of several: a value holding only another one, ``[B·T, P]`` with the frames
        sharded, is moved to it rather than gathered), else the major dim of a group of
        dims holding the sequence."""
        dims = sorted(self.axes.full_dims(atom),
                      key=lambda d: self.axes.sequence[(atom, d)] != self.sharded)
        return tuple(dims) or tuple(d for d in (sharded_dim(atom.aval.shape, g, self.cp)
                                                for g in self.axes.groups(atom))
                                    if d is not None)

    def shard(self, value, dim: int):
        """``value`` constrained to be sharded over the CP axes along ``dim``."""
        spec = [P.UNCONSTRAINED] * value.ndim
        spec[dim] = self.seq if len(self.seq) > 1 else self.seq[0]
        return jax.lax.with_sharding_constraint(value, NamedSharding(self.mesh, P(*spec)))

    def local(self, eqn, invals):
        """An attention whose own sequence is not sharded but whose batch holds the sharded
        one (``plan-context-parallel`` wrote ``local``): its single-device computation under
        ``shard_map``, every operand split along that batch dim (each device attends over
        the keys of its own part of the batch: no communication, forward or backward)."""
        spec = eqn.params["spec"]
        q = eqn.invars[0]
        index = next(i for i, d in enumerate(spec.q.batch)
                     if self.axes.sequence.get((q, d)) == self.sharded)
        size = q.aval.shape[spec.q.batch[index]]
        batch_dims = {"q": spec.q.batch, "k": spec.k.batch, "v": spec.v.batch}
        split = self.seq if len(self.seq) > 1 else self.seq[0]

        def placement(name, atom):
            dim = batch_dims.get(name, range(len(spec.q.batch)))[index]
            if atom.aval.shape[dim] != size:  # broadcast along the batch: on every device
                return P()
            return P(*(None,) * dim, split)

        in_specs = tuple(placement(n, a) for n, a in zip(spec.operand_names(), eqn.invars))
        local_spec = spec.replace(schedule=None, layout=None, kernel=None)
        run = jax.shard_map(lambda *xs: attention_reference(*xs, spec=local_spec),
                            mesh=self.mesh, in_specs=in_specs, out_specs=in_specs[0],
                            axis_names=set(self.cp_axes))
        return run(*invals)

    def eval_eqn(self, eqn, invals):
        if eqn.primitive is attention_p:
            spec = eqn.params["spec"]
            if spec.schedule is None:
                raise PipelineError(
                    f"the attention at {compat.source_line(eqn)} has no schedule; run "
                    "plan-context-parallel right before lowering")
            # Named for profiles: cptransform/attention#3/ring/... (the index is the
            # plan's, found by the equation's identity).
            scope = f"cptransform/attention#{self.index_of[id(eqn)]}/{spec.schedule}"
            with compat.eqn_context(eqn), jax.named_scope(scope):
                out = self.local(eqn, invals) if spec.schedule == LOCAL else \
                    _schedule_call(spec, self.mesh, self.cp_axes,
                                   self.reordered and spec.positions
                                   and spec.layout != "contiguous")(*invals)
            outs = [out]
        elif eqn.primitive is seq_window_p and self.axes.full_dims(eqn.invars[0]):
            window = eqn.params["window"]
            dims = self.axes.full_dims(eqn.invars[0])
            seq_dim = window.dim if window.dim in dims else dims[0]
            with compat.eqn_context(eqn):
                outs = [windowed_op(*invals, window=window, mesh=self.mesh, seq=self.seq,
                                    seq_dim=seq_dim, where=compat.source_line(eqn))]
            if seq_dim == window.dim:
                aval = eqn.invars[0].aval
                self.log.append(f"{window.describe()} at {compat.source_line(eqn)}: halo "
                                f"exchange of {halo_bytes(window, aval.shape, aval.dtype.itemsize)}"
                                " bytes per rank")
        elif eqn.primitive is recurrence_p:
            outs = self._recurrence(eqn, invals)
        elif eqn.primitive is seq_permute_p and self._collective(eqn):
            params = eqn.params
            with compat.eqn_context(eqn):
                outs = [permuted_sequence(invals[0], layout=params["layout"],
                                          dim=params["dim"], inverse=params["inverse"],
                                          mesh=self.mesh, seq=self.seq)]
        elif eqn.primitive.name == compat.SHARDING_CONSTRAINT \
                and compat.constraint_annotation(eqn) is not None:
            return [self._model_constraint(eqn, invals[0])]
        elif eqn.primitive.name == compat.DEVICE_PUT:
            return self._model_placement(eqn, invals)
        elif eqn.primitive.name == compat.SHARD_MAP:
            where = f"the shard_map at {compat.source_line(eqn)}"
            annotation = compat.shard_map_annotation(eqn)
            mesh = shard_map_mesh(annotation, self.program, where)
            outs = self._model_shard_map(eqn, invals, mesh, annotation, where)
        else:
            self._refuse_raw_window(eqn)
            outs = super().eval_eqn(eqn, invals)
        if self._inherits_sharding(eqn):
            return outs
        return [self.constrain(o, v) for o, v in zip(outs, eqn.outvars)]

    def _model_constraint(self, eqn, value):
        """The model's constraint on the CP mesh: its non-CP axes kept, the sequence dims
        sharded over the CP axes (:func:`constraint_spec`): one dim, the sharded
        sequence's where a value holds several (frames and patches); the others are left to
        the partitioner."""
        spec = self._program_spec(eqn.invars[0], compat.constraint_annotation(eqn),
                                  f"the sharding constraint at {compat.source_line(eqn)}")
        with compat.eqn_context(eqn):
            return jax.lax.with_sharding_constraint(value, NamedSharding(self.mesh, spec))

    def _program_spec(self, atom, annotation, where: str) -> P:
        """``annotation`` (a model's, for ``atom``) as a spec of the CP mesh."""
        full = tuple(d for d in self.sharded_dims(atom)[:1] if d in self.axes.full_dims(atom))
        merged = tuple(d for d in self.axes.dims(atom) if d not in full)
        return constraint_spec(annotation, self.program, full, merged, where)

    def _model_placement(self, eqn, invals) -> list:
        """A ``device_put`` inside the model (EasyDeL places its RoPE tables on its mesh):
        a placement on a mesh is re-expressed on the CP mesh as a constraint is; no
        destination leaves the value as it is; a device, a sharding that names no mesh axes
        or a memory kind of its own is refused."""
        where = f"the device_put at {compat.source_line(eqn)}"
        outs = []
        for atom, value, dest in zip(eqn.invars, invals, compat.device_put_annotations(eqn)):
            if dest is None:
                outs.append(value)
                continue
            if not isinstance(dest, tuple) or dest[1] not in (None, "device"):
                raise ContextParallelError(
                    f"{where} places a value on {dest}, not on a mesh's device memory: a "
                    "context-parallel program runs on one mesh. Place it with a "
                    "NamedSharding of the mesh passed as mesh= (or of a 1-device mesh of "
                    "the model's axes), or leave the placement out of the transformed "
                    "function")
            spec = self._program_spec(atom, dest[0], where)
            with compat.eqn_context(eqn):
                outs.append(jax.lax.with_sharding_constraint(value, NamedSharding(self.mesh, spec)))
        return outs

    def _model_shard_map(self, eqn, invals, mesh, annotation, where: str) -> list:
        """The model's ``shard_map`` bound on ``mesh`` (None: its own), its body as it is.
        A body on a 1-device mesh moved onto the program's mesh with axes added keeps the
        old mesh in the types of values it made while traced (a reshape's sharding, a
        custom_vjp's forward), which JAX rejects there: refused, naming the JAX error."""
        if mesh is None:
            return compat.bind_eqn(eqn, invals)
        try:
            return compat.bind_eqn(eqn, invals, compat.shard_map_on(eqn, mesh))
        except ValueError as error:
            if annotation.axes == self.program.axes:
                raise
            raise NotImplementedError(
                f"{where} runs on the 1-device mesh {annotation.axes}; moved onto the "
                f"program's mesh {self.program.describe()} its body is rejected by JAX "
                f"({str(error).splitlines()[0]}). Run the layer without shard_map (its dense "
                "or sorted path), or build the shard_map on the mesh passed as "
                "mesh=") from error

    def _inherits_sharding(self, eqn) -> bool:
        """An elementwise result whose sequence dims an operand holds in the same place:
        the partitioner gives it that operand's (constrained) sharding, so a constraint of
        its own only costs tracing time (`bench/compile_cost.py`)."""
        if eqn.primitive.name not in ELEMENTWISE:
            return False
        dims = self.axes.full_dims(eqn.outvars[0])
        return any(not compat.is_literal(a) and self.axes.full_dims(a) == dims
                   and a.aval.shape == eqn.outvars[0].aval.shape for a in eqn.invars)

    def _recurrence(self, eqn, invals) -> list:
        """A recurrence planned to pass state (or totals) runs under ``shard_map``
        (:mod:`cptransform.lowering.recurrence`); a gathered one is the op it was, in
        natural order, for XLA's partitioner."""
        rec = eqn.params["recurrence"]
        with compat.eqn_context(eqn):
            if rec.method in (None, Method.GATHER):
                return rec.apply(*invals) if rec.layout is None else \
                    recurrence_p.bind(*invals, recurrence=rec)
            self.log.append(f"{rec.describe()} at {compat.source_line(eqn)}")
            return passed_recurrence(*invals, recurrence=rec, mesh=self.mesh, seq=self.seq)

    def _collective(self, eqn) -> bool:
        """A layout conversion of a whole sequence-sharded dim: moved by collectives (a
        gather would all-gather the sequence)."""
        params, atom = eqn.params, eqn.invars[0]
        if params["dim"] not in self.axes.full_dims(atom):
            return False
        return collective_permutable(params["layout"], atom.aval.shape, params["dim"],
                                     params["inner"], self.mesh, self.seq)

    def _refuse_raw_window(self, eqn) -> None:
        """A windowed op match-windows could not wrap must not read a sharded sequence:
        XLA's SPMD partitioning of some (select_and_scatter) is wrong there."""
        if eqn.primitive.name not in RAW_WINDOWS:
            return
        if not any(self.axes.full_dims(a) for a in eqn.invars if not compat.is_literal(a)):
            return
        raise ContextParallelError(
            f"{eqn.primitive.name} at {compat.source_line(eqn)} reads a window along the "
            "sharded sequence, but only a max/min/sum reduce_window or a 1-D convolution "
            "with stride 1 along the sequence, no base dilation and an output as long as "
            "its input runs with a halo exchange; pool with stride 1 and slice the result "
            "(x[:, ::stride]), pad to keep the length, or pass seq_axes= so this value is "
            "not sequence-sharded")

    def _touches(self, jaxpr) -> bool:
        """Every body is re-traced: attentions and sharding constraints may sit anywhere."""
        return True


@dataclass(frozen=True)
class LowerContextParallel(Pass):
    """Replace each attention with its planned context-parallel schedule."""

    name = "lower-context-parallel"
    summary = "attention_p -> the shard_map program of its planned schedule"
    requires = (Fact.MESH, Fact.PLAN)

    def run(self, module: Module) -> PassResult:
        # Numbered as plan-context-parallel numbers its plans (the same walk of iter_eqns).
        index_of = {id(e): i for i, e in enumerate(
            e for e in iter_eqns(module.jaxpr) if e.primitive is attention_p)}
        n = len(index_of)
        if n == 0 and not (module.facts.seq_axes and module.facts.seq_axes.lengths):
            # Nothing is sharded: the program runs as written, the model's own annotations
            # on the caller's mesh included (the API refuses it unless allow_unsharded).
            return PassResult(module, False)
        # Attentions are in layout order only where reorder-sequence permuted the program
        # (``facts.layout``); otherwise a zigzag/striped attention permutes its operands.
        sharded = module.facts.sharded_sequence
        lowerer = _Lowerer(analyse(module), module.facts.mesh, module.facts.cp_axes,
                           reordered=module.facts.layout is not None,
                           index_of=index_of,
                           sharded=None if sharded is None else sharded.sequence)
        jaxpr = compat.open_jaxpr(module.jaxpr)
        consts = compat.consts_of(module.jaxpr)

        def fn(*xs):
            xs = [lowerer.constrain(x, v) for x, v in zip(xs, jaxpr.invars)]
            return lowerer.eval(jaxpr, consts, xs)

        new = compat.dce(trace_like(jaxpr, fn))
        log = tuple(f"lower-context-parallel: {m}" for m in lowerer.log)
        return PassResult(module.with_jaxpr(new), n > 0 or bool(log), log)

    def verify(self, module: Module) -> None:
        left = sum(1 for e in iter_eqns(module.jaxpr) if e.primitive is attention_p)
        assert left == 0, f"{left} attention_p equations were not lowered"
