#!/usr/bin/env python3
"""Holds N idle keep-alive HTTP/1.1 connections to HOST:PORT for bench/scale.sh.

Each connection sends one GET (with the bench's token) and reads its whole answer, so
the server holds a connection that has served a request and waits for the next, as
a browser's or a load balancer's idle keep-alive connection does. Then:

- prints `ready OPENED FAILED` on stdout once every connection was tried;
- on each line read from stdin, prints `open K`: how many are still open (a server
  that closes idle connections shows here);
- exits at stdin's end, closing them.

    python3 bench/scale/hold.py HOST PORT N PATH TOKEN
"""

import asyncio
import sys

# Connections opened at once: a burst of thousands would overflow the listener's
# accept backlog (the SYNs retried after a second), measuring the backlog.
AT_ONCE = 64


async def one(host, port, request, out, failed):
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
        writer.write(request)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        if length:
            await asyncio.wait_for(reader.readexactly(length), 10)
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(head.split(b"\r\n")[0].decode(errors="replace"))
        out.append((reader, writer))
    except Exception as e:  # noqa: BLE001 - every failure is counted, the first shown
        if not failed:
            print(f"hold: a connection failed: {e!r}", file=sys.stderr)
        failed.append(e)


def still_open(conns):
    # A closed connection reads EOF at once; an open idle one has nothing to read.
    return sum(1 for reader, _ in conns if not reader.at_eof() and reader.exception() is None)


async def main():
    host, port, n, path, token = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    request = (
        f"GET {path} HTTP/1.1\r\nhost: {host}:{port}\r\nauthorization: Bearer {token}\r\n\r\n"
    ).encode()
    conns, failed = [], []
    for start in range(0, n, AT_ONCE):
        await asyncio.gather(
            *(one(host, port, request, conns, failed) for _ in range(min(AT_ONCE, n - start)))
        )
    print(f"ready {len(conns)} {len(failed)}", flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        # Let the readers notice closes that came while we waited.
        await asyncio.sleep(0.05)
        print(f"open {still_open(conns)}", flush=True)
    for _, writer in conns:
        writer.close()


if __name__ == "__main__":
    asyncio.run(main())
