"""What the scheduler hands the workers each step: loads to start (decode), finished requests to
hold for their decodes (prefill), releases and aborts."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class _Recv:
    """Decode: a request whose prompt KV comes from a prefill instance."""

    req_id: str
    block_ids: list
    prefix_tokens: int
    num_tokens: int
    bootstrap: str
    remote_request_id: str
    remote_tp_size: int
    remote_block_size: int
    error: str = ""  # the scheduler could not set the load up: it fails at once


@dataclass
class _Send:
    """Prefill: a finished request whose blocks are held until its decode ranks are served."""

    req_id: str
    block_ids: list
    num_tokens: int


class KvstageConnectorMetadata(KVConnectorMetadata):
    """Scheduler → workers, one per step."""

    def __init__(self) -> None:
        self.recv: dict = {}  # decode: req_id -> _Recv
        self.send: dict = {}  # prefill: req_id -> _Send
        self.release: list = []  # decode: (bootstrap, remote_request_id, remote_tp_size)
        self.aborted: set = set()  # prefill: requests that finished without being held
        self.idle: bool = False  # nothing scheduled this step
