#!/usr/bin/env python3
"""Micro-benchmark: what libdsec adds to one exec("true").

Measures, in the same run against the same sandbox, the p50 latency of
  sdk: sb.exec(["true"]) through libdsec's AsyncClient, and
  raw: the same Exec RPC as one hand-written HTTP/1.1 request on a kept-alive
       socket (envelope in, envelopes out, nothing else),
and prints both, their difference in ms, and the ratio sdk/raw.

    python3 sdk/python/bench_overhead.py --addr 127.0.0.1:8675 --env busybox:test [-n 200]

With --sandbox ID it uses that sandbox instead of making (and deleting) one.
"""

import argparse
import asyncio
import json
import os
import socket
import statistics
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import libdsec  # noqa: E402


class RawConn:
    """The least an Exec call needs: one socket, one request, read to the end message."""

    def __init__(self, addr):
        kind, where = libdsec.resolve_addr(addr)
        if kind == "unix":
            self.s = socket.socket(socket.AF_UNIX)
            self.s.connect(where)
        else:
            self.s = socket.create_connection(where)
            self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.f = self.s.makefile("rb")

    def exec(self, sandbox_id):
        payload = json.dumps({"sandboxId": sandbox_id, "argv": ["true"]}).encode()
        body = struct.pack(">BI", 0, len(payload)) + payload
        head = ("POST /dsec.v1.SandboxService/Exec HTTP/1.1\r\nHost: dsecd\r\n"
                "Content-Type: application/connect+json\r\nConnect-Protocol-Version: 1\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        self.s.sendall(head + body)
        status = self.f.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"raw exec: {status!r}")
        chunked = False
        while True:
            line = self.f.readline()
            if line in (b"\r\n", b""):
                break
            if line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower():
                chunked = True
        if not chunked:
            raise RuntimeError("raw exec: expected a chunked stream")
        buf = b""
        while True:
            size = int(self.f.readline().split(b";")[0], 16)
            if size == 0:
                self.f.readline()
                return
            buf += self.f.read(size + 2)[:-2]
            while len(buf) >= 5:
                flags, n = struct.unpack(">BI", buf[:5])
                if len(buf) < 5 + n:
                    break
                buf = buf[5 + n:]  # the end message (flag 0x02) is followed by the last chunk


def p50(xs):
    return statistics.median(xs) * 1000


async def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--addr", default=None, help="daemon address (default $DSEC_ADDR or the local socket)")
    ap.add_argument("--env", default="busybox:test", help="environment of the sandbox to make")
    ap.add_argument("--sandbox", default=None, help="use this sandbox instead of making one")
    ap.add_argument("-n", type=int, default=200, help="calls per side")
    args = ap.parse_args()

    async with libdsec.AsyncClient(args.addr) as c:
        sb = c.sandbox(args.sandbox) if args.sandbox else await c.create(args.env, labels={"bench": "overhead"})
        try:
            raw = RawConn(args.addr)
            for _ in range(10):  # warm both paths
                await sb.exec(["true"])
                raw.exec(sb.id)
            sdk_t, raw_t = [], []
            for _ in range(args.n):  # interleave so drift hits both sides alike
                t0 = time.perf_counter()
                r = await sb.exec(["true"])
                sdk_t.append(time.perf_counter() - t0)
                if r.status != "ok":
                    raise SystemExit(f"exec true: {r}")
                t0 = time.perf_counter()
                raw.exec(sb.id)
                raw_t.append(time.perf_counter() - t0)
        finally:
            if not args.sandbox:
                await sb.delete()
    s, r = p50(sdk_t), p50(raw_t)
    print(f"exec(\"true\") p50 over {args.n} calls: sdk {s:.3f} ms, raw HTTP {r:.3f} ms")
    print(f"sdk overhead: {s - r:+.3f} ms, ratio sdk/raw {s / r:.3f}")


if __name__ == "__main__":
    asyncio.run(main())
