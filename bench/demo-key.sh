#!/usr/bin/env bash
# Prints the hotel sample's demo token key (the HS256 key its policy's key set reads,
# samples/hotel/.dpumesh/certs/demo-jwt.key), made as `dpumesh up` makes it when there
# is none yet: 32 random bytes as hex, owner-only. The bench scripts sign their tokens
# with it; no key written in the repository is one a mesh accepts.
set -euo pipefail
cd "$(dirname "$0")/.."
key=samples/hotel/.dpumesh/certs/demo-jwt.key
if [ ! -s "$key" ]; then
    mkdir -p "$(dirname "$key")"
    (umask 077 && head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$key")
fi
cat "$key"
