"""kvstage as an sglang PD-disaggregation transfer backend: the four classes sglang's
``get_kv_class`` answers for it (as each of sglang's backends has a ``conn`` module).

sglang's schedulers drive four classes per backend: a manager per rank, a sender per prefill
request, a receiver per decode request and one bootstrap server per prefill server. Here:

* the bootstrap server is sglang's own HTTP registry (:class:`CommonKVBootstrapServer`); every
  prefill rank registers its address there exactly as the built-in backends do (``PUT /route``)
  and decode ranks look it up the same way (``GET /route``) (:mod:`.bootstrap`);
* the manager owns one :class:`kvstage.Engine` per rank with the rank's KV pool, metadata buffers
  (aux rows) and state pools (Mamba conv/SSM) registered from sglang's ``KVArgs``
  (:mod:`.manager`, :mod:`.pools`);
* the receiver (decode) opens the request's kvstage room with its KV pages, ``aux_index`` and
  ``state_indices`` and hands the room id, the room's key and its chunk grid to the prefill ranks
  in its metadata message (``send_metadata``; :mod:`.receiver`, :mod:`.messages`,
  :mod:`.channels`), which each prefill rank collects (:mod:`.prefill_rooms`);
* the sender (prefill) turns ``send(kv_indices, ...)`` into the transfers of the decode's chunk
  grid (``get_max_transfer_tokens`` returns it); the last carries the request's parts
  (:mod:`.sender`).

``poll()`` maps kvstage operations and room events onto ``KVPoll``; ``failure_exception()``
raises :class:`KvstageTransferError` (an sglang ``KVTransferError``) with kvstage's message and
the request's trace id (:mod:`.status`).
"""

from .bootstrap import KvstageKVBootstrapServer
from .manager import KvstageKVManager
from .receiver import KvstageKVReceiver
from .sender import KvstageKVSender
from .status import KvstageTransferError

__all__ = ["KvstageKVManager", "KvstageKVSender", "KvstageKVReceiver", "KvstageKVBootstrapServer", "KvstageTransferError"]
