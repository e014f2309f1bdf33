"""``pip install ./python`` into a fresh virtualenv builds the library and bundles it: the installed
package, imported from outside the checkout with no ``KVSTAGE_LIBRARY`` and no ``LD_LIBRARY_PATH``,
loads the copy inside itself and works.

It builds the library with cargo (minutes when nothing is cached), so it runs as its own ctest,
``python_install``, which sets ``KVSTAGE_TEST_INSTALL=1``.
"""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE_DIR = os.path.dirname(HERE)

pytestmark = pytest.mark.skipif(
    os.environ.get("KVSTAGE_TEST_INSTALL") != "1",
    reason="the python_install ctest runs it (KVSTAGE_TEST_INSTALL=1): it builds the library",
)

PROBE = r"""
import json, os, kvstage
lib = kvstage.load_library()
engine = kvstage.Engine("127.0.0.1:0", transport="tcp")
engine.close()
caps = kvstage.capabilities()
print(json.dumps({
    "package": os.path.dirname(os.path.realpath(kvstage.__file__)),
    "library": os.path.realpath(lib.path),
    "version": lib.version,
    "package_version": kvstage.__version__,
    "tcp": bool(caps.tcp),
    "library_name": kvstage._lib.LIBRARY_NAMES[0],
}))
"""


def test_installed_package_loads_its_bundled_library(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("KVSTAGE_LIBRARY", "LD_LIBRARY_PATH", "PYTHONPATH")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    install = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", PACKAGE_DIR], env=env, capture_output=True, text=True
    )
    assert install.returncode == 0, f"pip install ./python failed:\n{install.stdout}\n{install.stderr}"

    probe = subprocess.run([python, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout)
    site = str(venv.resolve())
    assert found["package"].startswith(site), f"imported {found['package']}, not the installed package"
    assert found["library"] == os.path.join(found["package"], found["library_name"])
    assert found["version"] == found["package_version"]
    assert found["tcp"]
