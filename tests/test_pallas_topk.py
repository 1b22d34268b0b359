"""The Pallas-Triton top-k gather kernels (lowering/kernels/pallas_topk.py), interpreted on
the CPU outside shard_map, against the reference's dense mask: picks shared by a GQA group
and per head, the mask's other terms at the picks, a soft-cap, NaN and Inf; and which loops
the Pallas kernel gathers with where. They lower for NVIDIA GPUs in
tests/test_kernel_lowering.py."""
import jax.numpy as jnp
import numpy as np
import pytest

from cptransform.lowering.kernels import topk_gather
from cptransform.lowering.kernels.pallas import PallasKernel
from cptransform.lowering.kernels.pallas_topk import TritonLoops
from test_match_support import randn
from test_sparse_topk import check_gather, gather_case


class TritonGather:
    """The gather path with the Triton loops interpreted, as a kernel (protocol)."""

    loops = TritonLoops(interpret=True)

    def forward(self, block, spec, running=None):
        return topk_gather.forward(block, spec, running, None, self.loops)

    def backward(self, block, o, lse, do, spec):
        return topk_gather.backward(block, o, lse, do, spec, None, None, None, None, None,
                                    None, self.loops)


@pytest.mark.parametrize("per_head,heads,terms,softcap", [
    (False, (4, 2), (), None),                       # one pick set per GQA group
    (True, (4, 2), ("segments", "dense"), 5.0),      # a pick set per query head
    (False, (3, 1), ("segments",), None),            # every head shares the picks (MQA)
])
def test_triton_gather_matches_reference(rng, per_head, heads, terms, softcap):
    """Repeated, out-of-range and past-causal picks among shuffled key positions."""
    block, spec = gather_case(rng, tq=21, tkv=45, k=40, heads=heads, per_head=per_head,
                              terms=terms, softcap=softcap)
    check_gather(block, spec, kernel=TritonGather())


def test_triton_gather_keeps_nan_and_inf_as_dense(rng):
    """A NaN in V and an Inf in K at keys no query picks, a NaN query row, an Inf in V at a
    picked key and an Inf in dO: as the dense softmax (test_sparse_topk's XLA case)."""
    block, spec = gather_case(rng, b=1, tq=20, tkv=24, k=5)
    positions, picks = np.asarray(block.kv_pos)[0], np.asarray(block.topk)
    unpicked = np.flatnonzero(~np.isin(positions, picks))
    seen = int(np.flatnonzero(positions == picks[0, 0, -1, 0])[0])
    block = block.replace(v=block.v.at[0, int(unpicked[0]), 1, 3].set(jnp.nan)
                          .at[0, seen, 0, 4].set(jnp.inf),
                          k=block.k.at[0, int(unpicked[-1]), 0, 2].set(jnp.inf),
                          q=block.q.at[0, 5, 2, 1].set(jnp.nan))
    do = randn(rng, *block.q.shape[:3], block.v.shape[-1]).at[0, 19, 0, 2].set(-jnp.inf)
    check_gather(block, spec, do=do, kernel=TritonGather())


def test_pallas_kernel_gathers_on_gpus_only(rng):
    """The GPU variant compiled gathers with the Triton loops, with a bias or interpreted
    with the XLA loops; the TPU variant and picks as many as the keys sweep."""
    block, spec = gather_case(rng, tq=16, tkv=24, k=5)
    gpu = PallasKernel(variant="gpu", interpret=False)
    assert isinstance(gpu._gathered(block, spec), TritonLoops)
    assert PallasKernel(variant="gpu", interpret=True)._gathered(block, spec) \
        is topk_gather.XLA_LOOPS
    biased, biased_spec = gather_case(rng, tq=16, tkv=24, k=5, terms=("bias",))
    assert gpu._gathered(biased, biased_spec) is topk_gather.XLA_LOOPS
    assert PallasKernel(variant="tpu", interpret=False)._gathered(block, spec) is None
    assert gpu._gathered(block.replace(topk=block.topk[..., :1].repeat(24, -1)), spec) is None
