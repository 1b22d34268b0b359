"""The attention op: ``attention_p``, its ``AttentionSpec``/``MaskSpec``, the reference
maths every schedule and kernel shares, and sequence layouts (which global positions each
device holds). Imports only the IR toolkit."""
