"""One real vLLM engine (offline ``LLM``) driven over pipes by the tests.

    python engine_proc.py CONFIG_JSON RESPONSE_FD

CONFIG_JSON: {"model", "block_size", "kv_bytes", "kv_transfer_config" (a dict or null), "seed"}.
Commands arrive on stdin, one JSON object a line; answers go to RESPONSE_FD (vLLM logs on stdout
and stderr). Commands:

    {"op": "generate", "prompts": [[ids]], "max_tokens": n, "params": [dict|null]}
        -> {"ok": true, "outputs": [{"tokens", "finish_reason", "kv_transfer_params"}], "s": secs}
    {"op": "quit"}
"""

import json
import os
import sys
import time


def main() -> int:
    cfg = json.loads(sys.argv[1])
    out = os.fdopen(int(sys.argv[2]), "w", buffering=1)

    from vllm import LLM, SamplingParams

    kwargs = dict(
        model=cfg["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        block_size=cfg["block_size"],
        kv_cache_memory_bytes=cfg["kv_bytes"],
        max_model_len=cfg.get("max_model_len", 1024),
        max_num_seqs=cfg.get("max_num_seqs", 32),
        seed=cfg.get("seed", 0),
        enable_prefix_caching=True,
        disable_log_stats=not cfg.get("log_stats", False),  # the benchmark reads connectors' stats
        tensor_parallel_size=cfg.get("tp", 1),
    )
    if cfg.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = cfg["kv_transfer_config"]
    t0 = time.time()
    llm = LLM(**kwargs)
    print(json.dumps({"ok": True, "ready": True, "s": time.time() - t0, "pid": os.getpid()}), file=out)

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] != "generate":
            print(json.dumps({"ok": False, "error": f"unknown op {cmd['op']}"}), file=out)
            continue
        t0 = time.time()
        params = cmd.get("params") or [None] * len(cmd["prompts"])
        sps = []
        for p in params:
            extra = {"kv_transfer_params": p} if p is not None else None
            sps.append(SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"], ignore_eos=True, detokenize=False, extra_args=extra))
        try:
            res = llm.generate([{"prompt_token_ids": ids} for ids in cmd["prompts"]], sps, use_tqdm=False)
            outputs = [
                {
                    "tokens": list(r.outputs[0].token_ids),
                    "finish_reason": r.outputs[0].finish_reason,
                    "kv_transfer_params": r.kv_transfer_params,
                }
                for r in res
            ]
            print(json.dumps({"ok": True, "outputs": outputs, "s": time.time() - t0}), file=out)
        except Exception as e:  # the test decides
            print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}", "s": time.time() - t0}), file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
