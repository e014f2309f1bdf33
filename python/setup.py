"""Builds ``libkvstage.so`` with cargo as part of ``pip install ./python`` and bundles it.

The library is built from the repository this directory belongs to (``cargo build --release
--locked -p kvstage --lib``; cargo's own ``target/`` unless ``CARGO_TARGET_DIR`` says otherwise) and
copied into the package under its SONAME (``kvstage/libkvstage.so.0.4``), where :func:`kvstage.load_library`
finds it after an explicit path and ``KVSTAGE_LIBRARY``. ``KVSTAGE_BUNDLE_LIBRARY=/path/to/libkvstage.so``
bundles that file instead of building (a library built elsewhere, e.g. by the CMake build).
"""

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def _version() -> str:  # kvstage/_version.py, without importing the package
    scope: dict = {}
    exec((HERE / "kvstage" / "_version.py").read_text(), scope)
    return scope["__version__"]


def _built_library() -> Path:
    explicit = os.environ.get("KVSTAGE_BUNDLE_LIBRARY")
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise SystemExit(f"KVSTAGE_BUNDLE_LIBRARY={explicit}: no such file")
        return path
    manifest = REPO / "Cargo.toml"
    if not manifest.is_file():
        raise SystemExit(
            f"kvstage: {manifest} not found: build the package from a kvstage checkout "
            "(pip install ./python), or set KVSTAGE_BUNDLE_LIBRARY to a built libkvstage.so"
        )
    cargo = shutil.which("cargo") or str(Path.home() / ".cargo" / "bin" / "cargo")
    cmd = [cargo, "build", "--release", "--locked", "-p", "kvstage", "--lib", "--manifest-path", str(manifest)]
    print("kvstage: " + " ".join(cmd), flush=True)
    try:
        subprocess.run(cmd, check=True, cwd=REPO)
    except FileNotFoundError:
        raise SystemExit("kvstage: cargo not found: install a Rust toolchain (https://rustup.rs)") from None
    target = Path(os.environ.get("CARGO_TARGET_DIR") or REPO / "target")
    if not target.is_absolute():
        target = REPO / target
    return target / "release" / "libkvstage.so"


class BuildPyWithLibrary(build_py):
    """build_py, then the library into the package directory of the build."""

    def run(self):
        super().run()
        library = _built_library()
        major, minor = _version().split(".")[:2]
        soversion = f"0.{minor}" if major == "0" else major  # as build.rs and kvstage/_lib.py
        dest = Path(self.build_lib) / "kvstage" / f"libkvstage.so.{soversion}"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(library, dest)
        print(f"kvstage: bundled {library} as {dest}", flush=True)


class BinaryDistribution(Distribution):
    """The wheel holds a native library: tag it for this platform, not as pure Python."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildPyWithLibrary}, distclass=BinaryDistribution)
