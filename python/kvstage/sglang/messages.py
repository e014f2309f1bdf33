"""The messages between the two sides (msgpack): the decode rank's metadata for one request
(:class:`RoomMetadata`, sglang's pre-allocation message, kvstage edition) and a prefill rank's
failure notice back (:class:`RoomFailure`); their encoding and what a prefill rank checks of a
metadata message before it uses it."""

from __future__ import annotations

from typing import List, Tuple

import msgspec

import kvstage


class DecodeLayout(msgspec.Struct):
    """A decode rank's KV shape (what the prefill side pairs with; no addresses)."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    layer_ids: List[int]
    global_heads: int
    head_dim: int
    dtype_bytes: int
    page_size: int
    model: str

    @classmethod
    def of(cls, layout: kvstage.KvLayout, is_mla: bool) -> "DecodeLayout":
        L = layout
        return cls(
            tp_rank=L.tp_rank, tp_size=L.tp_size, pp_rank=L.pp_rank, pp_size=L.pp_size,
            layer_ids=list(L.layer_ids) if L.layer_ids is not None else [],
            global_heads=L.global_heads, head_dim=L.head_dim, dtype_bytes=L.dtype_bytes,
            page_size=L.page_size, model="mla" if is_mla else "mha",
        )

    def stage(self) -> kvstage.KvLayout:
        """The decode stage's shape-only layout, for kvstage's pairing helpers."""
        return kvstage.KvLayout(
            head_dim=self.head_dim, global_heads=self.global_heads, page_size=self.page_size, dtype_bytes=self.dtype_bytes,
            model=self.model, tp_rank=0, tp_size=self.tp_size, pp_rank=self.pp_rank, pp_size=self.pp_size,
            layer_ids=self.layer_ids, capacity_pages=1,
        )


class RoomMetadata(msgspec.Struct):
    """sglang's pre-allocation message, kvstage edition: one per (decode rank, prefill rank)."""

    room: int
    room_key: int
    address: str  # the decode rank's kvstage engine
    decode: DecodeLayout
    chunk_tokens: int
    num_chunks: int
    num_pages: int
    prefix_tokens: int
    trace_id: str
    notify: str = ""  # the decode rank's failure socket (zmq PULL): "tcp://ip:port"
    # Set when the decode rank could not open the room (its reason; no key, no grid): the prefill
    # ranks fail the request at once instead of waiting for metadata until their bootstrap timeout.
    failed: str = ""


class RoomFailure(msgspec.Struct):
    """prefill -> decode: this rank cannot serve (or gave up on) the decode rank's opening."""

    room: int
    room_key: int
    reason: str


def grid_of(meta: RoomMetadata) -> Tuple[int, int, int, int]:
    return (meta.chunk_tokens, meta.num_chunks, meta.num_pages, meta.prefix_tokens)


def check_metadata(meta: RoomMetadata, prefill_page: int) -> None:
    """A message's decode rank and grid are ones this rank can serve (refused else: a peer's bug, a
    stray sender, or a decode-side cached prefix that ends inside a prefill page, which sglang's
    ``kv_to_page_indices`` cannot start a send at). The grid must be the one kvstage gives a room
    of ``num_pages`` pages: chunks of whole decode pages, as many as cover the pages."""
    d = meta.decode
    if not (0 <= d.tp_rank < d.tp_size and 0 <= d.pp_rank < d.pp_size):
        raise ValueError(f"room {meta.room}: decode tp_rank {d.tp_rank} of tp_size {d.tp_size}, pp_rank {d.pp_rank} of pp_size {d.pp_size}: out of range")
    if min(meta.chunk_tokens, meta.num_chunks, meta.num_pages, d.page_size) <= 0 or meta.prefix_tokens < 0:
        raise ValueError(f"room {meta.room}: grid {grid_of(meta)} (chunk tokens, chunks, pages, prefix) out of range")
    if meta.chunk_tokens % d.page_size:
        raise ValueError(f"room {meta.room}: chunk_tokens {meta.chunk_tokens} is not whole decode pages of {d.page_size} tokens")
    chunks = -(-meta.num_pages * d.page_size // meta.chunk_tokens)
    if meta.num_chunks != chunks:
        raise ValueError(
            f"room {meta.room}: num_chunks {meta.num_chunks} does not match num_pages {meta.num_pages} of {d.page_size} tokens "
            f"in chunks of {meta.chunk_tokens} tokens ({chunks} chunks)"
        )
    if meta.prefix_tokens % d.page_size or meta.prefix_tokens % prefill_page:
        raise ValueError(
            f"room {meta.room}: a decode-side cached prefix of {meta.prefix_tokens} tokens is not on a page of "
            f"both sides (decode {d.page_size}, prefill {prefill_page})"
        )


encode = msgspec.msgpack.Encoder().encode
decode_metadata = msgspec.msgpack.Decoder(RoomMetadata).decode
decode_failure = msgspec.msgpack.Decoder(RoomFailure).decode
