"""The canonical text of a program: what its equations are, in one spelling for every JAX.

JAX's own printer differs between releases in ways that say nothing about the program (0.12.1
hoists shared bodies into a ``let`` header; ``scan`` prints ``ft_in``/``ft_out`` on 0.12 and
``num_consts``/``num_carry`` before). :func:`canonical_lines` prints a (canonicalized) jaxpr
so that the same program gives the same lines on every supported JAX:

* one line per equation, ``outs = primitive[params] ins``, variables numbered in order of
  definition (``%0``, ``%1``, ...), each with its type (``float32[2,16]``, ``~`` for a weak
  type) where it is defined; literals as value and type;
* params as :func:`~cptransform.ir.compat.stable_params` gives them (a scan's consts and
  carry counts whatever the release calls them; a param a release added absent where it
  means the earlier behaviour), sorted by name; a param whose value is ``None`` is absent
  (0.12 adds ``out_sharding=None`` where 0.10 has no such param); functions by name;
  bodies printed in place, indented.

``tests/test_canonical_form.py`` compares these lines for a corpus of programs across the
JAX releases CI installs.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from cptransform.ir import compat

def _type(aval: Any) -> str:
    weak = "~" if getattr(aval, "weak_type", False) else ""
    dtype = getattr(aval, "dtype", None)
    shape = ",".join(str(d) for d in getattr(aval, "shape", ()))
    return f"{dtype}[{shape}]{weak}" if dtype is not None else type(aval).__name__


def _value(value: Any) -> str:
    """A param value's text (not a jaxpr): ints, floats and strings by ``repr``, tuples item
    by item, functions by name, dtypes by name, anything else by ``str``."""
    if isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, np.generic):
        return f"{value.item()!r}:{value.dtype}"
    if isinstance(value, np.dtype):
        return str(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value).__name__ + "(" + ", ".join(
            f"{f}={_value(getattr(value, f))}" for f in value._fields) + ")"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_value(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, type):
        return value.__name__
    if callable(value) or hasattr(value, "call_wrapped"):  # a function, or JAX's wrapped one
        return "fn:" + str(getattr(value, "__name__", type(value).__name__))
    return str(value)


class _Printer:
    def __init__(self):
        self.lines: list[str] = []

    def jaxpr(self, closed: Any, depth: int) -> None:
        jaxpr = compat.open_jaxpr(closed)
        names: dict = {}

        def define(var) -> str:
            names[var] = f"%{len(names)}"
            return f"{names[var]}:{_type(compat.aval_of(var))}"

        def use(atom) -> str:
            if compat.is_literal(atom):
                value = np.asarray(compat.literal_value(atom))
                return f"{value.tolist()!r}:{_type(compat.aval_of(atom))}"
            return names.get(atom, "%?")

        pad = "  " * depth
        self.lines.append(pad + "consts " + " ".join(define(v) for v in jaxpr.constvars))
        self.lines.append(pad + "in " + " ".join(define(v) for v in jaxpr.invars))
        for eqn in jaxpr.eqns:
            ins = " ".join(use(a) for a in eqn.invars)
            params, bodies = self.params(eqn)
            outs = " ".join(define(v) for v in eqn.outvars)
            self.lines.append(f"{pad}{outs} = {eqn.primitive.name}[{params}] {ins}".rstrip())
            for name, body in bodies:
                self.lines.append(f"{pad}  {name} {{")
                self.jaxpr(body, depth + 2)
                self.lines.append(f"{pad}  }}")
        self.lines.append(pad + "out " + " ".join(use(v) for v in jaxpr.outvars))

    @staticmethod
    def params(eqn: Any) -> tuple[str, list]:
        texts, bodies = [], []
        params = compat.stable_params(eqn)
        for key in sorted(params):
            value = params[key]
            if value is None:
                continue
            if compat.is_jaxpr_like(value):
                bodies.append((key, value))
            elif isinstance(value, tuple) and value and all(map(compat.is_jaxpr_like, value)):
                bodies += [(f"{key}[{i}]", v) for i, v in enumerate(value)]
            else:
                texts.append(f"{key}={_value(value)}")
        return " ".join(texts), bodies


def canonical_lines(closed: Any) -> list[str]:
    """The canonical text of ``closed`` (an open or closed jaxpr), one string per line; see
    the module docstring."""
    printer = _Printer()
    printer.jaxpr(closed, 0)
    return printer.lines
