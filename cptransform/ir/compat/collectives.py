"""Collectives and kernels whose spelling differs between JAX releases."""
from __future__ import annotations

import contextlib
from typing import Any

import jax

from cptransform.ir.compat.versions import _jax_version, jax_release
from cptransform.ir.errors import KernelError

def ppermute(x: Any, axes: tuple[str, ...], perm: list[tuple[int, int]]) -> Any:
    """``lax.ppermute`` of ``x`` over the mesh axes ``axes`` (major first), with ``perm``'s
    ranks numbered in ``axes``' order, as ``lax.axis_index(axes)`` numbers them.

    JAX 0.10 numbers a multi-axis ``ppermute`` in the mesh's axis order whatever order the
    axes are named in; JAX 0.11 and 0.12 refuse axes named out of mesh order. Both read the
    same program when the axes are passed in mesh order and the ranks renumbered to it."""
    from jax import lax

    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    mesh_order = tuple(a for a in _core_mesh_axis_names() if a in axes)
    if len(axes) <= 1 or mesh_order == axes or len(mesh_order) != len(axes):
        return lax.ppermute(x, axes, perm)
    sizes = {a: lax.axis_size(a) for a in axes}

    def renumbered(rank: int) -> int:
        coords = {}
        for a in reversed(axes):
            coords[a], rank = rank % sizes[a], rank // sizes[a]
        index = 0
        for a in mesh_order:
            index = index * sizes[a] + coords[a]
        return index

    return lax.ppermute(x, mesh_order, [(renumbered(s), renumbered(d)) for s, d in perm])


def _core_mesh_axis_names() -> tuple[str, ...]:
    """The axis names, in mesh order, of the mesh a ``shard_map`` body runs under."""
    from jax._src import mesh as _mesh
    return tuple(_mesh.get_abstract_mesh().axis_names)


def cudnn_missing() -> str | None:
    """Why this JAX cannot serve :func:`cudnn_attention` (and the fix); ``None`` if it can."""
    fa = None
    with contextlib.suppress(ImportError):
        from jax._src.cudnn import fused_attention_stablehlo as fa
    gone = ", ".join(n for n in ("dot_product_attention", "MaskType", "AttentionLayout",
                                 "_dot_product_attention_bwd_p_wrapper") if not hasattr(fa, n))
    return gone and (f"kernel 'cudnn' needs {gone} of jax._src.cudnn.fused_attention_stablehlo"
                     f", absent from JAX {_jax_version()}: use kernel='pallas'/'xla'") or None


def cudnn_attention(*args, backward: bool = False, scale: float, causal: bool, window=None):
    """cuDNN attention (JAX's private module) of ``[B, T, H, D]`` 16-bit operands, unmasked or
    causal top-left (query ``i`` sees keys ``i - window < j <= i``): ``(q, k, v) -> (o, lse f32
    [B, H, T])``, never differentiated; ``backward``: ``(q, k, v, o, lse, do) -> (dq, dk, dv)``
    fed the rows' merged ``o``/``lse`` (``rowsum(dO∘O)`` inside)."""
    if cudnn_missing():
        raise KernelError(cudnn_missing())
    from jax._src.cudnn import fused_attention_stablehlo as fa
    mask = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
    if not backward:
        return tuple(fa.dot_product_attention(*args, scale=scale, mask_type=mask,
                                              sliding_window_length=window, return_residual=True))
    extra = {"score_mod": None} if jax_release() >= (0, 12) else {}  # 0.12: flex attention
    unused = jax.numpy.zeros((0,), args[0].dtype)  # bias, seqlens, offsets, page tables
    return tuple(fa._dot_product_attention_bwd_p_wrapper.bind(
        *args[:3], *[unused] * 7, args[4], args[3], args[5], scale=scale, seed=42,
        dropout_rate=0.0, variadic_args=(False, False), mask_type=mask,
        layout=fa.AttentionLayout.BTNH.value, sliding_window_length=window, **extra))
