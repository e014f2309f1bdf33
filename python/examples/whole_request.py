"""A whole sglang-shaped request in one kvstage room: paged KV, the metadata rows of sglang's
``MetadataBuffers`` (output ids, cached-token counts, logprobs, top logprobs, the draft model's
hidden state) and a Mamba state pool (conv and temporal SSM state per Mamba layer), from prefill
TP 2 to decode TP 1, both sides in this process on 127.0.0.1 (in a deployment each rank is its own
process and the room id, key and page lists travel in your bootstrap).

Run: ``KVSTAGE_LIBRARY=/path/to/libkvstage.so python3 python/examples/whole_request.py``.
"""

import numpy as np

import kvstage
from kvstage import AuxBuffer, PoolSpan, RequestParts, StateComponent

# The model: 4 layers, attention on 1 and 3 (KV), Mamba on 0 and 2 (state). 8 KV heads of 64, bf16.
ATTN_LAYERS, MAMBA_LAYERS = [1, 3], [0, 2]
KV_HEADS, HEAD_DIM, PAGE, PAGES = 8, 64, 16, 64
MAX_REQS = 8                                 # rows of each metadata buffer, slots of the Mamba pool
CONV_KERNEL, KEY_DIM, VALUE_DIM = 4, 256, 512  # conv state: [key | key | value] x (kernel - 1)
SSM_HEADS, SSM_HEAD_DIM, SSM_STATE = 16, 32, 16
HIDDEN, TOP_K = 1024, 8


def rank_memory(tp: int, rank: int):
    """One rank's KV pool, metadata buffers and Mamba pool (numpy), shaped as sglang holds them."""
    kv = np.zeros((2, len(ATTN_LAYERS), PAGES * PAGE, KV_HEADS // tp, HEAD_DIM), dtype=np.uint16)
    layout = kvstage.KvLayout(head_dim=HEAD_DIM, global_heads=KV_HEADS, page_size=PAGE, tp_rank=rank, tp_size=tp, layer_ids=ATTN_LAYERS,
                              k_buffers=list(kv[0]), v_buffers=list(kv[1]))
    meta = {
        "output_ids": np.zeros((MAX_REQS, 16), dtype=np.int32),         # padded to 64 bytes
        "cached_tokens": np.zeros((MAX_REQS, 16), dtype=np.int32),
        "output_token_logprobs": np.zeros((MAX_REQS, 16), dtype=np.float32),
        "output_top_logprobs": np.zeros((MAX_REQS, TOP_K * 16), dtype=np.float32),
        "output_hidden_states": np.zeros((MAX_REQS, HIDDEN), dtype=np.uint16),  # bf16
    }
    # conv: per layer [slots, conv_dim / tp, kernel - 1]: each TP rank holds its share of the key,
    # key and value groups, each group a contiguous block of (dim / tp) x (kernel - 1) elements.
    conv = [np.zeros((MAX_REQS, (2 * KEY_DIM + VALUE_DIM) // tp, CONV_KERNEL - 1), dtype=np.uint16) for _ in MAMBA_LAYERS]
    ssm = [np.zeros((MAX_REQS, SSM_HEADS // tp, SSM_HEAD_DIM, SSM_STATE), dtype=np.float32) for _ in MAMBA_LAYERS]
    k1 = CONV_KERNEL - 1
    components = [AuxBuffer(name, buf, buf[0].nbytes, MAX_REQS) for name, buf in meta.items()]
    components += [
        StateComponent("conv", conv, MAMBA_LAYERS, MAX_REQS, [KEY_DIM * k1, KEY_DIM * k1, VALUE_DIM * k1], dtype_bytes=2),
        StateComponent("ssm", ssm, MAMBA_LAYERS, MAX_REQS, [SSM_HEADS * SSM_HEAD_DIM * SSM_STATE], dtype_bytes=4),
    ]
    return kv, layout, meta, conv, ssm, components


def main() -> None:
    rng = np.random.default_rng(0)
    tokens = 200
    dkv, dlayout, dmeta, dconv, dssm, dcomps = rank_memory(1, 0)
    decode = kvstage.Engine(transport="tcp")
    decode.register_pool(dlayout)
    decode.register_components(dcomps)
    decode.register_staging(16 << 20)
    # Decode: the request's KV pages, its metadata row and its Mamba slot on this rank.
    dst_pages = list(rng.permutation(PAGES)[: -(-tokens // PAGE)])
    room = decode.open_room(1, dst_pages, chunk_tokens=128, parts=RequestParts(aux_row=5, state_slots=[2, 2]))

    prefills = []
    src_pages = list(rng.permutation(PAGES)[: -(-tokens // PAGE)])
    for rank in range(2):
        kv, layout, meta, conv, ssm, comps = rank_memory(2, rank)
        for arrays in (list(meta.values()), conv, ssm, [kv]):
            for a in arrays:
                a.view(np.uint8)[...] = rng.integers(0, 256, a.view(np.uint8).shape, dtype=np.uint8)
        for name in meta:  # every prefill rank holds the same metadata row (as sglang writes it)
            meta[name][0] = prefills[0][1][name][0] if prefills else meta[name][0]
        engine = kvstage.Engine(transport="tcp")
        engine.register_pool(layout)
        engine.register_components(comps)
        session = engine.connect(decode.listen_address, f"prefill-{rank}")
        prefills.append((engine, meta, conv, ssm, kv, session))

    for k in range(room.num_chunks):
        pages = src_pages[k * 8 : (k + 1) * 8]
        n = min(128, tokens - 128 * k)
        last = k == room.num_chunks - 1
        for _engine, _meta, _conv, _ssm, _kv, session in prefills:
            # The prefill side's own row (0) and slot (3), with the room's last chunk.
            parts = RequestParts(aux_row=0, state_slots=[3, 3]) if last else None
            session.transfer(1, k, pages, room_key=room.key, num_tokens=n, parts=parts)
    room.wait(20000)

    as_bytes = lambda a: np.ascontiguousarray(a).view(np.uint8)  # noqa: E731 (random bytes include NaNs)
    for name in dmeta:
        assert np.array_equal(as_bytes(dmeta[name][5]), as_bytes(prefills[0][1][name][0])), name
    for i in range(len(MAMBA_LAYERS)):
        # Decode (TP 1) conv slot = per group, prefill rank 0's block then rank 1's.
        parts, at = [], 0
        for dim in (KEY_DIM, KEY_DIM, VALUE_DIM):
            parts += [prefills[r][2][i][3, at : at + dim // 2] for r in range(2)]
            at += dim // 2
        assert np.array_equal(as_bytes(dconv[i][2]), as_bytes(np.concatenate(parts))), f"conv layer {MAMBA_LAYERS[i]}"
        ssm = np.concatenate([prefills[r][3][i][3] for r in range(2)])
        assert np.array_equal(as_bytes(dssm[i][2]), as_bytes(ssm)), f"ssm layer {MAMBA_LAYERS[i]}"
    print(f"room 1: {tokens} tokens of KV, {len(dmeta)} metadata rows, conv and SSM state of "
          f"{len(MAMBA_LAYERS)} Mamba layers, in {room.num_chunks} chunks: every byte in place")
    for engine, *_rest, session in prefills:
        session.close()
        engine.close()
    decode.close()


if __name__ == "__main__":
    main()
