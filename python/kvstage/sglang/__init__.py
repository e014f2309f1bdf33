"""kvstage as an sglang PD-disaggregation transfer backend (``--disaggregation-transfer-backend
kvstage``).

Installed with kvstage, the ``sglang.srt.plugins`` entry point ``kvstage`` (``kvstage.sglang.plugin:
register``) makes sglang accept the flag and hand ``get_kv_class`` the classes of
:mod:`kvstage.sglang.conn`. Importing this package imports neither sglang nor the library.
"""

from typing import Any

__all__ = [
    "KvstageKVManager",
    "KvstageKVSender",
    "KvstageKVReceiver",
    "KvstageKVBootstrapServer",
    "KvstageTransferError",
    "register",
    "BACKEND_NAME",
]

BACKEND_NAME = "kvstage"


def register() -> None:
    """The sglang plugin hook (see :func:`kvstage.sglang.plugin.register`)."""
    from .plugin import register as _register

    _register()


def __getattr__(name: str) -> Any:
    if name in ("KvstageKVManager", "KvstageKVSender", "KvstageKVReceiver", "KvstageKVBootstrapServer", "KvstageTransferError"):
        from . import conn

        return getattr(conn, name)
    raise AttributeError(name)
