"""Compiler passes; each module defines one pass, named after its file in kebab-case."""
