#!/usr/bin/env bash
# Make .venv usable: Debian packages first (as root, only what is missing),
# then the venv and the Python packages. Quiet when everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
STAMP=$VENV/.installed-$(sha1sum pyproject.toml | cut -c1-12)
[ -f "$STAMP" ] && exit 0

PYTHON=${PYTHON:-python3}
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
    echo "bootstrap: Leveret needs Python >= 3.11 ($PYTHON is $("$PYTHON" --version 2>&1))" >&2; exit 1; }

# Debian packages the broker and its tests need (none of them started here).
DEB_PACKAGES="python3-venv"
missing=""
for p in $DEB_PACKAGES; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
# A Python built outside Debian (pyenv) has venv already; only ask apt when venv is broken.
if [ -n "$missing" ] && ! "$PYTHON" -m venv --help >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "bootstrap: installing Debian packages:$missing"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
    else
        echo "bootstrap: please install:$missing (apt-get install$missing)" >&2; exit 1
    fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "bootstrap: creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
echo "bootstrap: installing Python packages into $VENV (first run only)"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -U pip
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e '.[test]'
rm -f $VENV/.installed-*
touch "$STAMP"
