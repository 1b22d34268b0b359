"""The IR toolkit (bottom layer): ``Module``, the ``Graph`` view, pattern rules, the
re-tracing ``Rewriter``, ``Pass``/``Pipeline``, and ``compat``, the one module that touches
JAX internals. It imports nothing else of cptransform."""
