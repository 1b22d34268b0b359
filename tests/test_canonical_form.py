"""One canonical program whatever JAX traced it.

Every program of the corpus (``tests/canonical_corpus.py``: the match spellings, each
example's loss, one program per fuzzer class, Flax / NNX / optax idioms) is traced and
canonicalized, and its canonical text must equal the file kept in ``tests/canonical_forms/``.
CI runs this on every JAX line it installs (0.10.2, 0.11.2, 0.12.0.1 and the newest), so
the files hold the one form all of them give. A JAX release that spells a program
differently fails here first, naming the program and the first equation that differs;
make canonicalize (or ``compat``) give the old form, or, where the difference is harmless,
say so in ``docs/jax_versions.md`` and rewrite the files (``python tests/canonical_corpus.py``).
"""
import numpy as np
import pytest

import canonical_corpus
from cptransform.ir import compat
from cptransform.ir.module import iter_eqns, trace
from cptransform.passes.canonicalize import Canonicalize

CORPUS = canonical_corpus.corpus()


def first_difference(got: list[str], want: list[str]) -> str:
    """The first line where the two texts differ, with a little context."""
    index = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                 min(len(got), len(want)))
    context = "\n".join(f"    {line}" for line in want[max(0, index - 3):index])
    return (f"first difference at line {index + 1} (of {len(want)} kept, {len(got)} now):\n"
            f"{context}\n  kept: {want[index] if index < len(want) else '<end>'}\n"
            f"  now:  {got[index] if index < len(got) else '<end>'}")


def test_the_corpus_is_large_enough():
    """At least 40 programs, from every source the corpus draws on."""
    assert len(CORPUS) >= 40
    for prefix in ("handwritten_", "unit_dims_", "mask_builder_", "example_", "fuzz_",
                   "flax_", "optax_"):
        assert any(name.startswith(prefix) for name in CORPUS), prefix
    from fuzz_programs import ALL_CLASSES
    assert {f"fuzz_{c}" for c in ALL_CLASSES} <= set(CORPUS)


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_canonical_form_is_the_kept_one(name):
    got = canonical_corpus.canonical_form(name, CORPUS[name])
    with open(canonical_corpus.form_path(name)) as f:
        want = f.read().splitlines()
    assert got == want, (
        f"{name}: JAX {compat.jax_release()} gives another canonical program; "
        f"{first_difference(got, want)}")


def _params_are_python(value) -> bool:
    if isinstance(value, (np.integer, np.bool_)):
        return False
    if isinstance(value, (tuple, list)) and not compat.is_jaxpr_like(value):
        return all(_params_are_python(v) for v in value)
    return True


@pytest.mark.parametrize("name", ["example_llama", "fuzz_llama_block", "unit_dims_jax_nn",
                                  "mask_builder_keras_minimum", "flax_nnx_mha"])
def test_canonical_program_holds_no_release_spellings(name):
    """After canonicalize no equation, at any depth, holds a NumPy scalar param, a JAX
    helper ``jit`` call, JAX's softmax/logsumexp ``custom_jvp`` or an ``unstack``."""
    with canonical_corpus._x64(name):
        fn, args = CORPUS[name]()
        module = Canonicalize().run(trace(fn, *args)).module
    for eqn in iter_eqns(module.jaxpr):
        assert eqn.primitive.name not in ("jit", "pjit", "unstack"), eqn
        assert compat.jax_function(eqn) not in ("_softmax", "_logsumexp_impl"), eqn
        for key, value in eqn.params.items():
            assert _params_are_python(value), (eqn.primitive.name, key, value)
