"""What the benchmarks share: measuring and printing helpers, and the scenario families.

Nothing here runs on its own; each module says what it owns in its docstring.
"""
