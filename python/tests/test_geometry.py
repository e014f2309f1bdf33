"""The geometry helpers against hand-written expectations."""

import numpy as np
import pytest

import kvref
import kvstage


def expected_head_slice(src_tp, dst_tp, src_rank, dst_rank, heads):
    """Global heads each side holds (no replication here), intersected, in local units."""
    src_heads = set(range(src_rank * heads // src_tp, (src_rank + 1) * heads // src_tp))
    dst_heads = set(range(dst_rank * heads // dst_tp, (dst_rank + 1) * heads // dst_tp))
    common = sorted(src_heads & dst_heads)
    if not common:
        return None
    return kvstage.HeadSlice(common[0] - min(src_heads), len(common), common[0] - min(dst_heads))


@pytest.mark.parametrize("src_tp,dst_tp", [(4, 2), (2, 4), (2, 2), (8, 1), (1, 8)])
def test_head_slice(lib, src_tp, dst_tp):
    for rs in range(src_tp):
        for rd in range(dst_tp):
            want = expected_head_slice(src_tp, dst_tp, rs, rd, 8)
            if want is None:
                with pytest.raises(kvstage.ArgumentError):
                    kvstage.head_slice(src_tp, dst_tp, rs, rd, 8)
            else:
                assert kvstage.head_slice(src_tp, dst_tp, rs, rd, 8) == want


def writers_per_chunk(src_tp, dst_tp, src_pp=1, *, heads, model="mha", layers=4):
    """Writers per chunk on decode rank 0 (TP ``dst_tp``, every layer) from a prefill side of
    ``src_pp`` equal pipeline stages of TP ``src_tp``: ``staging_layout(...).num_writers``."""

    def shape(tp, pp_rank, pp, ids):
        return kvstage.KvLayout(model=model, head_dim=16, global_heads=heads, page_size=16, tp_size=tp, pp_rank=pp_rank, pp_size=pp, layer_ids=ids)

    per = layers // src_pp
    stages = [shape(src_tp, j, src_pp, range(j * per, (j + 1) * per)) for j in range(src_pp)]
    layout = kvstage.staging_layout(stages, shape(dst_tp, 0, 1, range(layers)), 16)
    assert layout.num_writers == len(layout.writers)
    return layout.num_writers


def test_counts_and_grid(lib):
    assert writers_per_chunk(4, 2, heads=8) == 2
    assert writers_per_chunk(2, 4, heads=8) == 1
    assert writers_per_chunk(4, 2, 2, heads=8) == 4
    assert writers_per_chunk(8, 2, heads=4) == 2  # prefill replication: one copy
    assert kvstage.grid_tokens(100, 16) == 96
    assert kvstage.grid_tokens(8, 16) == 16
    with pytest.raises(kvstage.ArgumentError, match="page_size"):
        kvstage.grid_tokens(8, 0)


def test_staging_layout(lib):
    m = kvref.Model(layers=3, heads=8, head_dim=16, dtype_bytes=2, page_size=16)
    st = kvstage.staging_layout(m.shape(0, 4), m.shape(1, 2), 64)
    row = 2 * 16 * 2  # two heads per prefill rank
    assert (st.tokens, st.num_heads, st.buffers_per_layer, st.row_bytes) == (64, 2, 2, row)
    assert st.slab_bytes == 64 * row
    assert [w.src_tp_rank for w in st.writers] == [2, 3]
    assert [w.dst_head_start for w in st.writers] == [0, 2]
    assert sum(w.bytes for w in st.writers) == st.total_bytes == 2 * 3 * 2 * 64 * row
    assert st.writers[1].offset == st.writers[0].bytes
    with pytest.raises(kvstage.KVStageError) as info:
        kvstage.staging_layout(m.shape(0, 4), kvref.Model(3, 8, 32, 2, 16).shape(0, 2), 64)
    assert info.value.code < 0


def test_staging_layout_of_tp_sizes_that_do_not_divide(lib):
    # P3 -> D2 with 12 heads: decode rank 0 takes heads 0..4 from prefill rank 0 and 4..6 from
    # prefill rank 1, so its two regions differ in size and the layout-wide row sizes are 0.
    m = kvref.Model(layers=3, heads=12, head_dim=16, dtype_bytes=2, page_size=16)
    st = kvstage.staging_layout(m.shape(0, 3), m.shape(0, 2), 64)
    head = 16 * 2
    assert (st.num_heads, st.row_bytes, st.slab_bytes, st.num_tp_writers) == (0, 0, 0, 2)
    assert [(w.src_tp_rank, w.src_head_start, w.num_heads, w.dst_head_start) for w in st.writers] == [(0, 0, 4, 0), (1, 0, 2, 4)]
    assert [(w.slab_bytes, w.v_slab_bytes) for w in st.writers] == [(64 * 4 * head,) * 2, (64 * 2 * head,) * 2]
    assert [w.bytes for w in st.writers] == [2 * 3 * w.slab_bytes for w in st.writers]
    assert st.writers[1].offset == st.writers[0].bytes and st.total_bytes == 2 * 3 * 64 * 6 * head
    # Decode rank 1 takes heads 6..8 from prefill rank 1 (its local heads 2..4) and 8..12 from 2.
    st = kvstage.staging_layout(m.shape(0, 3), m.shape(1, 2), 64)
    assert [(w.src_tp_rank, w.src_head_start, w.num_heads, w.dst_head_start) for w in st.writers] == [(1, 2, 2, 0), (2, 0, 4, 2)]
    # P6 -> D4: decode rank 0 (heads 0..3) takes 2 heads from prefill rank 0 and 1 from rank 1.
    st = kvstage.staging_layout(m.shape(0, 6), m.shape(0, 4), 64)
    assert st.num_heads == 0 and [w.num_heads for w in st.writers] == [2, 1]
    # Head groups of one size keep the layout-wide sizes (P4 -> D2).
    st = kvstage.staging_layout(m.shape(0, 4), m.shape(0, 2), 64)
    assert (st.num_heads, st.slab_bytes) == (3, 64 * 3 * head) and all(w.slab_bytes == st.slab_bytes for w in st.writers)


def test_staging_layout_sizes_a_whole_request_with_its_parts(lib):
    # Prefill TP 4 -> decode rank 1 of TP 2, 8 heads, 2 layers: a 24-byte metadata row (once), a
    # sharded conv state (3 rows of 8+8+16 bf16 elements: 192 bytes whole, decode rank 1 holds
    # half) on both layers, and a head-sliced extra pool (4 bytes per head per token, 4 local heads
    # on the decode rank, 5 tokens of the request in it) on both layers.
    def layout(tp_rank, tp_size):
        return kvstage.KvLayout(head_dim=16, global_heads=8, page_size=4, tp_rank=tp_rank, tp_size=tp_size, num_layers=2)

    buf = [bytearray(4096), bytearray(4096)]
    components = [
        kvstage.AuxBuffer("meta", bytearray(4096), row_bytes=24, rows=4),
        kvstage.StateComponent("conv", buffers=buf, layer_ids=[0, 1], slots=4, group_dims=[8, 8, 16], outer=3),
        kvstage.PoolComponent("window", buffers=buf, layer_ids=[0, 1], pages=4, page_size=4, unit_bytes=4),
    ]
    kv_only = kvstage.staging_layout(layout(0, 4), layout(1, 2), 16)
    whole = kvstage.staging_layout(layout(0, 4), layout(1, 2), 16, components, pool_tokens=[5])
    assert kv_only.parts_bytes == 0
    assert whole.parts_bytes == 24 + 2 * (192 // 2) + 2 * (4 * 4 * 5)
    assert whole.total_bytes == kv_only.total_bytes + whole.parts_bytes
    assert whole.writers == kv_only.writers
    with pytest.raises(kvstage.ArgumentError, match=r"num_pool_tokens.*0 != 1 POOL"):
        kvstage.staging_layout(layout(0, 4), layout(1, 2), 16, components)


def test_staging_layout_of_uneven_pipeline_stages(lib):
    def stage(pp_rank, pp_size, ids, tp_rank=0, tp=1):
        return kvstage.KvLayout(head_dim=16, global_heads=8, page_size=16, dtype_bytes=2, tp_rank=tp_rank, tp_size=tp,
                                pp_rank=pp_rank, pp_size=pp_size, layer_ids=ids)

    # Prefill stages of 4 and 3 layers into one decode rank holding all 7.
    st = kvstage.staging_layout([stage(0, 2, [0, 1, 2, 3]), stage(1, 2, [4, 5, 6])], stage(0, 1, range(7)), 16)
    slab = 16 * 8 * 16 * 2
    assert [(w.src_pp_rank, w.layers, w.bytes) for w in st.writers] == [(0, 4, 4 * 2 * slab), (1, 3, 3 * 2 * slab)]
    assert st.total_bytes == 7 * 2 * slab and st.num_tp_writers == 1
    # A decode layer no prefill stage holds is refused.
    with pytest.raises(kvstage.GeometryError, match="do not cover"):
        kvstage.staging_layout([stage(0, 1, [0, 1, 2])], stage(0, 1, range(4)), 16)


def test_mla_writers_per_chunk(lib):
    assert writers_per_chunk(8, 2, 2, heads=1, model="mla") == 2
    assert writers_per_chunk(8, 2, 2, heads=8) == 8
    with pytest.raises(kvstage.ArgumentError, match="model"):
        kvstage.KvLayout(model="gqa", head_dim=16, num_layers=1)


def _stage(tp_size, pp_rank, pp_size, layer_ids, tp_rank=0):
    return kvstage.KvLayout(
        head_dim=16, global_heads=8, page_size=4, tp_rank=tp_rank, tp_size=tp_size,
        pp_rank=pp_rank, pp_size=pp_size, layer_ids=layer_ids,
    )


def test_pairing_uneven_stages(lib):
    # Prefill stages of 3, 2 and 2 of 7 layers (TP 2) into decode stages of 4 and 3 layers (TP 1).
    prefill = [_stage(2, 0, 3, [0, 1, 2]), _stage(2, 1, 3, [3, 4]), _stage(2, 2, 3, [5, 6])]
    decode = [_stage(1, 0, 2, [0, 1, 2, 3]), _stage(1, 1, 2, [4, 5, 6])]
    assert kvstage.pairing_decode_ranks(_stage(2, 1, 3, [3, 4], tp_rank=1), decode) == [(0, 0), (0, 1)]
    assert kvstage.pairing_decode_ranks(prefill[2], decode) == [(0, 1)]
    assert kvstage.pairing_prefill_ranks(decode[0], prefill) == [(0, 0), (1, 0), (0, 1), (1, 1)]
    # Every pair one side lists, the other side lists too.
    forward = {
        (rs, sp, rd, dp)
        for sp, s in enumerate(prefill)
        for rs in range(2)
        for rd, dp in kvstage.pairing_decode_ranks(_stage(2, sp, 3, s.layer_ids, tp_rank=rs), decode)
    }
    backward = {(rs, sp, 0, dp) for dp, d in enumerate(decode) for rs, sp in kvstage.pairing_prefill_ranks(d, prefill)}
    assert forward == backward
    with pytest.raises(kvstage.ArgumentError, match=r"prefill_stages\[1\].*holds layer 2, which stage 0 holds too"):
        kvstage.pairing_prefill_ranks(decode[0], [prefill[0], _stage(2, 1, 3, [2, 3]), prefill[2]])


def test_pairing_answers_for_whole_requests_with_sharded_state(lib):
    # One KV head, prefill TP 4 -> decode TP 2: prefill ranks 1 and 3 replicate the head ranks 0
    # and 2 send, so for the KV alone they open no session; a sharded conv state (groups of 8, 8,
    # 16 elements) has a share on every prefill rank, and each must reach its decode rank.
    def layout(tp_rank, tp_size):
        return kvstage.KvLayout(head_dim=16, global_heads=1, page_size=4, tp_rank=tp_rank, tp_size=tp_size, num_layers=2)

    conv = kvstage.StateComponent("conv", buffers=[bytearray(64), bytearray(64)], layer_ids=[0, 1], slots=4, group_dims=[8, 8, 16])
    whole = conv._replace(name="whole", replicated=True)
    decode = [layout(0, 2)]
    assert kvstage.pairing_decode_ranks(layout(1, 4), decode) == []
    assert kvstage.pairing_decode_ranks(layout(1, 4), decode, [whole]) == []
    assert kvstage.pairing_decode_ranks(layout(1, 4), decode, [conv]) == [(0, 0)]
    assert kvstage.pairing_decode_ranks(layout(3, 4), decode, [whole, conv]) == [(1, 0)]
    assert kvstage.pairing_prefill_ranks(layout(1, 2), [layout(0, 4)]) == [(2, 0)]
    assert kvstage.pairing_prefill_ranks(layout(1, 2), [layout(0, 4)], [conv]) == [(2, 0), (3, 0)]


def _shard(item, groups, tp, rank):
    """Rank `rank` of `tp`'s slot of a sharded state item (numpy): its share of every group of every row."""
    parts, start = [], 0
    for g in groups:
        share = g // tp
        parts.append(item[:, start + rank * share : start + (rank + 1) * share])
        start += g
    return np.ascontiguousarray(np.concatenate(parts, axis=1))


@pytest.mark.parametrize("src_tp,dst_tp", [(2, 1), (1, 2), (4, 2), (2, 4), (8, 8), (16, 1), (1, 16)])
def test_state_slice_assembles_and_cuts_conv_state_slots(lib, src_tp, dst_tp):
    """A Mamba-like conv state (rows of key, key, value groups, each sharded on its own): every
    decode slot assembled from the prefill slots by the plan equals numpy's own shard of it."""
    groups, outer = [16, 16, 32], 3
    rng = np.random.default_rng(src_tp * 100 + dst_tp)
    item = rng.integers(0, 1 << 16, size=(outer, sum(groups)), dtype=np.uint16)
    prefill = [_shard(item, groups, src_tp, r).view(np.uint8).ravel() for r in range(src_tp)]
    for rd in range(dst_tp):
        want = _shard(item, groups, dst_tp, rd).view(np.uint8).ravel()
        got = np.zeros_like(want)
        for rs in range(src_tp):
            for r in kvstage.state_slice(groups, src_tp, dst_tp, rs, rd, outer=outer, dtype_bytes=2):
                got[r.dst_offset : r.dst_offset + r.length] = prefill[rs][r.src_offset : r.src_offset + r.length]
        assert np.array_equal(got, want), f"decode rank {rd}"


def test_state_slice_replicated_and_errors(lib):
    # Decode rank 1 of 2 is fed by prefill ranks 2 and 3 of 4: the first of them sends the replica.
    ranges = kvstage.state_slice([128], 4, 2, 2, 1, outer=2, dtype_bytes=4, replicated=True)
    assert ranges == [kvstage.ByteRange(0, 0, 2 * 128 * 4)]
    assert kvstage.state_slice([128], 4, 2, 1, 1, outer=2, dtype_bytes=4, replicated=True) == []
    with pytest.raises(kvstage.ArgumentError, match=r"group_dims\[1\]"):
        kvstage.state_slice([16, 6], 4, 2, 0, 0)
