"""Whole requests from Python: KV plus sglang-shaped metadata rows (three aux buffers), a Mamba
conv state of key/key/value groups and an SSM state (numpy arrays per layer, sharded by TP), and a
sliding-window pool, moved in one room from prefill TP 2 to decode TP 1 (two prefill engines, one
decode engine, all in this process on 127.0.0.1). The decode conv slot is checked against the
prefill slots re-assembled element by element (each rank's share of each group), the aux rows
against the prefill row, the window against the prefill window's tokens."""

import numpy as np
import pytest

import kvref
import kvstage
from kvstage import AuxBuffer, PoolComponent, PoolSpan, RequestParts, StateComponent

MODEL = kvref.Model(layers=2, heads=4, head_dim=8, dtype_bytes=2, page_size=16)
GROUPS = [8, 8, 16]  # conv state: key, key, value (global elements per row)
OUTER = 3
SLOTS, WINDOW_PAGES, WINDOW_PAGE = 4, 8, 8


def components(tp: int, seed: int):
    """Numpy-backed components of one rank of ``tp``, filled with random bytes when ``seed``."""
    rng = np.random.default_rng(seed)
    local = sum(g // tp for g in GROUPS)
    heads = MODEL.heads // tp
    arrays = {
        "output_ids": np.zeros((SLOTS, 16), dtype=np.int32),
        "logprobs": np.zeros((SLOTS, 128), dtype=np.float32),
        "hidden": np.zeros((SLOTS, 100), dtype=np.float16),
        "conv": [np.zeros((SLOTS, OUTER, local), dtype=np.float16) for _ in range(2)],
        "ssm": [np.zeros((SLOTS, 2, 32 // tp), dtype=np.float32) for _ in range(2)],
        "swa": [np.zeros((WINDOW_PAGES * WINDOW_PAGE, heads, 4), dtype=np.float32) for _ in range(2)],
    }
    if seed:
        for v in arrays.values():
            for a in v if isinstance(v, list) else [v]:
                a.view(np.uint8)[...] = rng.integers(1, 255, a.view(np.uint8).shape, dtype=np.uint8)
    comps = [
        AuxBuffer("output_ids", arrays["output_ids"], 64, SLOTS),
        StateComponent("conv", arrays["conv"], [0, 1], SLOTS, GROUPS, outer=OUTER, dtype_bytes=2),
        AuxBuffer("logprobs", arrays["logprobs"], 512, SLOTS),
        StateComponent("ssm", arrays["ssm"], [0, 1], SLOTS, [32], outer=2, dtype_bytes=4),
        PoolComponent("swa", arrays["swa"], [0, 1], WINDOW_PAGES, WINDOW_PAGE, 16, head_sliced=True),
        AuxBuffer("hidden", arrays["hidden"], 200, SLOTS),
    ]
    return arrays, comps


def same(got, want) -> bool:
    """Byte equality (random bytes make NaNs, which compare unequal as floats)."""
    return np.array_equal(np.ascontiguousarray(got).view(np.uint8), np.ascontiguousarray(want).view(np.uint8))


def test_a_whole_request_from_two_prefill_ranks(lib):
    total, chunk_tokens, window = 80, 32, 20
    dpool, dlayout = kvref.make_pool(MODEL, 0, 1, 8)
    darrays, dcomps = components(1, 0)
    decode = kvstage.Engine(transport="tcp")
    decode.register_pool(dlayout)
    decode.register_components(dcomps)
    decode.register_staging(1 << 20)
    # Decode names row 3, conv slot 1, ssm slot 2, the window in pages 5, 2, 7 (from slot 0).
    dparts = RequestParts(aux_row=3, state_slots=[1, 2], pool_spans=[PoolSpan([5, 2, 7], window)])
    dst_pages = [4, 1, 6, 0, 2]
    room = decode.open_room(9, dst_pages, chunk_tokens=chunk_tokens, parts=dparts)
    prefills, keep = [], []
    # The window is the request's last 20 tokens: 4 slots into the prefill window's first page.
    pparts = RequestParts(aux_row=0, state_slots=[2, 3], pool_spans=[PoolSpan([6, 3, 1], window, first_token=4)])
    try:
        for r in range(2):
            ppool, playout = kvref.make_pool(MODEL, r, 2, 8)
            kvref.fill_random(ppool, 5)
            arrays, comps = components(2, 100 + r)
            # Every prefill rank writes the same metadata rows (as sglang does).
            for name in ("output_ids", "logprobs", "hidden"):
                arrays[name][0] = components(2, 7)[0][name][0]
            engine = kvstage.Engine(transport="tcp")
            engine.register_pool(playout)
            engine.register_components(comps)
            prefills.append((engine, engine.connect(decode.listen_address, f"p{r}"), arrays, ppool))
            keep.append(comps)
        src_pages = [3, 0, 5, 1, 7]
        for k in reversed(range(3)):
            pages = src_pages[2 * k : 2 * k + 2]
            for _engine, session, _arrays, _pool in prefills:
                status = session.transfer(9, k, pages, 20000, room_key=room.key, num_tokens=min(32, total - 32 * k), parts=pparts if k == 2 else None)
                assert status == kvstage.Status.OK
        room.wait(20000)

        for name in ("output_ids", "logprobs", "hidden"):
            assert same(darrays[name][3], prefills[0][2][name][0]), name
            assert not darrays[name][[0, 1, 2]].any(), f"{name}: other rows written"
        for layer in range(2):
            # Decode conv row = per group, prefill rank 0's share then rank 1's.
            want, at = [], 0
            for g in GROUPS:
                share = g // 2
                want += [prefills[r][2]["conv"][layer][2, :, at : at + share] for r in range(2)]
                at += share
            assert same(darrays["conv"][layer][1], np.concatenate(want, axis=1)), f"conv layer {layer}"
            ssm = np.concatenate([prefills[r][2]["ssm"][layer][3] for r in range(2)], axis=1)
            assert same(darrays["ssm"][layer][2], ssm), f"ssm layer {layer}"
            assert not darrays["conv"][layer][[0, 2, 3]].any() and not darrays["ssm"][layer][[0, 1, 3]].any()
            # Window token j: prefill slot (pages, offset 4) of both ranks' heads -> decode slot.
            pslots = kvref.slots([6, 3, 1], WINDOW_PAGE)[4 : 4 + window]
            dslots = kvref.slots([5, 2, 7], WINDOW_PAGE)[:window]
            wswa = np.concatenate([prefills[r][2]["swa"][layer][pslots] for r in range(2)], axis=1)
            assert same(darrays["swa"][layer][dslots], wswa), f"swa layer {layer}"
        # The KV too.
        want = np.concatenate([p[3][:, :, kvref.slots(src_pages, 16)[:total]] for p in prefills], axis=3)
        assert same(dpool[:, :, kvref.slots(dst_pages, 16)[:total]], want)
    finally:
        for engine, session, _a, _p in prefills:
            session.close()
            engine.close()
        decode.close()


def test_bad_parts_name_the_field(lib):
    _, dlayout = kvref.make_pool(MODEL, 0, 1, 8)
    _arrays, comps = components(1, 0)
    decode = kvstage.Engine(transport="tcp")
    try:
        with pytest.raises(kvstage.ArgumentError, match="register the KV pool"):
            decode.register_components(comps)
        decode.register_pool(dlayout)
        with pytest.raises(kvstage.ArgumentError, match=r"components\[1\].bases.*holds 1 addresses, the component needs 2"):
            decode.register_components([comps[0], StateComponent("conv", comps[1].buffers[:1], [0, 1], SLOTS, GROUPS, outer=OUTER)])
        decode.register_components(comps)
        decode.register_staging(1 << 20)
        with pytest.raises(kvstage.ArgumentError, match=r"`desc->parts.state_slots\[0\]`: 4 is outside state component \"conv\"'s 4 slots"):
            decode.open_room(1, [0], parts=RequestParts(aux_row=0, state_slots=[4, 0], pool_spans=[PoolSpan([0], 8)]))
        with pytest.raises(kvstage.ArgumentError, match=r"num_pool_spans.*0 != 1"):
            decode.open_room(1, [0], parts=RequestParts(aux_row=0, state_slots=[0, 0]))
    finally:
        decode.close()
