"""Small utilities every layer above the contract may use.

``units`` (byte sizes with units, JSON numbers that cannot be too long),
``quoting`` (values cut to a readable length in error messages) and
``native_probe`` (optional native fast paths tried in a child process first,
so a crash there is a fallback, not a dead engine).
"""
