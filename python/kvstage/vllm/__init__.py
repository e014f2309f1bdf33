"""kvstage as a vLLM KV connector (``KVConnectorBase_V1``).

vLLM loads it by module path::

    --kv-transfer-config '{"kv_connector": "KvstageConnector",
                           "kv_connector_module_path": "kvstage.vllm",
                           "kv_role": "kv_producer"}'            # the prefill; the decode: kv_consumer

See "Use with vLLM" in the kvstage README for the two commands, the proxy
(``python -m kvstage.vllm.proxy``) and every option. The connector imports vLLM (and torch) when
it is first named here; the rest of kvstage never does.
"""

__all__ = ["KvstageConnector", "KvstageConnectorMetadata"]


def __getattr__(name):
    if name in __all__:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
