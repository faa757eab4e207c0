"""Waits until every node runs a policy generation past the one it ran: prints the
seconds from the start (the policy file's rewrite) until the last node's workers all
run it, or exits 1 after a minute.

    python3 bench/scale/published.py ADMIN[,ADMIN...] < go

Reads each node's generation (its admin API's GET /filters) first, prints `ready`, then
waits for a line on stdin (the file was rewritten) and polls every 5 ms.
"""

import json
import sys
import time
import urllib.request


def generations(admin):
    with urllib.request.urlopen(f"http://{admin}/filters", timeout=5) as r:
        body = json.load(r)
    return body["generation"], body["workers"]


def main():
    admins = sys.argv[1].split(",")
    before = {a: generations(a)[0] for a in admins}
    print("ready", flush=True)
    sys.stdin.readline()
    start = time.monotonic()
    pending = set(admins)
    while pending and time.monotonic() - start < 60:
        for a in list(pending):
            gen, workers = generations(a)
            if gen > before[a] and all(w == gen for w in workers):
                pending.discard(a)
        if pending:
            time.sleep(0.005)
    if pending:
        print(f"not published on {sorted(pending)} within 60 s", flush=True)
        sys.exit(1)
    print(f"{time.monotonic() - start:.3f}", flush=True)


if __name__ == "__main__":
    main()
