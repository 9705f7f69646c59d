"""Benchmarks: scripts that print figures against a ceiling or a peer measured in the same run.

Each ``benchmarks/NAME.py`` runs as ``.venv/bin/python benchmarks/NAME.py`` and has a
``--smoke`` mode (a few seconds, tiny sizes, one run) that still prints its verdict or
ceiling lines; ``tests/test_benchmarks_smoke.py`` runs every one of them. The code
several benchmarks share lives in :mod:`benchmarks.support`.
"""
