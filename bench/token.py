"""A token the hotel sample's policy accepts (HS256, an hour), for the bench scripts.

usage: python3 bench/token.py SECRET
"""
import base64
import hashlib
import hmac
import json
import sys
import time


def b64(x: bytes) -> str:
    return base64.urlsafe_b64encode(x).rstrip(b"=").decode()


now = int(time.time())
head = b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
claims = b64(json.dumps({"iss": "dpumesh-demo", "aud": "hotel", "sub": "bench",
                         "roles": ["user"], "role": "user",
                         "iat": now, "exp": now + 3600}).encode())
sig = b64(hmac.new(sys.argv[1].encode(), f"{head}.{claims}".encode(), hashlib.sha256).digest())
print(f"{head}.{claims}.{sig}")
