"""The one version source of the Python package (pyproject.toml reads it).

It must equal the C library's version (``[package] version`` in ``Cargo.toml``,
``kvstage_version_string()``): :func:`kvstage.load_library` refuses a library whose version
differs, and ``tests/test_library.py`` fails when this file and ``Cargo.toml`` disagree.
"""

__version__ = "0.4.0"
