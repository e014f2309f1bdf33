"""Test setup: the kvstage package of this source tree (not an installed copy) and the library.

The library comes from the normal lookup (``KVSTAGE_LIBRARY``, next to the package, the system
loader). When ``KVSTAGE_LIBRARY`` is set (the ctest does), a library that does not load fails
every test that needs it; without it, those tests are skipped with the reason.
"""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE_ROOT = os.path.dirname(HERE)
for path in (HERE, PACKAGE_ROOT):
    if path not in sys.path:
        sys.path.insert(0, path)
sys.dont_write_bytecode = True

import kvstage  # noqa: E402


@pytest.fixture(scope="session")
def lib():
    """The loaded library (skips the test when none is found and KVSTAGE_LIBRARY is unset)."""
    try:
        return kvstage.load_library()
    except kvstage.LibraryVersionError:
        raise
    except kvstage.LibraryLoadError as e:
        if os.environ.get(kvstage.ENV_VAR):
            raise
        pytest.skip(f"libkvstage is not available (set {kvstage.ENV_VAR}): {e}")


@pytest.fixture
def child_env(lib):
    """Environment for child Python processes: the same library and package, no bytecode files."""
    env = dict(os.environ)
    env[kvstage.ENV_VAR] = lib.path
    env["PYTHONPATH"] = os.pathsep.join([PACKAGE_ROOT, HERE] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env
