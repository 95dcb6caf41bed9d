#!/usr/bin/env bash
# Make a venv usable, at one of two levels:
#   scripts/bootstrap.sh run    what a node needs (make run): the client package and the broker, no extras
#   scripts/bootstrap.sh test   everything make test needs (the default): the test and Spark extras and
#                               the Debian packages the tests start (PostgreSQL, etcd, Java, chromium,
#                               libfaketime, podman)
# Debian packages first (as root, only what is missing), then the venv and the Python packages.
# Quiet when everything is there: a stamp per level names a hash of what decides the install, so a
# changed pyproject (or this script) installs again. VENV=/some/path for a venv elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."

LEVEL=${1:-test}
case "$LEVEL" in
    run|test) ;;
    *) echo "bootstrap: level must be run or test, not '$LEVEL'" >&2; exit 2 ;;
esac
VENV=${VENV:-.venv}
HASH=$(cat pyproject.toml client/pyproject.toml scripts/bootstrap.sh | sha1sum | cut -c1-12)
STAMP=$VENV/.installed-$LEVEL-$HASH
[ -f "$STAMP" ] && exit 0
# The test level holds everything the run level does.
[ "$LEVEL" = run ] && [ -f "$VENV/.installed-test-$HASH" ] && exit 0

PYTHON=${PYTHON:-python3}
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
    echo "bootstrap: Leveret needs Python >= 3.11 ($PYTHON is $("$PYTHON" --version 2>&1))" >&2; exit 1; }

# Debian packages: what is missing, by the file that shows it is there.
missing=""
"$PYTHON" -c 'import ensurepip, venv' >/dev/null 2>&1 || missing="$missing python3-venv"
if [ "$LEVEL" = test ]; then
    # PostgreSQL server binaries: the tests start throwaway servers (the broker's --store postgres).
    [ -x /usr/lib/postgresql/15/bin/initdb ] || missing="$missing postgresql"
    # Java and the JDBC drivers of the Spark retention jobs (spark/, offline: never spark.jars.packages).
    [ -x /usr/bin/java ] || missing="$missing openjdk-17-jre-headless"
    [ -f /usr/share/java/postgresql.jar ] || missing="$missing libpostgresql-jdbc-java"
    [ -f /usr/share/java/sqlite-jdbc.jar ] || missing="$missing libxerial-sqlite-jdbc-java"
    # etcd for cluster mode (--etcd): the cluster tests start throwaway servers; etcdctl reads the keys.
    [ -x /usr/bin/etcd ] || missing="$missing etcd-server"
    [ -x /usr/bin/etcdctl ] || missing="$missing etcd-client"
    # Debian's chromium for the web console tests (driven headless by playwright; never a downloaded browser).
    [ -x /usr/bin/chromium ] || missing="$missing chromium"
    # libfaketime for the clock-step tests and the chaos suite's clock fault (bench/chaos_clock.py).
    [ -f /usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1 ] || missing="$missing libfaketime"
    # A real Prometheus for the Grafana-panel test (compat_tests/test_metrics.py scrapes a node with it).
    [ -x /usr/bin/prometheus ] || missing="$missing prometheus"
    # podman and friends for the container tests (compat_tests/test_container.py; ../shared/CONTAINERS.md):
    # the image is built from a base made with mmdebstrap, run with runc; podman-compose for the cluster.
    [ -x /usr/bin/podman ] || missing="$missing podman"
    [ -x /usr/bin/mmdebstrap ] || missing="$missing mmdebstrap"
    [ -x /usr/sbin/runc ] || missing="$missing runc"
    [ -x /usr/bin/podman-compose ] || missing="$missing podman-compose"
fi
if [ -n "$missing" ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "bootstrap: installing Debian packages:$missing"
        # Installing postgresql would also create and start a cluster on 5432; we only want the binaries.
        mkdir -p /etc/postgresql-common
        grep -qs '^create_main_cluster *= *false' /etc/postgresql-common/createcluster.conf \
            || echo 'create_main_cluster = false' >> /etc/postgresql-common/createcluster.conf
        # Nor do we want etcd (or anything) started as a service: tests start their own.
        if [ ! -e /usr/sbin/policy-rc.d ]; then
            printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
            trap 'rm -f /usr/sbin/policy-rc.d' EXIT
        fi
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
    else
        echo "bootstrap: please install:$missing (as root: apt-get install$missing)" >&2; exit 1
    fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "bootstrap: creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
echo "bootstrap: installing Python packages into $VENV ($LEVEL level; first run only)"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -U pip
if [ "$LEVEL" = test ]; then
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ./client -e '.[test,spark]'
else
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ./client -e .
fi
rm -f "$VENV"/.installed-*
touch "$STAMP"
