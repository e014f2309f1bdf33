"""sglang plugin hook: ``--disaggregation-transfer-backend kvstage``.

sglang loads every ``sglang.srt.plugins`` entry point early in each of its processes
(``sglang.srt.plugins.load_plugins``: the launcher before it parses the command line, the
scheduler, tokenizer and detokenizer processes), then applies the hooks registered meanwhile.
:func:`register` is that entry point. It

1. adds ``kvstage`` to the flag's choices (``add_disagg_transfer_backend_choices``, sglang's own
   extension point for this list);
2. adds a ``KVSTAGE`` member to ``TransferBackend`` (an ``Enum`` sglang builds with a fixed set of
   members and converts the flag with, ``TransferBackend(value)``; sglang has no extension point
   for it, see docs/engines/sglang-hook.patch);
3. registers an AROUND hook on ``sglang.srt.disaggregation.utils.get_kv_class`` that answers the
   kvstage classes for ``TransferBackend.KVSTAGE`` and defers to sglang for every other backend
   (sglang's hook registry rebinds every module that imported ``get_kv_class`` by name).

With an sglang that has ``register_transfer_backend`` (the upstream patch in
docs/engines/sglang-hook.patch), it calls that instead of 1-3.

It imports only sglang's argument, disaggregation-utils and plugin modules (no kvstage library,
no torch work): the classes are imported when sglang first asks for them.
"""

from __future__ import annotations

import logging
from typing import Any

from . import BACKEND_NAME as BACKEND

logger = logging.getLogger(__name__)

MEMBER = "KVSTAGE"


def _add_enum_member(enum_cls: Any, name: str, value: str) -> Any:
    """``enum_cls(value)`` and ``enum_cls.<name>`` answer a new member (idempotent)."""
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = object.__new__(enum_cls)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = enum_cls
    member._sort_order_ = len(enum_cls._member_names_)
    type.__setattr__(enum_cls, name, member)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    return member


def _kvstage_classes(class_type: Any) -> Any:
    from sglang.srt.disaggregation.utils import KVClassType

    from . import conn

    mapping = {
        KVClassType.MANAGER: conn.KvstageKVManager,
        KVClassType.SENDER: conn.KvstageKVSender,
        KVClassType.RECEIVER: conn.KvstageKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: conn.KvstageKVBootstrapServer,
    }
    return mapping.get(class_type)


def get_kv_class_hook(original_fn: Any, transfer_backend: Any, class_type: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on ``get_kv_class``: kvstage's classes for ``kvstage``, sglang's otherwise."""
    from sglang.srt.disaggregation.utils import KVClassType

    if getattr(transfer_backend, "value", transfer_backend) == BACKEND and class_type != KVClassType.KVARGS:
        return _kvstage_classes(class_type)
    return original_fn(transfer_backend, class_type, *args, **kwargs)


_registered = False


def register() -> None:
    """The ``sglang.srt.plugins`` entry point ``kvstage``."""
    global _registered
    if _registered:
        return
    from sglang.srt.disaggregation import utils as disagg_utils

    if hasattr(disagg_utils, "register_transfer_backend"):
        # An sglang with docs/engines/sglang-hook.patch (upstream's extension point): use it.
        from . import conn

        disagg_utils.register_transfer_backend(
            BACKEND, conn.KvstageKVManager, conn.KvstageKVSender, conn.KvstageKVReceiver, conn.KvstageKVBootstrapServer
        )
        _registered = True
        logger.info("kvstage: registered sglang transfer backend %r (register_transfer_backend)", BACKEND)
        return
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    _add_enum_member(TransferBackend, MEMBER, BACKEND)
    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", get_kv_class_hook, HookType.AROUND)
    _registered = True
    logger.info("kvstage: registered sglang transfer backend %r", BACKEND)
