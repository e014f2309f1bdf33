"""The examples under python/examples run as they are (an example nobody runs rots)."""

import pathlib
import runpy

import pytest

EXAMPLES = sorted((pathlib.Path(__file__).parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(lib, path, capsys):
    runpy.run_path(str(path), run_name="__main__")
    assert "every byte in place" in capsys.readouterr().out
