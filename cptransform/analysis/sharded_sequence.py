"""Which sequence carries the CP sharding when one value holds several: factorised
space-time attention over a video ``[B, T, P, C]``.

Spatial attention attends along the patches of each frame (its batch dims hold the frames),
temporal attention along the frames of each patch (its batch dims hold the patches): two
sequences, both dims of one value, and the CP axis shards one dim of it. Shard the frames
and spatial attention runs *locally* (each device attends over the patches of its own
frames: no communication) while temporal attention runs its schedule; shard the patches
and it is the other way round. An attention whose own sequence is not the sharded one and
whose batch does not hold it either is *moved*: an all-to-all brings its q, k, v to its own
sequence's sharding and its output back (forward and backward).

:func:`choose` prices each sequence that is one attention's own and another's batch (the
attentions' predicted times; a local one's compute alone; a moved one's all-to-alls at the
link's bandwidth on top) and keeps the least; ``plan-context-parallel`` writes ``local``
onto the attentions that run locally and the record below into ``module.facts``, where
``lower-context-parallel`` and ``explain()`` read it.
"""
from __future__ import annotations

from dataclasses import dataclass

from cptransform.analysis.seq_axes import SeqAxes

#: The schedule name written onto an attention that runs on each device's part of its batch.
LOCAL = "local"


@dataclass(frozen=True)
class AttentionAxes:
    """The sequences of one attention: ``own`` (its queries attend along it; ``None`` when
    the analysis has none) and, per other sequence its batch holds as a whole dim, q's
    first batch dim holding it (``batch``, ``{sequence: dim}``)."""

    own: int | None
    batch: dict


def attention_axes(axes: SeqAxes, eqn, cp: int) -> AttentionAxes:
    """:class:`AttentionAxes` of one ``attention_p`` equation (batch dims that split
    evenly over ``cp`` devices only: a local attention's devices hold equal parts)."""
    spec = eqn.params["spec"]
    q = eqn.invars[0]
    full = set(axes.full_dims(q))
    batch: dict = {}
    for d in spec.q.batch:
        if d in full and q.aval.shape[d] % cp == 0:
            batch.setdefault(axes.sequence[(q, d)], d)
    return AttentionAxes(axes.sequence.get((q, spec.q.seq)), batch)


@dataclass(frozen=True)
class Choice:
    """Sharding ``sequence``: the predicted time of all attentions, which run locally and
    which are moved."""

    sequence: int
    time_s: float
    along: tuple[int, ...]
    local: tuple[int, ...]
    moved: tuple[int, ...]

    def describe(self, lengths) -> str:
        along = ", ".join(f"#{i}" for i in self.along)
        text = (f"sequence {self.sequence} (length {lengths[self.sequence]}, attention "
                f"{along} along it): {self.time_s * 1e3:.3g} ms")
        if self.local:
            text += ", local: " + ", ".join(f"#{i}" for i in self.local)
        if self.moved:
            text += ", moved by all-to-all: " + ", ".join(f"#{i}" for i in self.moved)
        return text


@dataclass(frozen=True)
class ShardedSequence:
    """The decision: ``choices[0]`` is kept (least predicted time); ``lengths`` are the
    program's sequences'."""

    choices: tuple[Choice, ...]
    lengths: tuple[int, ...]

    @property
    def sequence(self) -> int:
        return self.choices[0].sequence

    @property
    def local(self) -> tuple[int, ...]:
        return self.choices[0].local

    def describe(self) -> str:
        chosen, *others = self.choices
        text = (f"sharded sequence: {chosen.describe(self.lengths)} (the least predicted "
                "time of the sequences one value holds together)")
        if others:
            text += "; runner-up " + "; ".join(c.describe(self.lengths) for c in others)
        return text


def choose(attentions: list[AttentionAxes], time_s: list[float], compute_s: list[float],
           move_s: list[float], lengths: tuple[int, ...]) -> ShardedSequence | None:
    """The sequence to shard, or ``None`` when no attention's batch holds another
    attention's sequence. Per attention ``i``: its planned schedule's predicted time
    ``time_s[i]`` (fastest when its own sequence is sharded), its compute alone
    ``compute_s[i]`` (when it runs locally), and ``move_s[i]``, the all-to-alls that move
    it otherwise."""
    own = {a.own for a in attentions if a.own is not None}
    candidates = sorted(own & {s for a in attentions for s in a.batch})
    if not candidates:
        return None
    choices = []
    for s in candidates:
        along = tuple(i for i, a in enumerate(attentions) if a.own == s)
        local = tuple(i for i, a in enumerate(attentions) if a.own != s and s in a.batch)
        moved = tuple(i for i, a in enumerate(attentions) if a.own != s and s not in a.batch)
        total = sum(compute_s[i] if i in local else
                    time_s[i] + (move_s[i] if i in moved else 0.0)
                    for i in range(len(attentions)))
        choices.append(Choice(s, total, along, local, moved))
    choices.sort(key=lambda c: (c.time_s, c.sequence))
    return ShardedSequence(tuple(choices), lengths)
