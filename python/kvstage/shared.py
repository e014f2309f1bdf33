"""Host memory a same-host prefill can map: where a decode rank puts its KV pool for direct mode.

A decode rank whose KV pool buffers all lie in :class:`SharedMemory` serves *direct mode*: a
prefill on the same host copies each chunk from its own pages straight into the decode pages
(one pass, no staging ring, no scatter). Anything else stays on the ring path.

Header section "staging memory" (``kvstage_shared_alloc``, ``kvstage_shared_free``)."""

import ctypes
from ctypes import byref, c_void_p
from typing import Optional

from ._common import Handle, check
from ._lib import Library
from .errors import KVStageError
from .library import get_library


class SharedMemory(Handle):
    """``nbytes`` of zeroed, resident host memory from ``kvstage_shared_alloc``.

    :meth:`close` refuses while an engine's pool lies in it: close the engine first (or shut it
    down, see :meth:`Engine.shutdown`). ``memoryview()`` exposes it to numpy (``numpy.frombuffer(m.memoryview(), dtype)``) or
    torch (``torch.frombuffer(m.memoryview(), dtype=torch.bfloat16)``)."""

    _kind = "shared memory"
    _free_fn = "kvstage_shared_free"

    def __init__(self, nbytes: int, library: Optional[Library] = None):
        lib = library or get_library()
        out = c_void_p()
        check(lib, lib.kvstage_shared_alloc(int(nbytes), byref(out)), "kvstage_shared_alloc")
        super().__init__(lib, int(out.value))
        self.nbytes = int(nbytes)

    def close(self) -> None:
        """``kvstage_shared_free``. Idempotent. Raises :class:`ArgumentError`, and keeps the
        memory, while it holds the KV pool of an engine neither closed nor shut down
        (:meth:`Engine.shutdown` returned)."""
        with self._close_lock:
            if self._ptr is None:
                return
            check(self._lib, self._lib.kvstage_shared_free(self._ptr), "kvstage_shared_free")
            self._ptr = None

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
            return
        try:
            self.close()
        except KVStageError:
            pass  # the exception in flight says more; the memory stays (a live engine's pool)

    @property
    def address(self) -> int:
        """The first byte's address (what a :class:`KvLayout` buffer names)."""
        return self._handle()

    def memoryview(self) -> memoryview:
        """The memory as a writable, flat byte view. The view (and an array made from it) keeps
        this object alive, so the memory is not freed under it by garbage collection; an explicit
        :meth:`close` frees it regardless (close only after the engine and the arrays are gone)."""
        array = (ctypes.c_uint8 * self.nbytes).from_address(self._handle())
        array._owner = self  # the view's exporter holds the allocation's owner
        return memoryview(array).cast("B")
