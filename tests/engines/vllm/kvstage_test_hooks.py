"""The connector's test hooks (``kv_connector_extra_config["hooks"]``), run inside the engines.

- on_arrival (decode): while the file $KVSTAGE_TEST_FLIP_FILE exists, flip one byte of the
  request's first received block (layer 0, head 0, token 0: the high byte of K's first element)
  after its KV arrived, and delete the file (one request only).
- before_send (prefill): while the file $KVSTAGE_TEST_STALL_FILE exists, stall the send (the
  test kills the prefill meanwhile); at most 120 s. It writes $KVSTAGE_TEST_STALL_FILE.entered
  first, so the test knows the send reached it.
- after_chunk (prefill): while the file $KVSTAGE_TEST_MIDSTALL_FILE exists, stall after the first
  of a room's several chunks went out (the test kills the prefill mid-transfer); at most 120 s.
  It writes $KVSTAGE_TEST_MIDSTALL_FILE.entered first ("REQUEST chunk 0 of N sent").
"""

import ctypes
import os
import time


def on_arrival(request_id, tensors, block_ids, layout):
    path = os.environ.get("KVSTAGE_TEST_FLIP_FILE")
    if not path or not os.path.exists(path):
        return
    # Element 0 of (block, head 0, token 0) of layer 0; float32 little-endian: byte 3 holds the
    # sign and the high exponent bits.
    offset = block_ids[0] * layout.page_stride + (layout.dtype_bytes - 1)
    byte = ctypes.c_uint8.from_address(tensors[0].data_ptr() + offset)
    byte.value ^= 0x40
    os.unlink(path)
    with open(path + ".done", "w") as f:
        f.write(f"{request_id} block {block_ids[0]} byte {offset}\n")


def _stall(path, marker):
    """While the file `path` exists (at most 120 s): first `marker` into `path`.entered, renamed
    into place whole (the test reads it once it exists and acts on it)."""
    if not path or not os.path.exists(path):
        return
    with open(path + ".tmp", "w") as f:
        f.write(marker + "\n")
    os.replace(path + ".tmp", path + ".entered")
    t0 = time.monotonic()
    while os.path.exists(path) and time.monotonic() - t0 < 120:
        time.sleep(0.1)


def before_send(request_id, message):
    _stall(os.environ.get("KVSTAGE_TEST_STALL_FILE"), request_id)


def after_chunk(request_id, chunk, num_chunks):
    if chunk == 0 and num_chunks >= 2:
        _stall(os.environ.get("KVSTAGE_TEST_MIDSTALL_FILE"), f"{request_id} chunk 0 of {num_chunks} sent")
