"""A layout conversion of a sequence-sharded dim as the collectives that move its tokens.

:data:`~cptransform.op.seq_permute.seq_permute_p` converts a value between natural order
and a layout's order. Left to XLA's SPMD partitioner its gather all-gathers the whole
sequence on every device (and its transpose all-reduces it). Under ``shard_map`` over the
CP axes only the tokens that change rank move, each once:

* **zigzag** (``2cp`` chunks; layout rank ``j`` holds chunks ``j`` and ``2cp-1-j``, natural
  rank ``r`` holds chunks ``2r`` and ``2r+1``): two collective-permutes of half a shard.
  Natural → zigzag: permute ``h`` sends each rank's half ``h`` (chunk ``2r+h``) to the
  layout rank holding it; rank ``j`` receives its first chunk (``j``, of parity ``j % 2``)
  from permute ``j % 2`` and its second from the other. Zigzag → natural: permute ``h``
  sends the chunk of parity ``h`` each rank holds to the natural rank whose half ``h`` it is.
* **striped** (token ``t`` on rank ``t % cp``): one all-to-all, when the shard length is a
  multiple of ``cp``: natural rank ``r``'s tokens ``rL + a·cp + b`` go to rank ``b``, which
  stores them at slot ``r·L/cp + a``.

Per device and conversion: zigzag sends and receives one shard, striped ``(cp-1)/cp`` of
one, against the whole sequence gathered by the partitioner. Gradients are the transposes
JAX derives through ``shard_map`` (the reverse permutes, the inverse all-to-all).
"""
from __future__ import annotations

import math
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from cptransform.ir import compat
from cptransform.op.layouts import SequenceLayout


def _zigzag_chunk_home(m: int, cp: int) -> int:
    """The zigzag rank holding natural chunk ``m`` of ``2cp``."""
    return m if m < cp else 2 * cp - 1 - m


def _zigzag(x, *, seq, cp: int, inverse: bool):
    """One rank's shard (sequence on dim 0) converted natural ↔ zigzag."""
    c = x.shape[0] // 2
    halves = (x[:c], x[c:])
    rank = lax.axis_index(seq)
    odd = rank % 2 == 1
    if not inverse:
        got = [compat.ppermute(halves[h], seq,
                               [(r, _zigzag_chunk_home(2 * r + h, cp)) for r in range(cp)])
               for h in (0, 1)]
        return jnp.concatenate([jnp.where(odd, got[1], got[0]),
                                jnp.where(odd, got[0], got[1])], axis=0)
    # The chunk of parity h on zigzag rank j: its first (chunk j) when j % 2 == h.
    perms = [[(j, (j if j % 2 == h else 2 * cp - 1 - j) // 2)
              for j in range(cp)] for h in (0, 1)]
    sent = [jnp.where(odd, halves[1], halves[0]), jnp.where(odd, halves[0], halves[1])]
    return jnp.concatenate([compat.ppermute(sent[h], seq, perms[h]) for h in (0, 1)], axis=0)


def _striped(x, *, seq, cp: int, inverse: bool):
    """One rank's shard (sequence on dim 0, a multiple of ``cp`` long) converted natural ↔
    striped."""
    n, rest = x.shape[0], x.shape[1:]
    if not inverse:
        # [L/cp (a), cp (b)] -> [cp (b), L/cp (a)]: row b goes to rank b; rows arrive by r.
        y = jnp.swapaxes(x.reshape((n // cp, cp) + rest), 0, 1)
        return lax.all_to_all(y, seq, 0, 0, tiled=True).reshape(x.shape)
    y = lax.all_to_all(x.reshape((cp, n // cp) + rest), seq, 0, 0, tiled=True)
    return jnp.swapaxes(y, 0, 1).reshape(x.shape)


def collective_permutable(layout: SequenceLayout, shape, dim: int, inner: int, mesh,
                          seq: tuple[str, ...]) -> bool:
    """Whether :func:`permuted_sequence` moves this conversion with collectives: a whole
    sequence dim, the layout over the ranks of ``seq``, striped shards a multiple of
    ``cp`` over one mesh axis (an all-to-all over several is not used)."""
    cp = math.prod(mesh.shape[a] for a in seq)
    if inner != 1 or shape[dim] != layout.seq_len or layout.cp != cp:
        return False
    if layout.name == "zigzag":
        return True
    return layout.name == "striped" and layout.local_len % cp == 0 and len(seq) == 1


def converted(x, *, layout: SequenceLayout, dim: int, inverse: bool, mesh,
              seq: tuple[str, ...]):
    """``x`` (dim ``dim`` a whole sequence, sharded over ``seq`` or to be) converted
    natural ↔ ``layout`` order: by collectives where :func:`collective_permutable`, else
    by the one-device gather (a dim that is not sharded: a dense mask's key columns)."""
    if collective_permutable(layout, x.shape, dim, 1, mesh, seq):
        return permuted_sequence(x, layout=layout, dim=dim, inverse=inverse, mesh=mesh,
                                 seq=seq)
    return layout.unpermute(x, dim) if inverse else layout.permute(x, dim)


def permuted_sequence(x, *, layout: SequenceLayout, dim: int, inverse: bool, mesh,
                      seq: tuple[str, ...]):
    """``seq_permute_p(x)`` for ``x`` whose dim ``dim`` is the whole sequence sharded over
    the mesh axes ``seq`` (major first), under ``shard_map`` (other mesh axes stay
    automatic, so a data axis keeps its batch sharding). Check
    :func:`collective_permutable` first."""
    cp = math.prod(mesh.shape[a] for a in seq)
    convert = {"zigzag": _zigzag, "striped": _striped}[layout.name]

    def local(shard):
        y = convert(jnp.moveaxis(shard, dim, 0), seq=seq, cp=cp, inverse=inverse)
        return jnp.moveaxis(y, 0, dim)

    spec = [None] * x.ndim
    spec[dim] = seq if len(seq) > 1 else seq[0]
    return jax.shard_map(local, mesh=mesh, in_specs=(P(*spec),),
                         out_specs=P(*spec), axis_names=set(seq))(x)
