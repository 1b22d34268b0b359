"""The top layer: the ``context_parallel`` transform, ``explain()``, plan charts, pass
instruments and the ``cptransform`` CLI. It may import every layer below it."""
