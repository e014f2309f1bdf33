"""Entry point of the `python` ctest: runs pytest on python/tests.

Exit 77 (ctest: skipped) only when pytest or numpy cannot be imported, which is the one thing a
fresh machine may lack (``python3 -m pip install numpy pytest``). Anything else is a result:
pytest's exit code, except that "no tests collected" (5) is turned into a failure. The ctest sets
KVSTAGE_LIBRARY to the library it just built, so a library that does not load fails the tests
instead of skipping them.
"""

import os
import sys

SKIP = 77


def main() -> int:
    missing = []
    for module in ("pytest", "numpy"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        print(
            f"SKIP: the Python binding tests need {' and '.join(missing)} "
            f"({sys.executable} -m pip install numpy pytest)"
        )
        return SKIP
    import pytest

    sys.dont_write_bytecode = True
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    here = os.path.dirname(os.path.abspath(__file__))
    print(f"python {sys.version.split()[0]}, KVSTAGE_LIBRARY={os.environ.get('KVSTAGE_LIBRARY', '(unset)')}", flush=True)
    rc = int(pytest.main([here, "-q", "-rs", "-p", "no:cacheprovider", *sys.argv[1:]]))
    if rc == 5:
        print("FAIL: pytest collected no tests")
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
