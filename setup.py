"""Only the optional C extension; everything else is in pyproject.toml.

``tiering.copy._bulkcopy`` copies a table of regions with the GIL released once
per call. It is optional: where no C compiler exists the install goes on and
``tiering.copy.bulk`` uses its ctypes fallback. No CPU-specific flags: the
build must run on any x86-64 (or other) host, whatever CPU built it.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tiering.copy._bulkcopy",
            sources=["tiering/copy/_bulkcopy.c"],
            optional=True,
        )
    ]
)
