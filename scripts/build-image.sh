#!/usr/bin/env bash
# Build the container image (deploy/Containerfile) as $IMAGE (default leveret:dev) with podman, or docker
# where there is no podman: the base image first when missing (scripts/base-image.sh, podman only), then
# the wheels on the host (this machine's pip configuration reaches PyPI; the build does not), then the
# image. Nothing is done when an image of that name was built from the same sources (the label
# org.leveret.source holds their hash): `make image` is cheap the second time. FORCE=1 builds anyway.
# `scripts/build-image.sh cluster` also builds what deploy/compose.yaml runs beside the nodes:
# leveret-etcd:dev and leveret-postgres:dev (ETCD_IMAGE, POSTGRES_IMAGE), from Debian's packages.
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${IMAGE:-leveret:dev}
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3

if command -v podman >/dev/null; then
    ENGINE=podman
    . scripts/podman-env.sh
    scripts/base-image.sh
    # The docker format: the OCI one has no HEALTHCHECK.
    BUILD=(podman build --network host --format docker)
elif command -v docker >/dev/null; then
    ENGINE=docker
    BUILD=(docker build --network host)
else
    echo "build-image: neither podman nor docker is installed (apt-get install podman)" >&2; exit 1
fi

# An image of the deploy/ folder's $2.Containerfile as $1, unless one of the same recipe is there.
build_aux() {
    local image=$1 recipe=deploy/$2.Containerfile source
    source=$(cat "$recipe" deploy/postgres-entrypoint.sh | sha1sum | cut -c1-16)
    if [ -z "${FORCE:-}" ] && [ "$($ENGINE image inspect --format '{{index .Labels "org.leveret.source"}}' "$image" \
            2>/dev/null || true)" = "$source" ]; then
        return
    fi
    echo "build-image: $image" >&2
    "${BUILD[@]}" --quiet --label "org.leveret.source=$source" -t "$image" -f "$recipe" deploy >/dev/null
}
if [ "${1:-}" = cluster ]; then
    build_aux "${ETCD_IMAGE:-leveret-etcd:dev}" etcd
    build_aux "${POSTGRES_IMAGE:-leveret-postgres:dev}" postgres
fi

# What the image is made of: the packaged sources, the project files and this recipe.
SOURCE=$( { git ls-files -co --exclude-standard core amqp_frontend coordination persistence spark leveret client \
              proto pyproject.toml README.md deploy/Containerfile scripts/build-image.sh | sort | while read -r f; do
              [ -f "$f" ] && { echo "$f"; cat "$f"; }; done; } | sha1sum | cut -c1-16)
if [ -z "${FORCE:-}" ] && [ "$($ENGINE image inspect --format '{{index .Labels "org.leveret.source"}}' "$IMAGE" \
        2>/dev/null || true)" = "$SOURCE" ]; then
    exit 0
fi

context=build/image
rm -rf "$context"
mkdir -p "$context/wheels/deps" "$context/wheels/leveret"
echo "build-image: wheels of leveret, leveret-client and their dependencies" >&2
if ! "$PYTHON" -m pip wheel -q --disable-pip-version-check -w "$context/wheels/deps" ./client . \
        >"$context/pip.log" 2>&1; then
    cat "$context/pip.log" >&2; exit 1
fi
rm "$context/pip.log"
# Leveret's own two wheels apart from the dependencies' (which stay the same from build to build).
mv "$context"/wheels/deps/leveret-*.whl "$context"/wheels/deps/leveret_client-*.whl "$context/wheels/leveret/"
echo "build-image: $IMAGE" >&2
previous=$($ENGINE image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)
"${BUILD[@]}" --quiet --label "org.leveret.source=$SOURCE" -t "$IMAGE" -f deploy/Containerfile "$context" >/dev/null
rm -rf "$context"
# The image this one replaced, untagged now, and the venv stages of earlier builds; the newest venv stage
# stays: it holds the layer cache (the dependencies' layer) that makes the next build quick (~35 s).
if [ -n "$previous" ] && [ "$previous" != "$($ENGINE image inspect --format '{{.Id}}' "$IMAGE")" ]; then
    $ENGINE rmi "$previous" >/dev/null 2>&1 || true
fi
$ENGINE images -q --filter dangling=true --filter label=org.leveret.source | tail -n +2 \
    | xargs -r $ENGINE rmi >/dev/null 2>&1 || true
echo "build-image: $IMAGE built ($($ENGINE image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}'))" >&2
