#!/usr/bin/env bash
# Build the kvscale images from docker/*.Dockerfile with buildah (no Docker daemon needed).
#
#   docker/build-images.sh [server] [operator]        (both when none is named)
#
# Environment:
#   PYTHON_IMAGE   base image for the Dockerfiles' PYTHON_IMAGE argument. Unset: a Debian
#                  bookworm base with Python 3.11 made here with mmdebstrap from the Debian
#                  mirror (no registry needed), kept as localhost/kvscale-python:3.11-bookworm.
#                  With a registry: PYTHON_IMAGE=python:3.11.13-slim-bookworm (the default of
#                  the Dockerfiles, as `docker build` uses it).
#   TORCH_VERSION  torch for the server image; unset keeps the Dockerfile's GPU pin. The test
#                  build sets 2.13.0 (the CPU wheel, found through this machine's pip settings).
#   TORCH_INDEX_URL  an extra index for torch (e.g. https://download.pytorch.org/whl/cpu).
#   REGISTRY, TAG  image names: $REGISTRY/kvscale-server:$TAG (default ghcr.io/kvscale, the
#                  chart's references, and the version in pyproject.toml).
#   TIMINGS        a file to append "name seconds size" lines to.
#
# Package installs in the build see this machine's pip settings (`pip config list`: indexes,
# find-links, constraints, CA bundle) through a pip.conf and the paths it names, bind-mounted
# read-only at build time (`buildah bud -v`): nothing of them is written into the images.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
# chroot isolation: no daemon, cgroups or user namespaces needed (as root on a plain VM).
export BUILDAH_ISOLATION=${BUILDAH_ISOLATION:-chroot}
# buildah's configured storage driver (overlay where the kernel allows it); STORAGE_DRIVER=vfs
# (slower: full copies) where overlay mounts are not allowed. One driver per storage root.
buildah() { command buildah ${STORAGE_DRIVER:+--storage-driver "$STORAGE_DRIVER"} "$@"; }
REGISTRY=${REGISTRY:-ghcr.io/kvscale}
TAG=${TAG:-$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)}
BASE_LOCAL=localhost/kvscale-python:3.11-bookworm
IMAGES=("$@")
[ ${#IMAGES[@]} -gt 0 ] || IMAGES=(server operator)

log() { echo "build-images: $*" >&2; }

make_base() {
    if buildah inspect --type image "$BASE_LOCAL" >/dev/null 2>&1; then
        return
    fi
    command -v mmdebstrap >/dev/null || { log "mmdebstrap is missing (apt-get install mmdebstrap)"; exit 1; }
    local start=$SECONDS tmp
    tmp=$(mktemp -d)
    log "making $BASE_LOCAL with mmdebstrap (Debian bookworm, python3)"
    # minbase + Python; docs, man pages and apt lists left out of the tarball.
    mmdebstrap --variant=minbase --quiet \
        --include=python3,python3-venv,python-is-python3,ca-certificates \
        --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
        bookworm "$tmp/base.tar"
    local ctr
    ctr=$(buildah from scratch)
    buildah add --quiet "$ctr" "$tmp/base.tar" / >/dev/null
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --env LANG=C.UTF-8 --cmd python3 "$ctr"
    buildah commit --quiet --rm "$ctr" "$BASE_LOCAL" >/dev/null
    rm -rf "$tmp"
    log "base image made in $((SECONDS - start)) s"
    [ -z "${TIMINGS:-}" ] || echo "base $((SECONDS - start)) $(image_size "$BASE_LOCAL")" >>"$TIMINGS"
}

image_size() { buildah images --noheading --format '{{.Size}}' "$1" | head -1; }

# pip.conf from this machine's pip settings, and the local paths it names (to mount).
PIPDIR=$(mktemp -d)
trap 'rm -rf "$PIPDIR"' EXIT
python3 - "$PIPDIR" <<'EOF'
import os, subprocess, sys
out = sys.argv[1]
try:
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                             capture_output=True, text=True, check=True).stdout
except (OSError, subprocess.CalledProcessError):
    listing = ""
keep = {"index-url", "extra-index-url", "find-links", "cert", "constraint",
        "trusted-host", "default-timeout", "client-cert", "retries"}
conf = {}
for line in listing.splitlines():
    key, _, value = line.partition("=")
    scope, _, name = key.rpartition(".")
    if name in keep:
        conf[name] = value.strip().strip("'\"")  # :env: lines come after global ones
paths = set()
for name, value in conf.items():
    for item in value.split():
        path = item[len("file://"):] if item.startswith("file://") else item
        if path.startswith("/") and os.path.exists(path):
            paths.add(os.path.dirname(path.rstrip("/")) if path.endswith("/simple") else path)
with open(os.path.join(out, "pip.conf"), "w") as f:
    f.write("[global]\n" + "".join(f"{k} = {v}\n" for k, v in conf.items()))
with open(os.path.join(out, "mounts"), "w") as f:
    f.write("".join(p + "\n" for p in sorted(paths)))
EOF
VOLUMES=(-v "$PIPDIR/pip.conf:/etc/pip.conf:ro")
TARGETS=(/etc/pip.conf)
while read -r path; do
    [ -n "$path" ] && VOLUMES+=(-v "$path:$path:ro") && TARGETS+=("$path")
done <"$PIPDIR/mounts"

# buildah leaves an empty file or folder where it bind-mounted a -v target (and the folders
# it made above it): remove those the base image does not have, so the image holds nothing
# of the build-time settings, not even their names.
tidy() {
    local image=$1 base=$2 ctr root bctr broot target path
    ctr=$(buildah from --pull=never --quiet "$image")
    root=$(buildah mount "$ctr")
    bctr=$(buildah from --pull=never --quiet "$base")
    broot=$(buildah mount "$bctr")
    for target in "${TARGETS[@]}"; do
        path=$target
        while [ "$path" != / ] && [ ! -e "$broot$path" ]; do
            if [ -f "$root$path" ] && [ ! -s "$root$path" ]; then
                rm -f "$root$path"
            elif [ -d "$root$path" ] && [ ! -L "$root$path" ]; then
                rmdir "$root$path" 2>/dev/null || break  # not empty: not only a stub
            fi
            path=$(dirname "$path")
        done
    done
    buildah umount "$bctr" >/dev/null && buildah rm "$bctr" >/dev/null
    buildah umount "$ctr" >/dev/null
    buildah commit --quiet --rm "$ctr" "$image" >/dev/null
}
log "pip settings for the build: $(tr '\n' ' ' <"$PIPDIR/pip.conf")"

BASE_ARGS=()
if [ -z "${PYTHON_IMAGE:-}" ]; then
    make_base
    BASE_ARGS=(--pull=never --build-arg "PYTHON_IMAGE=$BASE_LOCAL")
else
    BASE_ARGS=(--build-arg "PYTHON_IMAGE=$PYTHON_IMAGE")
fi

for name in "${IMAGES[@]}"; do
    image="$REGISTRY/kvscale-$name:$TAG"
    extra=()
    if [ "$name" = server ]; then
        [ -z "${TORCH_VERSION:-}" ] || extra+=(--build-arg "TORCH_VERSION=$TORCH_VERSION")
        [ -z "${TORCH_INDEX_URL:-}" ] || extra+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
    fi
    start=$SECONDS
    previous=$(buildah images --quiet --no-trunc "$image" 2>/dev/null || true)
    log "building $image"
    buildah bud --quiet --layers=false \
        -f "docker/$name.Dockerfile" --ignorefile "docker/$name.Dockerfile.dockerignore" \
        "${BASE_ARGS[@]}" "${extra[@]}" "${VOLUMES[@]}" --iidfile "$PIPDIR/iid" -t "$image" . \
        >/dev/null
    tidy "$image" "${PYTHON_IMAGE:-$BASE_LOCAL}"
    # the untidied image and the one this build replaces, now nameless: not kept around
    for old in $(cat "$PIPDIR/iid") $previous; do
        buildah rmi "$old" >/dev/null 2>&1 || true
    done
    secs=$((SECONDS - start))
    size=$(image_size "$image")
    log "built $image in $secs s, $size"
    [ -z "${TIMINGS:-}" ] || echo "$name $secs $size" >>"$TIMINGS"
done
