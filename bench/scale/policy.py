"""The hotel's policy reshaped for one step of bench/scale.sh (component paths and the
demo key made absolute, as bench/mesh-lib.sh's bench_policy does).

    python3 bench/scale/policy.py ROOT OUT routes N MAP
        N routes in all: N - 6 generated ones before the hotel's own 6 (a tenth on
        hosts of their own, the rest under /sJ/rR prefixes), to N / 50 services of
        their own; MAP gets the same prefixes for HAProxy's map_beg, /ping last.
    python3 bench/scale/policy.py ROOT OUT subjects
        The bench chain's rate limit keyed on the x-subject header, not the token's
        subject (a load generator cannot sign a million tokens a run), its buckets
        refilled each minute (so a bucket lives up to a minute), and the node's
        shared state bounded at 100 000 entries: a step's subjects outnumber it.
    python3 bench/scale/policy.py ROOT OUT filters N
        The bench chain of N filters: jwt, then N - 1 copies of rbac (each its own
        filter, with its own instances).
    python3 bench/scale/policy.py ROOT OUT jwks JWKS
        Tokens checked against the key set in the file JWKS (bench/scale/tokens.py
        makes it), and the bench chain without its rate limit (jwt, rbac): what
        HAProxy does beside it.
"""

import sys


def replace(text, old, new):
    if old not in text:
        sys.exit(f"samples/hotel/policy.yaml: no {old!r}")
    return text.replace(old, new, 1)


def routes(text, n, hmap):
    own = text[text.index("\nroutes:\n") + 9:].count("\n  - ")
    extra = max(n - own, 0)
    services = max(extra // 50, 1)
    svc = "".join(f"  s{j}: {{chain: bench}}\n" for j in range(services))
    lines, prefixes = [], []
    for r in range(extra):
        j = r % services
        if r % 10 == 0:
            lines.append(f"  - {{host: h{r}.example.com, path_prefix: /, service: s{j}}}\n")
        else:
            lines.append(f"  - {{path_prefix: /s{j}/r{r}, service: s{j}}}\n")
            prefixes.append(f"/s{j}/r{r} none\n")
    text = replace(text, "\nservices:\n", "\nservices:\n" + svc)
    text = replace(text, "\nroutes:\n", "\nroutes:\n" + "".join(lines))
    with open(hmap, "w") as f:
        f.write("".join(prefixes) + "/ping origin\n")
    return text


def main():
    root, out, kind = sys.argv[1], sys.argv[2], sys.argv[3]
    text = open(f"{root}/samples/hotel/policy.yaml").read()
    text = text.replace("../../target/", f"{root}/target/")
    text = text.replace("secret_file: .dpumesh/", f"secret_file: {root}/samples/hotel/.dpumesh/")
    if kind == "routes":
        text = routes(text, int(sys.argv[4]), sys.argv[5])
    elif kind == "subjects":
        text = replace(text, "{name: per-user, entries: [{claim: sub}], bucket: {max_tokens: 1000000000, fill_interval_ms: 1000}",
                       "{name: per-user, entries: [{header: x-subject}], bucket: {max_tokens: 1000000000, fill_interval_ms: 60000}")
        text = replace(text, "\nworkers: 1\n", "\nworkers: 1\nshared_state: {max_entries: 100000}\n")
    elif kind == "filters":
        n = int(sys.argv[4])
        start = text.index("  rbac:\n")
        end = text.index("\n  ratelimit:\n", start) + 1
        rbac = text[start:end]
        copies = "".join(rbac.replace("  rbac:\n", f"  rbac{i}:\n", 1) for i in range(1, n - 1))
        text = text[:end] + copies + text[end:]
        chain = ["jwt"] + (["rbac"] if n > 1 else []) + [f"rbac{i}" for i in range(1, n - 1)]
        text = replace(text, "  bench: [jwt, rbac, ratelimit]\n", f"  bench: [{', '.join(chain)}]\n")
    elif kind == "jwks":
        text = replace(text, "secret_file: " + f"{root}/samples/hotel/.dpumesh/certs/demo-jwt.key",
                       f"jwks_file: {sys.argv[4]}")
        text = replace(text, "  bench: [jwt, rbac, ratelimit]\n", "  bench: [jwt, rbac]\n")
    else:
        sys.exit(f"unknown kind {kind}")
    with open(out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
