#!/usr/bin/env bash
# podman (or `scripts/podman.sh compose ...`: podman-compose) with the settings these machines need
# (scripts/podman-env.sh): what the container tests and docs/OPERATIONS.md run.
set -euo pipefail
. "$(dirname "$0")/podman-env.sh"
if [ "${1:-}" = compose ]; then
    shift
    exec podman-compose "$@"
fi
exec podman "$@"
