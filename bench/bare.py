"""A bare aiohttp pass-through proxy: the baseline tollgate is measured against."""

from __future__ import annotations

import sys

import aiohttp
from aiohttp import web

KEY: web.AppKey[aiohttp.ClientSession] = web.AppKey("session", aiohttp.ClientSession)


async def proxy(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    async with request.app[KEY].post(request.app["upstream"] + request.path, data=body,
                                     headers={"Content-Type": "application/json"}) as up:
        resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.headers["Content-Type"]})
        await resp.prepare(request)
        async for chunk in up.content.iter_any():
            await resp.write(chunk)
        await resp.write_eof()
        return resp


async def session_ctx(app: web.Application):  # type: ignore[no-untyped-def]
    app[KEY] = aiohttp.ClientSession()
    yield
    await app[KEY].close()


def main() -> None:
    app = web.Application()
    app["upstream"] = f"http://127.0.0.1:{sys.argv[2]}"
    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/chat/completions", proxy)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)


if __name__ == "__main__":
    main()
