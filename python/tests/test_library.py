"""Finding and loading the library: lookup order, version check, clear errors."""

import ctypes.util
import os
import re
import subprocess
import sys

import pytest

import kvstage
from kvstage import _lib

HERE = os.path.dirname(os.path.abspath(__file__))
CARGO_TOML = os.path.join(HERE, os.pardir, os.pardir, "Cargo.toml")
NAME = _lib.LIBRARY_NAMES[0]  # libkvstage.so.<SONAME version>


def test_package_version_equals_the_crate_version():
    if not os.path.exists(CARGO_TOML):
        pytest.skip("not in a kvstage checkout")
    text = open(CARGO_TOML, encoding="utf-8").read()
    package = text.split("[package]", 1)[1].split("\n[", 1)[0]
    crate = re.search(r'^version\s*=\s*"([^"]+)"', package, re.M).group(1)
    assert kvstage.__version__ == crate, (
        f"python/kvstage/_version.py says {kvstage.__version__} but Cargo.toml says {crate}: keep them equal"
    )


def test_loaded_library_matches_the_package(lib):
    assert lib.version == kvstage.__version__ == kvstage.version()
    major, minor, patch = (int(x) for x in kvstage.__version__.split("."))
    assert lib.kvstage_version() == major << 16 | minor << 8 | patch
    assert kvstage.load_library() is lib  # already loaded: the same object
    caps = kvstage.capabilities()
    assert caps.tcp and caps.host_memory


def test_explicit_path_that_does_not_exist(tmp_path):
    missing = tmp_path / "nowhere" / NAME
    with pytest.raises(kvstage.LibraryLoadError) as info:
        _lib.find_and_load(str(missing))
    assert isinstance(info.value, ImportError)
    assert "the path argument" in str(info.value) and str(missing) in str(info.value)


def test_environment_variable_that_points_nowhere(tmp_path):
    missing = str(tmp_path / NAME)
    with pytest.raises(kvstage.LibraryLoadError) as info:
        _lib.find_and_load(environ={kvstage.ENV_VAR: missing})
    assert f"{kvstage.ENV_VAR}={missing}" in str(info.value)


def test_a_file_that_is_not_a_library(tmp_path):
    bogus = tmp_path / NAME
    bogus.write_bytes(b"not an ELF file")
    with pytest.raises(kvstage.LibraryLoadError) as info:
        _lib.find_and_load(str(bogus))
    assert str(bogus) in str(info.value)


def test_a_library_that_is_not_kvstage():
    libm = ctypes.util.find_library("m")
    if libm is None:
        pytest.skip("no libm to load")
    with pytest.raises(kvstage.LibraryLoadError) as info:
        _lib.find_and_load(libm)
    assert "is not a kvstage library" in str(info.value)


def test_not_found_anywhere_lists_what_was_tried(tmp_path):
    with pytest.raises(kvstage.LibraryLoadError) as info:
        _lib.find_and_load(environ={}, package_dir=str(tmp_path), system_names=("libkvstage-absent.so.0",))
    text = str(info.value)
    assert text.startswith("libkvstage.so not found")
    assert kvstage.ENV_VAR in text and "load_library" in text
    assert str(tmp_path / NAME) in text and "libkvstage-absent.so.0" in text


def test_version_mismatch_is_a_clear_error(lib):
    with pytest.raises(kvstage.LibraryVersionError) as info:
        _lib.find_and_load(lib.path, expected_version="9.9.9")
    text = str(info.value)
    assert f"libkvstage {lib.version}" in text and "kvstage is 9.9.9" in text
    assert isinstance(info.value, kvstage.LibraryLoadError) and isinstance(info.value, ImportError)


def test_lookup_order(lib, tmp_path):
    package_dir = tmp_path / "pkg"
    package_dir.mkdir()
    (package_dir / NAME).symlink_to(lib.path)
    # next to the package
    found = _lib.find_and_load(environ={}, package_dir=str(package_dir), system_names=())
    assert found.path == str(package_dir / NAME)
    # the environment variable wins over the package directory; a directory stands for the library in it
    env_dir = tmp_path / "env"
    env_dir.mkdir()
    (env_dir / NAME).symlink_to(lib.path)
    found = _lib.find_and_load(environ={kvstage.ENV_VAR: str(env_dir)}, package_dir=str(package_dir))
    assert found.path == str(env_dir / NAME)
    # the explicit path wins over both
    found = _lib.find_and_load(lib.path, environ={kvstage.ENV_VAR: str(env_dir)}, package_dir=str(package_dir))
    assert found.path == lib.path
    # an explicit choice that fails does not fall through to the others
    with pytest.raises(kvstage.LibraryLoadError):
        _lib.find_and_load(str(tmp_path / "absent.so"), environ={kvstage.ENV_VAR: str(env_dir)}, package_dir=str(package_dir))


def run_python(code, env):
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_missing_library_in_a_fresh_process(child_env, tmp_path):
    """Importing works without a library; the first use raises an ImportError saying what to do."""
    env = dict(child_env)
    env[kvstage.ENV_VAR] = str(tmp_path / "missing" / NAME)
    code = (
        "import kvstage\n"
        "try:\n"
        "    kvstage.Engine()\n"
        "except ImportError as e:\n"
        "    print(type(e).__name__, '|', e)\n"
    )
    out = run_python(code, env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("LibraryLoadError | cannot load libkvstage from KVSTAGE_LIBRARY="), out.stdout
    assert f"missing/{NAME}" in out.stdout


def test_numpy_and_torch_are_not_imported(child_env):
    code = (
        "import sys, kvstage\n"
        "e = kvstage.Engine()\n"
        "e.register_staging(4096, bytearray(4096))\n"
        "kvstage.buffer_info(bytearray(16)); kvstage.buffer_info(1 << 20)\n"
        "e.open_room\n"
        "e.close()\n"
        "print(sorted(m for m in ('numpy', 'torch', 'cupy') if m in sys.modules))\n"
    )
    out = run_python(code, child_env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_doctor_run_reports_this_host(lib):
    """``kvstage_doctor_run``: the readable report and the same report as JSON (a host without
    RDMA or CUDA gets a clean report, not an error)."""
    text = kvstage.doctor_run()
    assert text.startswith(f"kvstage {kvstage.__version__} doctor") and "RDMA" in text, text[:200]
    report = kvstage.doctor_run(json=True)
    assert report["version"] == kvstage.__version__
    assert {"rdma", "cuda", "same_host"} <= set(report)
