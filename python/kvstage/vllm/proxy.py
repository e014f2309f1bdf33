"""A minimal disaggregation proxy for two ``vllm serve`` instances using ``KvstageConnector``.

    python -m kvstage.vllm.proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

For each ``/v1/completions`` or ``/v1/chat/completions`` request: the prefill instance gets it with
``max_tokens`` 1 and ``kv_transfer_params = {"do_remote_decode": true}``; its answer's
``kv_transfer_params`` (the prefill's bootstrap address and request id) go with the original
request to the decode instance, whose answer (streamed or not) is the client's. Several
``--prefill``/``--decode`` URLs are used round robin. Needs ``aiohttp`` (a vLLM dependency).
A prefill or decode that fails or cannot be reached is the client's error (502, naming it); ``n`` above
1 is refused (400: vLLM's n children would each load the one prefill's KV). The decode applies
its ``kv_load_failure_policy`` when the KV cannot be loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys


def make_app(prefills: list, decodes: list, timeout_s: float = 600.0):
    from aiohttp import ClientError, ClientSession, ClientTimeout, web

    pre_urls, dec_urls = itertools.cycle(prefills), itertools.cycle(decodes)
    timeout = ClientTimeout(total=timeout_s)

    async def forward(request: "web.Request") -> "web.StreamResponse":
        body = await request.json()
        path = request.path
        n = body.get("n", 1)
        if n not in (None, 1):
            # vLLM fans n out into n decode requests that would each load the one prefill's KV;
            # the prefill lets it go once it was sent, so all but the first would fail.
            return web.json_response({"error": f"n is {n!r}: the kvstage proxy takes n = 1 only (send n requests instead)"}, status=400)
        first = dict(body)
        first.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        first.pop("stream_options", None)
        if "max_completion_tokens" in first:
            first["max_completion_tokens"] = 1
        async with ClientSession(timeout=timeout) as http:
            pre = next(pre_urls)
            try:
                async with http.post(pre + path, json=first) as r:
                    text = await r.text()
                    if r.status != 200:
                        return web.json_response({"error": f"prefill {pre}: HTTP {r.status}", "prefill": text}, status=502)
            except (ClientError, asyncio.TimeoutError) as e:
                return web.json_response({"error": f"prefill {pre} is not reachable: {type(e).__name__}: {e}"}, status=502)
            params = json.loads(text).get("kv_transfer_params")
            if not params:
                return web.json_response({"error": f"prefill {pre} returned no kv_transfer_params: is it run with KvstageConnector as kv_producer?"}, status=502)
            second = dict(body)
            second["kv_transfer_params"] = params
            dec = next(dec_urls)
            try:
                r = await http.post(dec + path, json=second)
            except (ClientError, asyncio.TimeoutError) as e:
                return web.json_response({"error": f"decode {dec} is not reachable: {type(e).__name__}: {e}"}, status=502)
            async with r:
                out = web.StreamResponse(status=r.status, headers={"Content-Type": r.headers.get("Content-Type", "application/json")})
                await out.prepare(request)
                async for chunk in r.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out

    app = web.Application()
    app.router.add_post("/v1/completions", forward)
    app.router.add_post("/v1/chat/completions", forward)
    return app


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", action="append", required=True, help="a prefill instance's URL (repeat for several)")
    ap.add_argument("--decode", action="append", required=True, help="a decode instance's URL (repeat for several)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    a = ap.parse_args(argv)
    from aiohttp import web

    web.run_app(make_app([u.rstrip("/") for u in a.prefill], [u.rstrip("/") for u in a.decode], a.timeout_s), host=a.host, port=a.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
