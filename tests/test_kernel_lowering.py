"""Every Pallas kernel lowered for its real targets from the CPU (Triton for an H200 and an
A100, Mosaic for TPU v5e and v6e): forward, dQ and the KV-major dK/dV kernels, for every
mask term, dtype, GQA grouping and head dim the kernel's capabilities declare
(``lowering/kernels/lowering_check.py``). Interpret mode, which the other kernel tests
use, never runs these lowerings.

A slice of the matrix runs in the fast tier (a different slice per target); the rest is
``slow``. ``.ci/run`` runs this whole file on every JAX version it tests.
"""
import dataclasses

import pytest

from cptransform.lowering.kernels.lowering_check import (MASKS, TARGETS, Case, cases,
                                                         declared, lower_case)
from cptransform.lowering.kernels.pallas import GPU_HEAD_DIMS

#: Every how-many-th case of a target runs in the fast tier.
FAST_EVERY = 6


def _params():
    out, seen = [], {}
    for case in cases():
        i = seen[case.target] = seen.get(case.target, -1) + 1
        marks = () if i % FAST_EVERY == list(TARGETS).index(case.target) else pytest.mark.slow
        out.append(pytest.param(case, id=case.id, marks=marks))
    return out


@pytest.mark.parametrize("case", _params())
def test_declared_case_lowers_for_its_target(case):
    _, lowered = lower_case(case)
    text = lowered.as_text()
    # The kernels are in the program as custom calls of the target's backend, not inlined
    # XLA (which is what interpret mode would have produced).
    gpu = TARGETS[case.target].variant == "gpu"
    marker = "__gpu$xla.gpu.triton" if gpu else "tpu_custom_call"
    names = ["cp_attention_fwd", "cp_attention_dq", "cp_attention_dkv"]
    if gpu and case.mask == "topk":
        # Top-k on a GPU gathers its picks (pallas_topk.py) and keeps the swept kernels
        # for key positions that repeat (a run-time choice).
        names += ["cp_topk_gather_fwd", "cp_topk_gather_bwd"]
    assert text.count(marker) == len(names), f"expected {names} as {marker}"
    for name in names:
        assert f'name = "{name}"' in text, name


def test_every_target_mask_and_dtype_is_covered():
    covered = {(c.target, c.mask, c.dtype) for c in cases()}
    dtypes = {"float16", "bfloat16", "float32"}
    for target in TARGETS:
        assert {d for t, _, d in covered if t == target} == dtypes
        assert {m for t, m, _ in covered if t == target} == set(MASKS)
    assert {(c.groups, c.head_dim) for c in cases()} >= {(1, 64), (4, 128), (2, 256)}


@pytest.mark.parametrize("head_dim", [80, 96])
def test_undeclared_gpu_head_dim_is_refused_and_does_not_lower(head_dim):
    """The GPU capability excludes head dims that are not powers of two because Triton's
    lowering refuses them: the refusal and the failure agree (a TPU lowers them)."""
    assert head_dim not in GPU_HEAD_DIMS
    assert not declared(TARGETS["h200"], "causal", "bfloat16", head_dim)
    assert declared(TARGETS["tpu-v5e"], "causal", "bfloat16", head_dim)
    gpu = Case("h200", "causal", "bfloat16", 1, head_dim)
    with pytest.raises(ValueError, match="power of 2"):
        lower_case(gpu)
    lower_case(dataclasses.replace(gpu, target="tpu-v5e"))
