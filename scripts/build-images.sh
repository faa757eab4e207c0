#!/usr/bin/env bash
# Builds the container images without a daemon (buildah, vfs storage under target/):
#   dpumesh/node          the DPU proxy with the built-in filters   (arm64, amd64)
#   dpumesh/ingress       the ingress                               (arm64, amd64)
#   dpumesh/service-base  the runtime base for host-library services (arm64, amd64)
#   dpumesh/hotel         the hotel sample on the service base      (arm64, amd64)
# and with --doca, alone:
#   dpumesh/node-doca     the node built with the `doca` feature, its DOCA and
#                         rdma-core libraries staged beside it: the DPU proxy on a
#                         BlueField (`--data-path doca`) and the host agent (`dpumesh
#                         host`). Built where the DOCA SDK is installed (a BlueField,
#                         or NVIDIA's DOCA development container): its libraries at
#                         $DOCA_LIB_DIR (default /opt/mellanox/doca/lib/<multiarch>),
#                         which the build links and the image carries.
# Output: one OCI archive per image and architecture, and per image one multi-arch
# archive (an OCI index of both), in target/images/out (or --out DIR).
#
# Each image is FROM scratch (hotel: FROM the service base) with a staged root: the
# binary, stripped, and the glibc libraries it links, resolved from the target's
# libraries (Debian's, or its arm64 cross set); no RUN step, so nothing runs inside
# an arm64 image while it is built. Every image's binary is then started from the
# staged root through its own loader (under qemu-aarch64 for arm64): an image that
# lacks a library fails here, not on the DPU.
#
#   scripts/build-images.sh [--arch amd64|arm64|all] [--profile release|dev]
#                           [--no-build] [--out DIR] [--doca]
set -euo pipefail
cd "$(dirname "$0")/.."

arches=(amd64 arm64)
profile=release
build=1
out=target/images/out
doca=0
while [ $# -gt 0 ]; do
    case "$1" in
        --arch) shift; [ "$1" = all ] && arches=(amd64 arm64) || arches=("$1") ;;
        --profile) shift; profile="$1" ;;
        --no-build) build=0 ;;
        --out) shift; out="$1" ;;
        --doca) doca=1 ;;
        *) echo "usage: $0 [--arch amd64|arm64|all] [--profile release|dev] [--no-build] [--out DIR] [--doca]" >&2; exit 2 ;;
    esac
    shift
done
for a in "${arches[@]}"; do
    case "$a" in amd64|arm64) ;; *) echo "error: unknown architecture $a (amd64, arm64)" >&2; exit 2 ;; esac
done
case "$profile" in release) dir=release ;; dev) dir=debug ;; *) echo "error: profile $profile (release, dev)" >&2; exit 2 ;; esac
# The DOCA libraries of each architecture asked for, before anything is built: the
# `doca` build links them and its image carries them.
doca_dir() { # multiarch
    echo "${DOCA_LIB_DIR:-/opt/mellanox/doca/lib/$1}"
}
if [ "$doca" = 1 ]; then
    for a in "${arches[@]}"; do
        m=$([ "$a" = amd64 ] && echo x86_64-linux-gnu || echo aarch64-linux-gnu)
        d="$(doca_dir "$m")"
        ls "$d"/libdoca_common.so* >/dev/null 2>&1 || {
            echo "error: the DOCA SDK's $a libraries are not at $d (no libdoca_common.so): build dpumesh/node-doca where DOCA is installed (a BlueField, or NVIDIA's DOCA development container), or set DOCA_LIB_DIR" >&2
            exit 1
        }
    done
fi

version="$(sed -n 's/^appVersion: "\(.*\)"/\1/p' deploy/helm/dpumesh-node/Chart.yaml)"
[ -n "$version" ] || { echo "error: no appVersion in the chart" >&2; exit 1; }
command -v buildah >/dev/null || { echo "error: buildah is needed (scripts/install-deploy-tools.sh installs it)" >&2; exit 1; }
stage=target/images/stage
storage=(--storage-driver vfs --root "$PWD/target/images/storage" --runroot "$PWD/target/images/run")
mkdir -p "$out"
out="$(cd "$out" && pwd)"

filters=target/wasm-artifacts/wasm32-wasip2/release
if [ "$build" = 1 ]; then
    cargo build --release -p dpumesh-test-artifacts
fi
for f in trace jwt rbac ratelimit circuit_breaker; do
    [ -f "$filters/dpumesh_filter_$f.wasm" ] || { echo "error: $filters/dpumesh_filter_$f.wasm is missing: run ./scripts/setup.sh" >&2; exit 1; }
done

# triple, library folder, strip, and how to start a binary of the architecture.
platform() {
    case "$1" in
        amd64) triple=x86_64-unknown-linux-gnu; libs=/lib/x86_64-linux-gnu; multiarch=x86_64-linux-gnu
               strip=strip; emulate=() ;;
        arm64) triple=aarch64-unknown-linux-gnu; libs=/usr/aarch64-linux-gnu/lib; multiarch=aarch64-linux-gnu
               strip=aarch64-linux-gnu-strip; emulate=(qemu-aarch64-static) ;;
    esac
    # Where a binary's libraries are found; a doca build's also in DOCA's folder and
    # rdma-core's (libibverbs, libmlx5).
    lib_dirs=("$libs")
    if [ "$doca" = 1 ]; then
        lib_dirs+=("$(doca_dir "$multiarch")" "/usr/lib/$multiarch")
    fi
    if [ "$1" = amd64 ] && [ "$(uname -m)" = x86_64 ]; then
        bin=target/$dir   # the host's own build, shared with the tests
    else
        bin=target/$triple/$dir
    fi
}

# Copies binary $1 to $2/usr/bin stripped, with every library it needs (recursively)
# and its loader at the path its header names.
stage_binary() {
    local binary="$1" root="$2"
    mkdir -p "$root/usr/bin" "$root/lib/$multiarch"
    "$strip" --strip-unneeded -o "$root/usr/bin/$(basename "$binary")" "$binary"
    local interp
    interp="$(readelf -l "$binary" | sed -n 's/.*Requesting program interpreter: \(.*\)]/\1/p')"
    mkdir -p "$root$(dirname "$interp")"
    cp -L "$libs/$(basename "$interp")" "$root$interp"
    stage_binary_libs "$binary" "$root"
}

# Copies every library $1 needs (recursively) into $2/lib/<multiarch>.
stage_binary_libs() {
    local binary="$1" root="$2"
    mkdir -p "$root/lib/$multiarch"
    local todo=("$binary") seen=" "
    while [ ${#todo[@]} -gt 0 ]; do
        local next="${todo[0]}"; todo=("${todo[@]:1}")
        for lib in $(readelf -d "$next" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
            case "$seen" in *" $lib "*) continue ;; esac
            seen="$seen$lib "
            local found=""
            for d in "${lib_dirs[@]}"; do
                [ -e "$d/$lib" ] && { found="$d/$lib"; break; }
            done
            [ -n "$found" ] || { echo "error: $lib (needed by $next) not in ${lib_dirs[*]}" >&2; exit 1; }
            cp -L "$found" "$root/lib/$multiarch/$lib"
            todo+=("$found")
        done
    done
}

# The files every image has: a non-root user, /tmp.
stage_base() {
    local root="$1"
    mkdir -p "$root/etc" "$root/tmp"
    chmod 1777 "$root/tmp"
    printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$root/etc/passwd"
    printf 'root:x:0:\nnonroot:x:65532:\n' >"$root/etc/group"
}

# Starts binary $2 with the loader and libraries staged in root $1.
smoke() {
    local root="$1" program="$2"; shift 2
    local loader
    loader="$(readelf -l "$program" | sed -n 's/.*Requesting program interpreter: \(.*\)]/\1/p')"
    "${emulate[@]}" "$root$loader" --inhibit-cache --library-path "$root/lib/$multiarch" "$program" "$@"
}

image() {
    local name="$1" arch="$2" context="$3"; shift 3
    local tag="dpumesh/$name:$version-$arch"
    # node-doca is the node's image with another root.
    buildah "${storage[@]}" bud --quiet --arch "$arch" --os linux --build-arg "VERSION=$version" "$@" \
        -f "deploy/images/${name%-doca}.Containerfile" -t "$tag" "$context" >/dev/null
    buildah "${storage[@]}" push --quiet "$tag" "oci-archive:$out/dpumesh-$name-$version-$arch.tar:dpumesh/$name:$version" >/dev/null
    echo "  $out/dpumesh-$name-$version-$arch.tar"
}

# node-doca's root: the node's, its binary the doca build's, with the rdma-core
# providers libibverbs loads at run time (dlopen: no binary names them) and their
# configuration.
stage_doca() {
    local s="$1" r="$1/node-doca/rootfs" bin="target/doca/$triple/$dir"
    if [ "$build" = 1 ]; then
        cargo build --profile "$profile" --target "$triple" --target-dir target/doca -p dpumesh --features dpumesh/doca
    fi
    [ -x "$bin/dpumesh" ] || { echo "error: $bin/dpumesh is not built (drop --no-build)" >&2; exit 1; }
    stage_base "$r"
    stage_binary "$bin/dpumesh" "$r"
    mkdir -p "$r/usr/share/dpumesh/filters" "$r/etc/dpumesh"
    mkdir -p "$s/node-doca/rootfs-rw/var/cache/dpumesh" "$s/node-doca/rootfs-rw/run/dpumesh"
    chmod 0750 "$s/node-doca/rootfs-rw/var/cache/dpumesh" "$s/node-doca/rootfs-rw/run/dpumesh"
    for f in trace jwt rbac ratelimit circuit_breaker; do
        cp "$filters/dpumesh_filter_$f.wasm" "$r/usr/share/dpumesh/filters/${f//_/-}.wasm"
    done
    local providers="/usr/lib/$multiarch/libibverbs"
    [ -d "$providers" ] || { echo "error: no rdma-core providers at $providers (install rdma-core / ibverbs-providers)" >&2; exit 1; }
    mkdir -p "$r$providers"
    for p in "$providers"/*.so; do
        stage_binary_libs "$p" "$r"
        cp -L "$p" "$r$providers/"
    done
    [ -d /etc/libibverbs.d ] && cp -r /etc/libibverbs.d "$r/etc/"
    smoke "$r" "$r/usr/bin/dpumesh" --version >/dev/null \
        || { echo "error: the $arch node-doca image's dpumesh does not start" >&2; exit 1; }
}

for arch in "${arches[@]}"; do
    platform "$arch"
    echo "==> $arch ($triple, $profile)"
    if [ "$doca" = 1 ]; then
        s="$stage/$arch"
        rm -rf "$s"
        stage_doca "$s"
        image node-doca "$arch" "$s/node-doca"
        continue
    fi
    if [ "$build" = 1 ]; then
        if [ "$bin" = "target/$dir" ]; then
            cargo build --profile "$profile" -p dpumesh -p dpumesh-sample-hotel
        else
            cargo build --profile "$profile" --target "$triple" -p dpumesh -p dpumesh-sample-hotel
        fi
    fi
    for b in dpumesh hotel; do
        [ -x "$bin/$b" ] || { echo "error: $bin/$b is not built (drop --no-build)" >&2; exit 1; }
    done
    s="$stage/$arch"
    rm -rf "$s"
    # node and ingress: the binary, its libraries, the filters; and in rootfs-rw the
    # folders the process writes, which the Containerfile copies owned by 65532 (the
    # image then runs as that user without a volume over them).
    for role in node ingress; do
        r="$s/$role/rootfs"
        stage_base "$r"
        stage_binary "$bin/dpumesh" "$r"
        mkdir -p "$r/usr/share/dpumesh/filters" "$r/etc/dpumesh"
        mkdir -p "$s/$role/rootfs-rw/var/cache/dpumesh" "$s/$role/rootfs-rw/run/dpumesh"
        chmod 0750 "$s/$role/rootfs-rw/var/cache/dpumesh" "$s/$role/rootfs-rw/run/dpumesh"
        for f in trace jwt rbac ratelimit circuit_breaker; do
            cp "$filters/dpumesh_filter_$f.wasm" "$r/usr/share/dpumesh/filters/${f//_/-}.wasm"
        done
        smoke "$r" "$r/usr/bin/dpumesh" --version >/dev/null \
            || { echo "error: the $arch $role image's dpumesh does not start" >&2; exit 1; }
    done
    # service-base: the libraries a host-library service links (the hotel sample's).
    r="$s/service-base/rootfs"
    stage_base "$r"
    stage_binary "$bin/hotel" "$r"
    rm "$r/usr/bin/hotel"
    r="$s/hotel/rootfs"
    mkdir -p "$r/usr/bin"
    "$strip" --strip-unneeded -o "$r/usr/bin/hotel" "$bin/hotel"
    # Started with an unknown service name, it says so: it ran.
    out_smoke="$(smoke "$s/service-base/rootfs" "$r/usr/bin/hotel" nosuch 2>&1 || true)"
    case "$out_smoke" in *"unknown service"*) ;; *) echo "error: hotel does not start on the $arch service base: $out_smoke" >&2; exit 1 ;; esac

    image node "$arch" "$s/node"
    image ingress "$arch" "$s/ingress"
    image service-base "$arch" "$s/service-base"
    image hotel "$arch" "$s/hotel" --build-arg "BASE=dpumesh/service-base:$version-$arch"
done

# One archive per image holding every architecture built (an OCI image index).
if [ ${#arches[@]} -gt 1 ]; then
    echo "==> multi-arch indexes"
    names=(node ingress service-base hotel)
    [ "$doca" = 1 ] && names=(node-doca)
    for name in "${names[@]}"; do
        list="dpumesh/$name:$version"
        buildah "${storage[@]}" manifest rm "$list" >/dev/null 2>&1 || true
        buildah "${storage[@]}" manifest create "$list" >/dev/null
        for arch in "${arches[@]}"; do
            buildah "${storage[@]}" manifest add --arch "$arch" --os linux "$list" "dpumesh/$name:$version-$arch" >/dev/null
        done
        buildah "${storage[@]}" manifest push --quiet --all "$list" "oci-archive:$out/dpumesh-$name-$version.tar:dpumesh/$name:$version" >/dev/null
        echo "  $out/dpumesh-$name-$version.tar"
    done
fi
du -sh "$out"/*.tar | sed 's/^/  /'
