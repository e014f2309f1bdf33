"""The geometry helpers against hand-written expectations."""

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


def test_counts_and_grid(lib):
    assert kvstage.writers_per_chunk(4, 2) == 2
    assert kvstage.writers_per_chunk(2, 4) == 1
    assert kvstage.writers_per_chunk(4, 2, 2, 1) == 4
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
