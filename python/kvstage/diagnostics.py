"""Diagnostics (header section "diagnostics"): what this host offers kvstage.

The objects describe themselves: :meth:`Engine.describe` (its ``"transport"`` field is the
engine's transport in one line), :meth:`Room.describe`, :meth:`Operation.describe`.
"""

from __future__ import annotations

import json as _json
from typing import Union

from ._common import read_text
from .library import get_library

__all__ = ["doctor_run"]


def doctor_run(json: bool = False) -> Union[str, dict]:
    """``kvstage_doctor_run``: what this host offers kvstage: whether libibverbs loads, the RDMA
    devices and their ports, dma-buf registration and peer-memory support, whether libcuda loads
    and the GPU count, a verdict, and whether the same-host path works here. Readable text, or with
    ``json=True`` the report as a dict. A host without RDMA or CUDA gets a clean report, not an
    error."""
    lib = get_library()
    text = read_text(lib, "kvstage_doctor_run", 1 if json else 0)
    return _json.loads(text) if json else text
