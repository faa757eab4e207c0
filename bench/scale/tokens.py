"""A key set of K HS256 keys and T distinct tokens the hotel's policy accepts, for
bench/scale.sh's keys and tokens dimensions.

    python3 bench/scale/tokens.py K T JWKS TOKENS SECRETS

JWKS: the key set (kid k0 .. kK-1, kty oct); TOKENS: T tokens, one a line, token i
signed with key i % K and for subject u<i> (an hour); SECRETS: "kid secret" lines
(HAProxy's rules check each kid with its own secret).
"""

import base64
import hashlib
import hmac
import json
import sys
import time


def b64(x: bytes) -> str:
    return base64.urlsafe_b64encode(x).rstrip(b"=").decode()


def main():
    k, t = int(sys.argv[1]), int(sys.argv[2])
    jwks, tokens, secrets = sys.argv[3], sys.argv[4], sys.argv[5]
    keys = [(f"k{i}", hashlib.sha256(f"scale-key-{i}".encode()).hexdigest()) for i in range(k)]
    with open(jwks, "w") as f:
        json.dump({"keys": [{"kty": "oct", "kid": kid, "alg": "HS256", "k": b64(s.encode())}
                            for kid, s in keys]}, f)
    with open(secrets, "w") as f:
        f.writelines(f"{kid} {s}\n" for kid, s in keys)
    now = int(time.time())
    heads = [b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": kid}).encode()) for kid, _ in keys]
    with open(tokens, "w") as f:
        for i in range(t):
            kid, secret = keys[i % k]
            claims = b64(json.dumps({"iss": "dpumesh-demo", "aud": "hotel", "sub": f"u{i}",
                                     "roles": ["user"], "role": "user",
                                     "iat": now, "exp": now + 3600}).encode())
            signed = f"{heads[i % k]}.{claims}"
            sig = b64(hmac.new(secret.encode(), signed.encode(), hashlib.sha256).digest())
            f.write(f"{signed}.{sig}\n")


if __name__ == "__main__":
    main()
