# Sourced by the container scripts: podman as it runs on these machines (see ../shared/CONTAINERS.md).
# No default ulimits (setrlimit is refused in the sandbox), the cgroupfs manager, and runc (crun
# refuses the hybrid cgroup layout). A machine where podman works as shipped can set
# LEVERET_PODMAN_CONF=none to keep its own configuration.
if [ "${LEVERET_PODMAN_CONF:-}" != none ]; then
    conf=${LEVERET_PODMAN_CONF:-${TMPDIR:-/tmp}/leveret-podman.conf}
    if [ ! -f "$conf" ]; then
        printf '[containers]\ndefault_ulimits = []\n[engine]\ncgroup_manager = "cgroupfs"\nruntime = "runc"\n' > "$conf"
    fi
    export CONTAINERS_CONF=$conf
fi
