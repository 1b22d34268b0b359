"""Analyses over programs holding ``attention_p``: sequence axes, mask classification,
match reports and the cost model. Imports the attention op and the IR toolkit."""
