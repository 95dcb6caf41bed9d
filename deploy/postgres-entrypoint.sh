#!/bin/sh
# First start: a cluster in $PGDATA whose superuser $POSTGRES_USER has the password in
# $POSTGRES_PASSWORD_FILE (or $POSTGRES_PASSWORD), reachable over TCP with that password (scram-sha-256). Then serve.
set -eu
: "${POSTGRES_USER:=leveret}" "${POSTGRES_DB:=leveret}" "${PGPORT:=5432}"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile=$(mktemp)
    if [ -n "${POSTGRES_PASSWORD_FILE:-}" ]; then cat "$POSTGRES_PASSWORD_FILE" > "$pwfile"
    elif [ -n "${POSTGRES_PASSWORD:-}" ]; then printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
    else echo "postgres-entrypoint: set POSTGRES_PASSWORD or POSTGRES_PASSWORD_FILE" >&2; exit 64; fi
    # Over TCP the password; on the socket inside the container (this script) trust.
    initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$pwfile" --auth-host=scram-sha-256 --auth-local=trust \
        -E UTF8 --no-locale >/dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    postgres -D "$PGDATA" -p "$PGPORT" -c listen_addresses='' -k /var/run/postgresql &
    pid=$!
    until pg_isready -q -h /var/run/postgresql -p "$PGPORT"; do sleep 0.2; done
    [ "$POSTGRES_DB" = postgres ] || createdb -h /var/run/postgresql -p "$PGPORT" -U "$POSTGRES_USER" "$POSTGRES_DB"
    kill -INT "$pid"; wait "$pid" || true
fi
exec postgres -D "$PGDATA" -p "$PGPORT" -c listen_addresses="${POSTGRES_LISTEN:-*}" -k /var/run/postgresql "$@"
