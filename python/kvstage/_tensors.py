"""Engines' tensors as kvstage sees them: the address, shape and byte strides of an array or
tensor, read through its own protocols (numpy's ``__array_interface__``,
``__cuda_array_interface__``, a torch-style ``data_ptr()``/``stride()``/``element_size()``), and
the check that a tensor's strides nest in the order an engine's layout names.

Nothing here imports numpy or torch. Used by :meth:`kvstage.KvLayout.from_tensors`.
"""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

from ._buffers import _itemsize
from ._lib import LayoutPreset, MemoryKind, ModelKind
from .errors import argument_error

__all__ = ["TensorView", "EnginePool", "is_tensor", "tensor_view", "check_nesting", "sglang_tensors", "vllm_tensors", "trtllm_tensors"]


class TensorView(NamedTuple):
    """One array or tensor: ``address`` of element ``[0, ..., 0]``, ``shape``, ``strides`` in
    bytes, ``itemsize`` in bytes, ``memory`` (host or CUDA), ``device`` (the CUDA ordinal where
    known, else None), ``obj`` (the object itself, to keep referenced)."""

    name: str
    address: int
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]
    itemsize: int
    memory: MemoryKind
    device: Optional[int]
    obj: Any


def _torch_like(obj: Any) -> bool:
    return callable(getattr(obj, "data_ptr", None)) and callable(getattr(obj, "stride", None)) and callable(getattr(obj, "element_size", None))


def is_tensor(obj: Any) -> bool:
    """Whether ``obj`` is an array or tensor (not a list of them)."""
    return _torch_like(obj) or hasattr(obj, "__cuda_array_interface__") or hasattr(obj, "__array_interface__")


def _dense(shape: Sequence[int], itemsize: int) -> Tuple[int, ...]:
    out, step = [], itemsize
    for extent in reversed(shape):
        out.append(step)
        step *= extent
    return tuple(reversed(out))


def _from_interface(obj: Any, iface: dict, memory: MemoryKind, name: str) -> TensorView:
    data = iface.get("data")
    if not isinstance(data, tuple) or len(data) != 2:
        raise argument_error(name, "has an array interface without a (pointer, read_only) data tuple")
    address, read_only = data
    if read_only:
        raise argument_error(name, "is read-only, but the library writes into the pool")
    shape = tuple(int(x) for x in iface.get("shape", ()))
    itemsize = _itemsize(iface.get("typestr", ""), name)
    strides = iface.get("strides")
    own = getattr(obj, "strides", None)  # numpy's and cupy's own strides (bytes), also where the
    if isinstance(own, tuple) and len(own) == len(shape):  # interface leaves them out (contiguous)
        strides = own
    strides = _dense(shape, itemsize) if strides is None else tuple(int(s) for s in strides)
    device = None
    if memory == MemoryKind.CUDA:
        device = getattr(getattr(obj, "device", None), "id", None)
    return TensorView(name, int(address or 0), shape, strides, itemsize, memory, device, obj)


def tensor_view(obj: Any, name: str) -> TensorView:
    """Reads ``obj``'s address, shape and byte strides. A torch tensor: ``data_ptr()``,
    ``stride()`` (elements) × ``element_size()``, ``is_cuda``; ``__cuda_array_interface__``
    (CUDA) or ``__array_interface__`` (host; numpy). Raises for read-only, empty or negatively
    strided tensors."""
    if _torch_like(obj):
        itemsize = int(obj.element_size())
        shape = tuple(int(x) for x in obj.shape)
        strides = tuple(int(s) * itemsize for s in obj.stride())
        cuda = bool(getattr(obj, "is_cuda", False))
        device = None
        if cuda:
            index = getattr(getattr(obj, "device", None), "index", None)
            device = None if index is None else int(index)
        view = TensorView(name, int(obj.data_ptr()), shape, strides, itemsize, MemoryKind.CUDA if cuda else MemoryKind.HOST, device, obj)
    elif hasattr(obj, "__cuda_array_interface__"):
        view = _from_interface(obj, obj.__cuda_array_interface__, MemoryKind.CUDA, name)
    elif hasattr(obj, "__array_interface__"):
        view = _from_interface(obj, obj.__array_interface__, MemoryKind.HOST, name)
    else:
        raise TypeError(
            f"{name}: expected an array or tensor (numpy, torch, __cuda_array_interface__), got {type(obj).__name__}"
        )
    if any(extent == 0 for extent in view.shape):
        raise argument_error(name, f"is empty (shape {view.shape})")
    if view.address <= 0:
        raise argument_error(name, "has no data pointer")
    bad = [i for i, (s, e) in enumerate(zip(view.strides, view.shape)) if s < 0 and e > 1]
    if bad:
        raise argument_error(name, f"has a negative stride on axis {bad[0]} (strides {view.strides} bytes)")
    return view


def check_nesting(name: str, order: str, axes: Sequence[Tuple[str, int, int]], itemsize: int, what: str) -> None:
    """Checks that axes ``(label, extent, byte stride)``, outermost first as ``order`` names them,
    nest: the innermost is contiguous elements, each other axis of extent > 1 steps over at least
    everything inside it (padding allowed). Raises naming the tensor, the axis, its stride and the
    least stride the order implies."""
    inner = list(reversed(axes))
    label, extent, stride = inner[0]
    if extent > 1 and stride != itemsize:
        raise argument_error(
            name,
            f"the {label} axis has stride {stride} bytes, {what} needs contiguous elements ({itemsize} bytes: "
            f"the {itemsize}-byte dtype); strides {_describe(axes)}",
        )
    span, inside = itemsize * extent, [label]
    for label, extent, stride in inner[1:]:
        if extent > 1 and stride < span:
            raise argument_error(
                name,
                f"the {label} axis has stride {stride} bytes, but {what} puts it outside the {', '.join(inside)} axes "
                f"({span} bytes): the strides do not match the order {order} (strides {_describe(axes)})",
            )
        span = span + (extent - 1) * stride if extent > 1 else span
        inside.insert(0, label)


def _describe(axes: Sequence[Tuple[str, int, int]]) -> str:
    return ", ".join(f"{label} {stride}" for label, _, stride in axes)


# --- engines' tensors (KvLayout.from_tensors) ------------------------------------------------------


class EnginePool(NamedTuple):
    """What an engine's tensors say: per layer K (and V) addresses, the strides, the shape, and
    the axis each number came from (for errors)."""

    label: str  # the tensor errors about the whole pool name ("tensors", "tensors[0]", ...)
    views: List[TensorView]
    k: List[int]
    v: Optional[List[int]]
    v_offset: int
    page_stride: int
    token_stride: int
    head_stride: int
    layer_stride: Optional[int]
    blocks: int
    page_size: int
    local_heads: int
    head_dim: int
    blocks_axis: str
    token_axis: str
    heads_axis: str
    head_axis: str
    # V's head size (None: K's) and strides (page, token, head; 0: K's) where V's heads differ.
    head_dim_v: Optional[int] = None
    v_strides: Tuple[int, int, int] = (0, 0, 0)


def _per_layer(obj: Any, name: str, ndim: int, what: str) -> Tuple[List[TensorView], Optional[int]]:
    """Per-layer views of ``ndim`` dimensions from a list of tensors or one tensor with a leading
    layer axis, all of one shape, stride and element size; and the bytes between consecutive
    layers where they are evenly spaced (None otherwise, or with one layer in a list)."""
    if is_tensor(obj):
        t = tensor_view(obj, name)
        if len(t.shape) != ndim + 1:
            raise argument_error(
                name, f"has shape {t.shape}: expected {ndim + 1} dimensions (layers, {what}), or a list of per-layer {what} tensors"
            )
        step = t.strides[0] if t.shape[0] > 1 or t.strides[0] > 0 else None
        views = [
            TensorView(f"{name}[{i}]", t.address + i * t.strides[0], t.shape[1:], t.strides[1:], t.itemsize, t.memory, t.device, obj)
            for i in range(t.shape[0])
        ]
    else:
        if isinstance(obj, (str, bytes)) or not hasattr(obj, "__iter__"):
            raise TypeError(f"{name}: expected a list of per-layer {what} tensors, or one tensor, got {type(obj).__name__}")
        views = [tensor_view(x, f"{name}[{i}]") for i, x in enumerate(obj)]
        if not views:
            raise argument_error(name, "holds no tensors")
        for v in views:
            if len(v.shape) != ndim:
                raise argument_error(v.name, f"has shape {v.shape}: expected {ndim} dimensions ({what})")
        gaps = {b.address - a.address for a, b in zip(views, views[1:])}
        step = gaps.pop() if len(gaps) == 1 else None
        if step is not None and step <= 0:
            step = None
    for v in views[1:]:
        _alike(v, views[0], "every layer's tensor is alike")
    return views, step


def _alike(v: TensorView, first: TensorView, why: str) -> None:
    """Raises naming ``v`` unless its element size, shape and strides are ``first``'s."""
    for field, said in (("itemsize", "{}-byte elements"), ("shape", "shape {}"), ("strides", "strides {} bytes")):
        a, b = getattr(v, field), getattr(first, field)
        if a != b:
            raise argument_error(v.name, f"has {said.format(a)}, {first.name} has {said.format(b)} ({why})")


def _stride(extent: int, stride: int) -> int:
    """An axis's stride for the layout: an axis of one entry is never stepped over."""
    return max(0, stride) if extent <= 1 else stride


def sglang_tensors(tensors: Any, kind: ModelKind, page_size: int) -> EnginePool:
    """sglang: ``(k_tensors, v_tensors)`` of ``[slots, heads, head_dim]`` per layer (MLA: the
    latent tensors, alone or as ``(latents,)``/``(latents, None)``)."""
    mla = kind == ModelKind.MLA
    if mla and not is_tensor(tensors) and isinstance(tensors, (tuple, list)) and tensors and not is_tensor(tensors[0]):
        if len(tensors) > 2 or (len(tensors) == 2 and tensors[1] is not None):
            raise argument_error("tensors", "an MLA pool has one latent tensor per layer: pass (latents,) or the latents alone")
        tensors = tensors[0]
    if mla:
        k, step = _per_layer(tensors, "tensors", 3, "[slots, 1, latent]")
        v = None
    else:
        if is_tensor(tensors) or not isinstance(tensors, (tuple, list)) or len(tensors) != 2:
            raise argument_error("tensors", "sglang's MHA pool is (k_tensors, v_tensors): two lists of per-layer [slots, heads, head_dim] tensors")
        k, step = _per_layer(tensors[0], "tensors[0]", 3, "K [slots, heads, head_dim]")
        v, _ = _per_layer(tensors[1], "tensors[1]", 3, "V [slots, heads, head_dim]")
        if len(v) != len(k):
            raise argument_error("tensors[1]", f"holds {len(v)} layers, tensors[0] holds {len(k)}")
        # V may have heads of its own size (`v_head_dim`): then its own strides too.
        if v[0].shape[2] == k[0].shape[2]:
            _alike(v[0], k[0], "V is shaped as K")
        elif (v[0].shape[:2], v[0].itemsize) != (k[0].shape[:2], k[0].itemsize):
            raise argument_error(v[0].name, f"has shape {v[0].shape} of {v[0].itemsize}-byte elements, K {k[0].shape} of {k[0].itemsize} (V differs from K in head_dim only)")
    t = k[0]
    label = "tensors" if mla and is_tensor(tensors) else ("tensors[0]" if not mla and is_tensor(tensors[0]) else t.name)
    (slots, heads, dim), (ts, hs, es) = t.shape, t.strides
    check_nesting(label, "[slots, heads, head_dim]", [("slot", slots, ts), ("head", heads, hs), ("element", dim, es)], t.itemsize, "sglang")
    if slots < page_size:
        raise argument_error(label, f"holds {slots} token slots, fewer than one page of {page_size}")
    head_dim_v, v_strides = None, (0, 0, 0)
    if v is not None and v[0].shape[2] != dim:
        (_, _, head_dim_v), (vts, vhs, ves) = v[0].shape, v[0].strides
        check_nesting(v[0].name, "[slots, heads, head_dim_v]", [("slot", slots, vts), ("head", heads, vhs), ("element", head_dim_v, ves)], t.itemsize, "sglang")
        v_strides = (page_size * _stride(slots, vts), _stride(slots, vts), _stride(heads, vhs))
    return EnginePool(
        head_dim_v=head_dim_v,
        v_strides=v_strides,
        label=label,
        views=k + (v or []),
        k=[x.address for x in k],
        v=None if v is None else [x.address for x in v],
        v_offset=0,
        page_stride=page_size * _stride(slots, ts),
        token_stride=_stride(slots, ts),
        head_stride=_stride(heads, hs),
        layer_stride=step,
        blocks=slots // page_size,
        page_size=page_size,
        local_heads=heads,
        head_dim=dim,
        blocks_axis=f"{slots} slots // page_size {page_size}",
        token_axis="page_size",
        heads_axis="axis 1",
        head_axis="axis 2",
    )


def vllm_tensors(tensors: Any, which: LayoutPreset, kind: ModelKind, head_dim: Optional[int]) -> EnginePool:
    """vLLM: per-layer ``[B, H, N, C]`` views, or one ``[L, B, H, N, C]`` tensor, stored in
    ``which.order``; ``C = K‖V``."""
    views, step = _per_layer(tensors, "tensors", 4, "[B, H, N, C]")
    t = views[0]
    label = "tensors" if is_tensor(tensors) or step is not None else t.name
    (blocks, heads, tokens, cell), (bs, hs, ns, cs) = t.shape, t.strides
    what = f"{which.preset_name} ([L, B, H, N, C] stored as {which.order})"
    head_dim_v = None
    if kind == ModelKind.MHA:
        if head_dim is None and cell % 2:
            raise argument_error(label, f"has cells (axis C) of {cell} elements, an MHA cell is K‖V: an even number (or give head_dim where V's heads differ)")
        if head_dim is not None and not 0 < head_dim < cell:
            raise argument_error(label, f"has cells (axis C) of {cell} elements, an MHA cell is K‖V: more than head_dim {head_dim}")
        dim = cell // 2 if head_dim is None else head_dim
        head_dim_v = cell - dim
    else:
        dim = cell
    axes = {"B": ("B", blocks, bs), "H": ("H", heads, hs), "N": ("N", tokens, ns), "C": ("C", cell, cs)}
    if step is not None:
        axes["L"] = ("L", len(views), step)
    elif len(views) > 1 and which.order[0] != "L":
        raise argument_error(
            "tensors",
            f"the layers' tensors do not lie evenly apart, but {which.order} keeps every layer in one block "
            f"(addresses {', '.join(hex(v.address) for v in views[:4])}{', …' if len(views) > 4 else ''})",
        )
    check_nesting(label, which.order, [axes[a] for a in which.order if a in axes], t.itemsize, what)
    return EnginePool(
        label=label,
        views=views,
        k=[x.address for x in views],
        v=None,
        v_offset=dim * t.itemsize if kind == ModelKind.MHA else 0,
        page_stride=_stride(blocks, bs),
        token_stride=_stride(tokens, ns),
        head_stride=_stride(heads, hs),
        layer_stride=step,
        blocks=blocks,
        page_size=tokens,
        local_heads=heads,
        head_dim=dim,
        blocks_axis="axis B",
        token_axis="axis N",
        heads_axis="axis H",
        head_axis="axis C holds K‖V" if kind == ModelKind.MHA else "axis C",
        head_dim_v=head_dim_v,
    )


def trtllm_tensors(tensors: Any, kind: ModelKind) -> EnginePool:
    """TensorRT-LLM: one ``[blocks, L, 2, H, N, D]`` pool (MLA: ``[blocks, L, 1, 1, N, D]``) or its
    per-layer slices ``[blocks, 2, H, N, D]``."""
    if is_tensor(tensors):
        t = tensor_view(tensors, "tensors")
        if len(t.shape) != 6:
            raise argument_error("tensors", f"has shape {t.shape}: expected [blocks, L, K/V, H, N, D] (6 dimensions), or a list of per-layer [blocks, K/V, H, N, D] slices")
        # The layer axis is the second: move it first for _per_layer.
        views = [
            TensorView(f"tensors[:, {i}]", t.address + i * t.strides[1], t.shape[:1] + t.shape[2:], t.strides[:1] + t.strides[2:], t.itemsize, t.memory, t.device, tensors)
            for i in range(t.shape[1])
        ]
        step: Optional[int] = t.strides[1]
    else:
        views, step = _per_layer(tensors, "tensors", 5, "[blocks, K/V, H, N, D]")
    name = "tensors" if is_tensor(tensors) or step is not None else views[0].name
    t = views[0]
    (blocks, kvf, heads, tokens, dim), (bs, kvs, hs, ns, ds) = t.shape, t.strides
    want = 1 if kind == ModelKind.MLA else 2
    if kvf != want:
        raise argument_error(name, f"has {kvf} entries on the K/V axis (TensorRT-LLM's kvFactor), an {kind.name} pool has {want}")
    axes = {"B": ("blocks", blocks, bs), "KV": ("K/V", kvf, kvs), "H": ("H", heads, hs), "N": ("N", tokens, ns), "D": ("D", dim, ds)}
    if step is not None:
        axes["L"] = ("L", len(views), step)
    elif len(views) > 1:
        raise argument_error("tensors", "the layers' slices do not lie evenly apart, but TensorRT-LLM's blocks hold every layer")
    order = ["B", "L", "KV", "H", "N", "D"]
    check_nesting(name, "[blocks, L, K/V, H, N, D]", [axes[a] for a in order if a in axes], t.itemsize, "trtllm")
    return EnginePool(
        label=name,
        views=views,
        k=[x.address for x in views],
        v=None,
        v_offset=kvs if want == 2 else 0,
        page_stride=_stride(blocks, bs),
        token_stride=_stride(tokens, ns),
        head_stride=_stride(heads, hs),
        layer_stride=step,
        blocks=blocks,
        page_size=tokens,
        local_heads=heads,
        head_dim=dim,
        blocks_axis="axis blocks",
        token_axis="axis N",
        heads_axis="axis H",
        head_axis="axis D",
    )
