"""Memory arguments (ints, buffer protocol, __array_interface__, __cuda_array_interface__,
torch-style tensors), page lists, and KvLayout's checks of its buffers."""

import array
import ctypes

import numpy as np
import pytest

import kvstage
from kvstage import MemoryKind


def test_int_addresses():
    info = kvstage.buffer_info(0x7F0000001000)
    assert info.address == 0x7F0000001000 and info.nbytes is None and info.memory is None
    with pytest.raises(TypeError):
        kvstage.buffer_info(True)
    for bad in (0, -5, 1 << 64):
        with pytest.raises(kvstage.ArgumentError):
            kvstage.buffer_info(bad, "k_buffers[0]")
    assert kvstage.buffer_address(np.uint64(4096)) == 4096  # a numpy integer is an address too


def test_buffer_protocol_objects():
    ba = bytearray(64)
    info = kvstage.buffer_info(ba)
    assert info.nbytes == 64 and info.memory == MemoryKind.HOST
    assert info.address == ctypes.addressof((ctypes.c_char * 64).from_buffer(ba))
    with pytest.raises(BufferError):  # the export is held while the info lives
        ba.extend(b"x")
    del info
    ba.extend(b"x")
    arr = array.array("I", range(8))
    assert kvstage.buffer_info(arr).address == arr.buffer_info()[0]
    with pytest.raises(kvstage.ArgumentError, match="read-only"):
        kvstage.buffer_info(b"immutable bytes", "memory")
    with pytest.raises(kvstage.ArgumentError, match="empty"):
        kvstage.buffer_info(bytearray())
    with pytest.raises(TypeError, match="got str"):
        kvstage.buffer_info("0x1000")


def test_numpy_arrays():
    a = np.zeros((4, 3, 8), dtype=np.uint16)
    info = kvstage.buffer_info(a)
    assert (info.address, info.nbytes, info.memory) == (a.ctypes.data, a.nbytes, MemoryKind.HOST)
    assert kvstage.buffer_address(a[2]) == a.ctypes.data + 2 * 3 * 8 * 2
    with pytest.raises(kvstage.ArgumentError, match="C-contiguous"):
        kvstage.buffer_info(a[:, :, ::2], "k_buffers[1]")
    frozen = np.ones(16, dtype=np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(kvstage.ArgumentError, match="read-only"):
        kvstage.buffer_info(frozen)
    assert kvstage.buffer_info(frozen, writable=False).nbytes == 16
    assert kvstage.buffer_info(np.zeros((1, 5, 1), np.float32)[:, :, :]).nbytes == 20


class FakeCudaArray:
    """What cupy / numba / torch expose on a CUDA array."""

    def __init__(self, ptr, shape, typestr="<f2", strides=None, readonly=False):
        self.__cuda_array_interface__ = {
            "data": (ptr, readonly), "shape": shape, "typestr": typestr, "strides": strides, "version": 3,
        }


class FakeTensor:
    """The torch.Tensor methods the binding uses, without torch."""

    def __init__(self, ptr, numel, element_size, cuda, contiguous=True):
        self._ptr, self._numel, self._es, self.is_cuda, self._c = ptr, numel, element_size, cuda, contiguous

    def data_ptr(self):
        return self._ptr

    def numel(self):
        return self._numel

    def element_size(self):
        return self._es

    def is_contiguous(self):
        return self._c


def test_cuda_array_interface_and_tensors():
    info = kvstage.buffer_info(FakeCudaArray(0x7000_0000_0000, (16, 8, 128)))
    assert (info.address, info.nbytes, info.memory) == (0x7000_0000_0000, 16 * 8 * 128 * 2, MemoryKind.CUDA)
    with pytest.raises(kvstage.ArgumentError, match="C-contiguous"):
        kvstage.buffer_info(FakeCudaArray(0x7000_0000_0000, (16, 8), strides=(2, 32)))
    assert kvstage.buffer_info(FakeCudaArray(0x7000_0000_0000, (16, 8), strides=(16, 2))).nbytes == 256
    info = kvstage.buffer_info(FakeTensor(0x7100_0000_0000, 1024, 2, cuda=True))
    assert (info.address, info.nbytes, info.memory) == (0x7100_0000_0000, 2048, MemoryKind.CUDA)
    assert kvstage.buffer_info(FakeTensor(0x1000, 4, 4, cuda=False)).memory == MemoryKind.HOST
    with pytest.raises(kvstage.ArgumentError, match="contiguous"):
        kvstage.buffer_info(FakeTensor(0x1000, 4, 4, cuda=False, contiguous=False))


def test_page_lists(lib):
    from kvstage._buffers import page_array

    pages = [5, 1, 9]
    for given in (pages, tuple(pages), np.array(pages, dtype=np.int64), np.array(pages, dtype=np.uint32), range(3)):
        keep, address, count = page_array(given, "pages")
        assert count == 3 and list((ctypes.c_uint32 * 3).from_address(address)) == [int(x) for x in given]
    page_array([np.int32(4), 2], "pages")
    original = [np.int64(1), 2]
    page_array(original, "pages")
    assert isinstance(original[0], np.int64)  # the caller's list is not rewritten
    with pytest.raises(kvstage.ArgumentError, match="-1"):
        page_array([0, -1], "dst_pages")
    with pytest.raises(kvstage.ArgumentError, match="4294967296"):
        page_array([1 << 32], "dst_pages")
    with pytest.raises(TypeError):
        page_array([1.5], "dst_pages")
    with pytest.raises(TypeError):
        page_array("123", "dst_pages")


def test_kv_layout_checks_its_buffers(lib):
    pool = np.zeros((2, 2, 64, 2, 8), dtype=np.uint16)  # 64 slots of 2 heads x 8 x 2 bytes
    layout = kvstage.KvLayout(head_dim=8, global_heads=4, tp_size=2, page_size=4, k_buffers=list(pool[0]), v_buffers=list(pool[1]))
    assert layout.local_heads == 2 and layout.capacity_pages == 16 and layout.memory == MemoryKind.HOST
    assert layout.token_bytes == 32 and layout.buffer_bytes == 64 * 32
    layout.validate()
    with pytest.raises(kvstage.ArgumentError, match=r"k_buffers\[1\]"):
        kvstage.KvLayout(head_dim=8, global_heads=4, tp_size=2, page_size=4, capacity_pages=16,
                         k_buffers=[pool[0, 0], pool[0, 1, :32]], v_buffers=list(pool[1]))
    with pytest.raises(kvstage.ArgumentError, match="v_buffers"):
        kvstage.KvLayout(head_dim=8, global_heads=4, tp_size=2, page_size=4, k_buffers=list(pool[0]))
    with pytest.raises(kvstage.ArgumentError, match="has 1 buffers"):
        kvstage.KvLayout(head_dim=8, num_layers=2, k_buffers=[pool[0, 0]], v_buffers=[pool[1, 0]])
    with pytest.raises(kvstage.ArgumentError, match="mixes host and CUDA"):
        kvstage.KvLayout(head_dim=8, page_size=4, k_buffers=[pool[0, 0], FakeCudaArray(0x7000_0000_0000, (4096,), "|u1")],
                         v_buffers=list(pool[1]))
    with pytest.raises(kvstage.ArgumentError, match="capacity_pages"):
        kvstage.KvLayout(head_dim=8, k_buffers=[0x10000], v_buffers=[0x20000])
    mla = kvstage.KvLayout(model="mla", head_dim=576, k_buffers=[np.zeros((8, 576), np.uint16)], page_size=8)
    assert mla.model == kvstage.ModelKind.MLA and mla.buffers_per_layer == 1 and mla.capacity_pages == 1
    with pytest.raises(kvstage.ArgumentError, match="MLA"):
        kvstage.KvLayout(model="mla", head_dim=576, k_buffers=[0x1000], v_buffers=[0x2000], capacity_pages=1)
    # Overlapping buffers: the library names the field.
    overlapping = kvstage.KvLayout(head_dim=8, global_heads=4, tp_size=2, page_size=4,
                                   k_buffers=[pool[0, 0], pool[0, 0]], v_buffers=list(pool[1]))
    with pytest.raises(kvstage.GeometryError) as info:
        overlapping.validate()
    assert info.value.code == kvstage.Status.E_GEOMETRY_INVALID and "`layout`" in info.value.message
    assert any("puts rows on bytes of bases[0]" in c for c in info.value.causes), info.value.causes
    # A shape-only layout cannot be registered.
    with kvstage.Engine() as e:
        with pytest.raises(kvstage.ArgumentError, match="no buffers"):
            e.register_pool(kvstage.KvLayout(head_dim=8, num_layers=2))
        with pytest.raises(kvstage.ArgumentError, match="holds 16 bytes"):
            e.register_staging(4096, bytearray(16))
        # A device ring: host memory named with a device is refused here; without a CUDA
        # driver (CI) an engine-allocated device ring is NO_DEVICE, never a host ring in disguise.
        with pytest.raises(kvstage.ArgumentError, match="host memory"):
            e.register_staging(4096, bytearray(4096), device=0)
        if not kvstage.capabilities().cuda_memory:
            with pytest.raises(kvstage.DeviceError) as info:
                e.register_staging(4096, device=0)
            assert info.value.code == kvstage.Status.E_NO_DEVICE
