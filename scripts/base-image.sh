#!/usr/bin/env bash
# Make the debian:bookworm-slim base image the Containerfiles start FROM, without a registry:
# a minimal Debian 12 root file system from Debian's own packages (mmdebstrap), imported under
# the name a Containerfile uses, so the same Containerfile works unchanged where Docker Hub is
# reachable. Does nothing when the image is already there (podman keeps it in
# /var/lib/containers between runs; REBUILD_BASE=1 makes it again). See ../shared/CONTAINERS.md and docs/OPERATIONS.md.
set -euo pipefail
BASE=${BASE:-docker.io/library/debian:bookworm-slim}
. "$(dirname "$0")/podman-env.sh"

if podman image exists "$BASE" && [ -z "${REBUILD_BASE:-}" ]; then
    exit 0
fi
tar=$(mktemp --suffix=.tar)
trap 'rm -f "$tar" "$tar.log"' EXIT
echo "base-image: building $BASE with mmdebstrap (about a minute)" >&2
# Slim as Docker's debian:*-slim: no manuals, documentation or translations, in the base and in every
# package installed on top of it (the options stay in /etc/dpkg/dpkg.cfg.d of the image); /usr merged
# by mmdebstrap's hook rather than by the usrmerge package, which would bring perl (50 MB).
mmdebstrap --quiet --variant=minbase \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/locale/locale.alias' \
    --dpkgopt='path-exclude=/usr/share/groff/*' --dpkgopt='path-exclude=/usr/share/lintian/*' \
    --aptopt='APT::Install-Recommends "false"' \
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    bookworm "$tar" >"$tar.log" 2>&1 || { cat "$tar.log" >&2; exit 1; }
podman import --quiet "$tar" "$BASE" >/dev/null
