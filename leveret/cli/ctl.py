"""``leveret ctl`` (and ``leveret-rabbitmqctl``): rabbitmqctl's commands, over a running node's management API.

Command names, argument order, global flags (leveret/cli/ctl_args.py), output
and exit codes are rabbitmqctl's, so a script ports by changing the program
name (or ``alias rabbitmqctl=leveret-rabbitmqctl``). Every change goes through
the HTTP API and so applies to the running node at once. Lists print an
informational line (``-q`` drops it), a tab-separated header (``-s`` or
``--no-table-headers`` drop it) and the rows; ``--formatter json`` prints JSON.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from leveret.cli import backup, ctl_args
from leveret.cli.ctl_args import (
    EX_DATAERR,
    EX_NOPERM,
    EX_NOUSER,
    EX_SOFTWARE,
    EX_TEMPFAIL,
    EX_UNAVAILABLE,
    EX_USAGE,
    Options,
    UsageError,
)

DEFAULT_TIMEOUT = 60.0  # rabbitmqctl's for most commands

# command: (API path, default columns, per vhost, informational line)
LISTS: dict[str, tuple[str, tuple[str, ...], bool, str]] = {
    "list_queues": ("queues", ("name", "messages"), True, "Listing queues for vhost {vhost} ..."),
    "list_exchanges": ("exchanges", ("name", "type"), True, "Listing exchanges for vhost {vhost} ..."),
    "list_bindings": ("bindings", ("source_name", "source_kind", "destination_name", "destination_kind",
                                   "routing_key", "arguments"), True, "Listing bindings for vhost {vhost}..."),
    "list_connections": ("connections", ("user", "peer_host", "peer_port", "state"), False,
                         "Listing connections ..."),
    # rabbitmqctl's first default column is the channel's Erlang pid; Leveret's channels have a name.
    "list_channels": ("channels", ("name", "user", "consumer_count", "messages_unacknowledged"), False,
                      "Listing channels ..."),
    "list_consumers": ("consumers", ("queue_name", "channel_name", "consumer_tag", "ack_required",
                                     "prefetch_count", "active", "arguments"), True,
                       "Listing consumers in vhost {vhost} ..."),
    "list_users": ("users", ("user", "tags"), False, "Listing users ..."),
    "list_vhosts": ("vhosts", ("name",), False, "Listing vhosts ..."),
    "list_permissions": ("permissions", ("user", "configure", "write", "read"), True,
                         'Listing permissions for vhost "{vhost}" ...'),
    "list_policies": ("policies", ("vhost", "name", "pattern", "apply-to", "definition", "priority"), True,
                      'Listing policies for vhost "{vhost}" ...'),
    "list_operator_policies": ("operator-policies", ("vhost", "name", "pattern", "apply-to", "definition",
                                                     "priority"), True,
                               'Listing operator policy overrides for vhost "{vhost}" ...'),
}

# The columns each list takes: rabbitmqctl's info item -> the API field (dotted for nested).
# A column rabbitmqctl has and Leveret has no figure for (pid, disk_reads, slave_pids, ...) is
# refused (exit 64) rather than printed as something else.
_Q = ("name", "vhost", "durable", "auto_delete", "arguments", "policy", "operator_policy",
      "effective_policy_definition", "exclusive", "exclusive_consumer_tag", "messages_ready",
      "messages_unacknowledged", "messages", "messages_persistent", "message_bytes", "message_bytes_ready",
      "head_message_timestamp", "consumers", "consumer_utilisation", "consumer_capacity", "memory", "state",
      "type", "node", "messages_paged_out")
COLUMNS: dict[str, dict[str, str]] = {
    "list_queues": {**{c: c for c in _Q}, "leader": "node"},
    "list_exchanges": {c: c for c in ("name", "vhost", "type", "durable", "auto_delete", "internal", "arguments")},
    "list_bindings": {"source_name": "source", "source_kind": "_exchange", "destination_name": "destination",
                      "destination_kind": "destination_type", "routing_key": "routing_key",
                      "arguments": "arguments", "vhost": "vhost"},
    "list_connections": {**{c: c for c in (
        "name", "port", "host", "peer_port", "peer_host", "ssl", "state", "channels", "protocol", "auth_mechanism",
        "user", "vhost", "timeout", "frame_max", "channel_max", "client_properties", "recv_oct", "send_oct",
        "connected_at", "node")}},
    "list_channels": {**{c: c for c in (
        "name", "number", "user", "vhost", "transactional", "confirm", "consumer_count", "messages_unacknowledged",
        "prefetch_count", "global_prefetch_count", "state", "node")}, "connection": "connection_details.name"},
    "list_consumers": {"queue_name": "queue.name", "channel_name": "channel_details.name",
                       "consumer_tag": "consumer_tag", "ack_required": "ack_required",
                       "prefetch_count": "prefetch_count", "active": "active", "activity_status": "activity_status",
                       "arguments": "arguments", "exclusive": "exclusive"},
    "list_users": {"user": "name", "tags": "tags"},
    "list_vhosts": {c: c for c in ("name", "description", "tags", "tracing", "default_queue_type", "messages",
                                   "messages_ready", "messages_unacknowledged")},
    "list_permissions": {c: c for c in ("user", "configure", "write", "read")},
    "list_policies": {c: c for c in ("vhost", "name", "pattern", "apply-to", "definition", "priority")},
    "list_operator_policies": {c: c for c in ("vhost", "name", "pattern", "apply-to", "definition", "priority")},
}


class CtlError(Exception):
    def __init__(self, text: str, code: int = EX_UNAVAILABLE) -> None:
        super().__init__(text)
        self.code = code


class Client:
    def __init__(self, node: str, username: str, password: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.base = node if node.startswith(("http://", "https://")) else f"http://{node}"
        token = base64.b64encode(f"{username}:{password}".encode()).decode()
        self.headers = {"Authorization": f"Basic {token}", "Content-Type": "application/json"}
        self.timeout = timeout

    def call(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
             not_found: int = EX_UNAVAILABLE) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + "/api/" + path, data=data, method=method,
                                     headers={**self.headers, **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            text = exc.read().decode("utf-8", "replace")
            try:
                reason = json.loads(text).get("reason", text)
            except (ValueError, AttributeError):
                reason = text
            code = {400: EX_DATAERR, 401: EX_NOPERM, 403: EX_NOPERM, 404: not_found}.get(exc.code, EX_UNAVAILABLE)
            raise CtlError(f"{method} /api/{path}: {exc.code} {reason}", code) from None
        except TimeoutError:
            raise CtlError(f"no answer from {self.base} within {self.timeout:g} s", EX_TEMPFAIL) from None
        except (urllib.error.URLError, OSError) as exc:
            if isinstance(getattr(exc, "reason", None), TimeoutError):
                raise CtlError(f"no answer from {self.base} within {self.timeout:g} s", EX_TEMPFAIL) from None
            raise CtlError(f"cannot reach the node's management API at {self.base}: "
                           f"{getattr(exc, 'reason', exc)}") from None
        return json.loads(raw) if raw.strip() else None


def q(name: str) -> str:
    return quote(name, safe="")


def _field(item: dict[str, Any], field: str) -> Any:
    if field == "_exchange":
        return "exchange"
    value: Any = item
    for part in field.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def info(opts: Options, text: str) -> None:
    """rabbitmqctl's informational line (``Listing queues ...``): not with -q or -s."""
    if opts.informative and opts.formatter != "json":
        print(text)


def print_table(items: list[dict[str, Any]], columns: list[str], opts: Options,
                fields: dict[str, str] | None = None) -> None:
    fields = fields or {c: c for c in columns}
    if opts.formatter == "json":
        print(json.dumps([{c: _field(i, fields[c]) for c in columns} for i in items]))
        return
    if opts.headers and items:
        print("\t".join(columns))
    for item in items:
        print("\t".join(_text(_field(item, fields[c])) for c in columns))


def _columns(command: str, opts: Options, default: tuple[str, ...]) -> list[str]:
    """The columns asked for (rabbitmqctl also takes them comma-separated); an unknown one is EX_USAGE."""
    asked = [c for arg in opts.args for c in arg.split(",") if c] or list(default)
    known = COLUMNS[command]
    unknown = [c for c in asked if c not in known]
    if unknown:
        raise UsageError(f"Info key(s) {', '.join(unknown)} are not supported by Leveret's {command}; "
                         f"it has: {', '.join(known)}")
    return asked


def _list(client: Client, opts: Options) -> int:
    command = opts.command
    path, default_columns, per_vhost, line = LISTS[command]
    columns = _columns(command, opts, default_columns)
    if command == "list_permissions":
        path = f"vhosts/{q(opts.vhost)}/permissions"
    elif per_vhost:
        path += "/" + q(opts.vhost)
    info(opts, line.format(vhost=opts.vhost))
    try:
        items = client.call("GET", path, not_found=0)
    except CtlError as exc:
        if exc.code != 0 or command not in ("list_queues", "list_exchanges", "list_consumers", "list_bindings"):
            raise CtlError(str(exc), exc.code or EX_UNAVAILABLE) from None
        items = []  # rabbitmqctl lists nothing, exit 0, for a vhost that does not exist
    print_table(items, columns, opts, COLUMNS[command])
    return 0


def _need(opts: Options, n: int, usage: str, at_most: int | None = None) -> list[str]:
    if len(opts.args) < n or (at_most is not None and len(opts.args) > at_most):
        raise UsageError(f"usage: rabbitmqctl {opts.command} {usage}")
    return list(opts.args)


def _connection_name(client: Client, wanted: str) -> str:
    """rabbitmqctl takes a connection pid; here the API's name, or a unique part of it (e.g. the peer port)."""
    names = [c["name"] for c in client.call("GET", "connections")]
    if wanted in names:
        return wanted
    matches = [n for n in names if wanted in n]
    if len(matches) != 1:
        raise CtlError(f"no single connection matches {wanted!r} (open: {', '.join(names) or 'none'})")
    return matches[0]


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise CtlError(f"{what} is not JSON: {exc}", EX_DATAERR) from None


def _json_object(text: str, what: str) -> dict[str, Any]:
    value = _json(text, what)
    if not isinstance(value, dict):
        raise CtlError(f"{what} must be a JSON object, e.g. '{{\"max-connections\": 10}}'", EX_DATAERR)
    return value


def _limits(client: Client, opts: Options) -> None:
    """rabbitmqctl's set/clear/list_vhost_limits and set/clear/list_user_limits, one API call per limit."""
    c, v = opts.command, opts.vhost
    if c == "set_vhost_limits":
        (text,) = _need(opts, 1, "[-p VHOST] '{\"max-connections\": N, \"max-queues\": N}'", 1)
        info(opts, f'Applying limits to vhost "{v}" ...')
        for name, value in _json_object(text, "LIMITS").items():
            client.call("PUT", f"vhost-limits/{q(v)}/{q(name)}", {"value": value})
    elif c == "clear_vhost_limits":
        info(opts, f'Clearing vhost "{v}" limits ...')
        for entry in client.call("GET", f"vhost-limits/{q(v)}"):
            for name in entry["value"]:
                client.call("DELETE", f"vhost-limits/{q(v)}/{q(name)}")
    elif c == "list_vhost_limits":
        if opts.global_:
            info(opts, "Listing limits for all vhosts ...")
            entries = client.call("GET", "vhost-limits")
            print_table([{"vhost": e["vhost"], "limits": e["value"]} for e in entries], ["vhost", "limits"], opts)
            return
        info(opts, f'Listing limits for vhost "{v}" ...')
        client.call("GET", f"vhosts/{q(v)}", not_found=EX_DATAERR)  # as rabbitmqctl: a missing vhost is 65
        entries = client.call("GET", f"vhost-limits/{q(v)}")
        limits = entries[0]["value"] if entries else {}
        # rabbitmqctl prints the limits object alone (nothing for none), JSON with --formatter json
        if opts.formatter == "json":
            print(json.dumps(limits, separators=(",", ":")))
        elif limits:
            print(json.dumps(limits, separators=(",", ":")))
    elif c == "set_user_limits":
        user, text = _need(opts, 2, "USER '{\"max-connections\": N, \"max-channels\": N}'", 2)
        info(opts, f'Setting user limits to "{text}" for user "{user}" ...')
        for name, value in _json_object(text, "LIMITS").items():
            client.call("PUT", f"user-limits/{q(user)}/{q(name)}", {"value": value})
    elif c == "clear_user_limits":
        user, which = _need(opts, 2, "USER LIMIT_NAME|all", 2)
        info(opts, f'Clearing "{which}" limit for user "{user}" ...')
        names = ([n for e in client.call("GET", f"user-limits/{q(user)}") for n in e["value"]]
                 if which == "all" else [which])
        for name in names:
            client.call("DELETE", f"user-limits/{q(user)}/{q(name)}")
    else:
        entries = client.call("GET", "user-limits" if opts.all_ or not opts.args else f"user-limits/{q(opts.args[0])}")
        print_table([{"user": e["user"], "limits": e["value"]} for e in entries], ["user", "limits"], opts)


def _user(client: Client, name: str) -> dict[str, Any]:
    user: dict[str, Any] = client.call("GET", f"users/{q(name)}", not_found=EX_NOUSER)
    return user


def _authenticate(client: Client, opts: Options) -> None:
    user, password = _need(opts, 2, "USER PASSWORD", 2)
    info(opts, f'Authenticating user "{user}" ...')
    probe = Client(client.base, user, password, client.timeout)
    try:
        probe.call("GET", "whoami")
    except CtlError as exc:
        # The API answers 401 "Not management user" to a right password without a management tag.
        if "Not management user" not in str(exc):
            raise CtlError(f'failed to authenticate user "{user}"\nuser \'{user}\' - invalid credentials',
                           EX_DATAERR) from None
    print("Success")


def _await_startup(client: Client, opts: Options) -> None:
    """Wait until the node's API answers (rabbitmqctl's default wait: 300 s)."""
    deadline = time.monotonic() + (opts.timeout or 300.0)
    waiter = Client(client.base, "", "", timeout=2.0)
    waiter.headers = client.headers
    while True:
        try:
            waiter.call("GET", "overview")
            return
        except CtlError as exc:
            if exc.code == EX_NOPERM:
                raise
            if time.monotonic() > deadline:
                raise CtlError(f"the node did not start within {opts.timeout or 300.0:g} s: {exc}",
                               EX_TEMPFAIL) from None
        time.sleep(0.2)


def _report(client: Client, opts: Options) -> None:
    """rabbitmqctl report: status and every list, per vhost, in one go (for support tickets)."""
    _status(client, opts)
    for command in ("list_connections", "list_channels"):
        print()
        _list(client, _with(opts, command))
    for vhost in [v["name"] for v in client.call("GET", "vhosts")]:
        for command in ("list_queues", "list_exchanges", "list_bindings", "list_consumers", "list_permissions",
                        "list_policies"):
            print()
            _list(client, _with(opts, command, vhost))


def _with(opts: Options, command: str, vhost: str | None = None) -> Options:
    other = Options(**{**vars(opts), "command": command, "args": [], "given": set()})
    if vhost is not None:
        other.vhost = vhost
    return other


def _status(client: Client, opts: Options) -> None:
    overview, nodes = client.call("GET", "overview"), client.call("GET", "nodes")
    node = nodes[0] if nodes else {}
    status = {"node": overview["node"], "product_name": overview["product_name"],
              "product_version": overview["product_version"], "rabbitmq_api_version":
                  overview.get("rabbitmq_api_version"), "cluster_name": overview["cluster_name"],
              "listeners": overview["listeners"],
              "alarms": [n["name"] for n in nodes if n.get("mem_alarm") or n.get("disk_free_alarm")],
              "memory": {"used": node.get("mem_used"), "limit": node.get("mem_limit"), "rss": node.get("mem_rss")},
              "disk_free": node.get("disk_free"), "disk_free_limit": node.get("disk_free_limit"),
              "file_descriptors": {"used": node.get("fd_used"), "total": node.get("fd_total")},
              "uptime_seconds": (node.get("uptime") or 0) // 1000,
              "totals": overview["object_totals"], "queue_totals": overview["queue_totals"]}
    info(opts, f"Status of node {overview['node']} ...")
    print(json.dumps(status, indent=None if opts.formatter == "json" else 2))


def _set_watermark(client: Client, opts: Options) -> None:
    args = _need(opts, 1, "FRACTION | absolute MEMORY", 2)
    if args[0] == "absolute":
        if len(args) != 2:
            raise UsageError("usage: rabbitmqctl set_vm_memory_high_watermark absolute MEMORY (e.g. 2GB)")
        body: dict[str, Any] = {"vm_memory_high_watermark": {"absolute": args[1]}}
        info(opts, f"Setting memory threshold on {_node_name(client)} to {args[1]} bytes ...")
    else:
        try:
            fraction = float(args[0])
        except ValueError:
            raise UsageError(f"{args[0]!r}: a fraction of RAM (0.0-1.0) or 'absolute MEMORY'") from None
        body = {"vm_memory_high_watermark": fraction}
        info(opts, f"Setting memory threshold on {_node_name(client)} to {fraction} ...")
    client.call("PUT", "leveret/node-limits", body)


def _set_disk_free_limit(client: Client, opts: Options) -> None:
    args = _need(opts, 1, "DISK_LIMIT | mem_relative FRACTION", 2)
    text = f"mem_relative:{args[1]}" if args[0] == "mem_relative" and len(args) == 2 else " ".join(args)
    info(opts, f"Setting disk free limit on {_node_name(client)} to {' '.join(args)} bytes ...")
    client.call("PUT", "leveret/node-limits", {"disk_free_limit": text})


def _node_name(client: Client) -> str:
    return str(client.call("GET", "overview")["node"])


def _global_parameters(client: Client, opts: Options) -> None:
    if opts.command == "list_global_parameters":
        info(opts, "Listing global runtime parameters ...")
        items = [{"name": p["name"], "value": json.dumps(p["value"])} for p in client.call("GET", "global-parameters")]
        print_table(items, ["name", "value"], opts)
        return
    if opts.command == "set_global_parameter":
        name, value = _need(opts, 2, "NAME VALUE", 2)
        info(opts, f'Setting global runtime parameter "{name}" to "{value}" ...')
        parsed = _json(value, "VALUE")
        if name != "cluster_name" or not isinstance(parsed, str):
            raise CtlError('Leveret keeps one global parameter a user sets: cluster_name, a JSON string '
                           '(e.g. \'"prod"\')', EX_DATAERR)
        client.call("PUT", "cluster-name", {"name": parsed})
        return
    (name,) = _need(opts, 1, "NAME", 1)
    raise CtlError(f"global parameter {name!r} cannot be cleared in Leveret (cluster_name: set it instead)",
                   EX_DATAERR)


def _node_health_check(client: Client, opts: Options) -> None:
    info(opts, f"Checking health of node {_node_name(client)} ...")
    for path in ("health/checks/alarms", "health/checks/virtual-hosts", f"aliveness-test/{q('/')}"):
        client.call("GET", path)
    print("Health check passed")


def _users_and_vhosts(client: Client, opts: Options) -> None:
    c, v = opts.command, opts.vhost
    if c == "add_user":
        name, password = _need(opts, 2, "USER PASSWORD", 2)
        info(opts, f'Adding user "{name}" ...')
        try:
            client.call("GET", f"users/{q(name)}")
        except CtlError as exc:
            if exc.code != EX_UNAVAILABLE:
                raise
        else:
            raise CtlError(f'User "{name}" already exists', EX_SOFTWARE)
        client.call("PUT", f"users/{q(name)}", {"password": password, "tags": ""})
    elif c == "delete_user":
        (name,) = _need(opts, 1, "USER", 1)
        info(opts, f'Deleting user "{name}" ...')
        client.call("DELETE", f"users/{q(name)}", not_found=EX_NOUSER)
    elif c == "change_password":
        name, password = _need(opts, 2, "USER NEW_PASSWORD", 2)
        info(opts, f'Changing password for user "{name}" ...')
        record = _user(client, name)
        client.call("PUT", f"users/{q(name)}", {"password": password, "tags": record.get("tags", [])})
    elif c == "set_user_tags":
        rest = _need(opts, 1, "USER [TAG ...]")
        info(opts, f'Setting tags for user "{rest[0]}" to [{", ".join(rest[1:])}] ...')
        record = _user(client, rest[0])
        client.call("PUT", f"users/{q(rest[0])}", {"password_hash": record["password_hash"],
                                                  "hashing_algorithm": record["hashing_algorithm"],
                                                  "tags": rest[1:]})
    elif c == "list_user_permissions":
        (name,) = _need(opts, 1, "USER", 1)
        info(opts, f'Listing permissions for user "{name}" ...')
        items = client.call("GET", f"users/{q(name)}/permissions", not_found=EX_NOUSER)
        print_table(items, ["vhost", "configure", "write", "read"], opts)
    elif c == "add_vhost":
        (name,) = _need(opts, 1, "VHOST", 1)
        info(opts, f'Adding vhost "{name}" ...')
        client.call("PUT", f"vhosts/{q(name)}", {})
    elif c == "delete_vhost":
        (name,) = _need(opts, 1, "VHOST", 1)
        info(opts, f'Deleting vhost "{name}" ...')
        client.call("DELETE", f"vhosts/{q(name)}")
    elif c == "set_permissions":
        user, conf, write, read = _need(opts, 4, "[-p VHOST] USER CONF WRITE READ", 4)
        info(opts, f'Setting permissions for user "{user}" in vhost "{v}" ...')
        client.call("PUT", f"permissions/{q(v)}/{q(user)}", {"configure": conf, "write": write, "read": read})
    elif c == "clear_permissions":
        (user,) = _need(opts, 1, "[-p VHOST] USER", 1)
        info(opts, f'Clearing permissions for user "{user}" in vhost "{v}" ...')
        client.call("DELETE", f"permissions/{q(v)}/{q(user)}")
    elif c == "set_topic_permissions":
        user, exchange, write, read = _need(opts, 4, "[-p VHOST] USER EXCHANGE WRITE READ", 4)
        info(opts, f'Setting topic permissions on "{exchange}" for user "{user}" in vhost "{v}" ...')
        client.call("PUT", f"topic-permissions/{q(v)}/{q(user)}",
                    {"exchange": exchange, "write": write, "read": read})


def _policies(client: Client, opts: Options) -> None:
    c, v = opts.command, opts.vhost
    kind = "operator-policies" if "operator" in c else "policies"
    if c in ("set_policy", "set_operator_policy"):
        name, pattern, definition = _need(opts, 3, "[-p VHOST] [--priority N] [--apply-to KIND] NAME PATTERN "
                                                   "DEFINITION", 3)
        info(opts, f'Setting policy "{name}" for pattern "{pattern}" to "{definition}" with priority '
                   f'"{opts.priority}" for vhost "{v}" ...')
        client.call("PUT", f"{kind}/{q(v)}/{q(name)}", {
            "pattern": pattern, "definition": _json(definition, "DEFINITION"), "priority": opts.priority,
            "apply-to": opts.apply_to})
    else:
        (name,) = _need(opts, 1, "[-p VHOST] NAME", 1)
        info(opts, f'Clearing policy "{name}" on vhost "{v}" ...')
        client.call("DELETE", f"{kind}/{q(v)}/{q(name)}")


def _definitions(client: Client, opts: Options) -> None:
    (path,) = _need(opts, 1, "FILE (- for standard output / input)", 1)
    if opts.command == "export_definitions":
        data = json.dumps(client.call("GET", "definitions"), indent=2)
        if path == "-":
            print(data)
            return
        info(opts, f"Exporting definitions in JSON to a file at \"{path}\" ...")
        with open(path, "w") as f:
            f.write(data)
        return
    info(opts, f"Importing definitions in JSON from a file at \"{path}\" ...")
    try:
        text = sys.stdin.read() if path == "-" else open(path).read()
    except OSError as exc:
        raise CtlError(f"{path}: {exc.strerror or exc}", EX_DATAERR) from None
    client.call("POST", "definitions", _json(text, path))
    info(opts, "Successfully started definition import. This process is asynchronous and can take some time.")


def _queues_and_connections(client: Client, opts: Options) -> None:
    c, v = opts.command, opts.vhost
    if c == "close_connection":
        name, reason = _need(opts, 2, "CONNECTION EXPLANATION", 2)
        info(opts, f'Closing connection {name}, reason: {reason}...')
        client.call("DELETE", "connections/" + q(_connection_name(client, name)), headers={"X-Reason": reason})
    elif c == "close_all_connections":
        (reason,) = _need(opts, 1, "EXPLANATION", 1)
        for conn in client.call("GET", "connections" if "-p" not in opts.given and "--vhost" not in opts.given
                                else f"vhosts/{q(v)}/connections"):
            client.call("DELETE", "connections/" + q(conn["name"]), headers={"X-Reason": reason})
    elif c == "purge_queue":
        (name,) = _need(opts, 1, "[-p VHOST] QUEUE", 1)
        info(opts, f'Purging queue \'{name}\' in vhost \'{v}\' ...')
        client.call("DELETE", f"queues/{q(v)}/{q(name)}/contents")
    elif c == "delete_queue":
        (name,) = _need(opts, 1, "[-p VHOST] QUEUE [--if-empty] [--if-unused]", 1)
        info(opts, f"Deleting queue '{name}' on vhost '{v}' ...")
        flags = "&".join(f"{f}=true" for f, on in (("if-empty", opts.if_empty), ("if-unused", opts.if_unused)) if on)
        client.call("DELETE", f"queues/{q(v)}/{q(name)}" + (f"?{flags}" if flags else ""))
    elif c == "list_unresponsive_queues":
        # Every queue is served by its node's one event loop: none is busy while the API answers.
        info(opts, f"Listing unresponsive queues for vhost {v} ...")
        client.call("GET", f"queues/{q(v)}?columns=name")
        print_table([], _columns_plain(opts, ("name",)), opts)


def _columns_plain(opts: Options, default: tuple[str, ...]) -> list[str]:
    return [c for arg in opts.args for c in arg.split(",") if c] or list(default)


def _parameters(client: Client, opts: Options) -> None:
    c, v = opts.command, opts.vhost
    if c == "set_parameter":
        component, name, value = _need(opts, 3, "[-p VHOST] COMPONENT NAME VALUE", 3)
        info(opts, f'Setting runtime parameter "{name}" for component "{component}" to "{value}" in vhost "{v}" ...')
        client.call("PUT", f"parameters/{q(component)}/{q(v)}/{q(name)}", {"value": _json(value, "VALUE")})
    elif c == "clear_parameter":
        component, name = _need(opts, 2, "[-p VHOST] COMPONENT NAME", 2)
        info(opts, f'Clearing runtime parameter "{name}" for component "{component}" on vhost "{v}" ...')
        client.call("DELETE", f"parameters/{q(component)}/{q(v)}/{q(name)}")
    elif c == "list_parameters":
        info(opts, f'Listing runtime parameters for vhost "{v}" ...')
        items = [i for i in client.call("GET", "parameters") if i["vhost"] == v]
        print_table(items, _columns_plain(opts, ("component", "name", "value")), opts)
    elif c == "restart_shovel":
        (name,) = _need(opts, 1, "[-p VHOST] NAME", 1)
        client.call("DELETE", f"shovels/vhost/{q(v)}/{q(name)}/restart")
    elif c == "shovel_status":
        info(opts, "Shovel status on node ...")
        print_table(client.call("GET", "shovels"), _columns_plain(opts, ("name", "vhost", "type", "state", "node",
                                                                          "reason")), opts)
    elif c == "federation_status":
        print_table(client.call("GET", "federation-links"), _columns_plain(opts, (
            "exchange", "upstream", "vhost", "status", "node", "uri", "error")), opts)


def _node(client: Client, opts: Options) -> None:
    c = opts.command
    if c == "status":
        _status(client, opts)
    elif c == "cluster_status":
        overview, nodes = client.call("GET", "overview"), client.call("GET", "nodes")
        info(opts, f"Cluster status of node {overview['node']} ...")
        print(json.dumps({"cluster_name": overview["cluster_name"],
                          "disk_nodes": [n["name"] for n in nodes],
                          "running_nodes": [n["name"] for n in nodes if n.get("running")],
                          "alarms": [n["name"] for n in nodes if n.get("mem_alarm")]},
                         indent=None if opts.formatter == "json" else 2))
    elif c == "set_cluster_name":
        (name,) = _need(opts, 1, "NAME", 1)
        info(opts, f"Setting cluster name to {name} ...")
        client.call("PUT", "cluster-name", {"name": name})
    elif c == "environment":
        info(opts, f"Application environment of node {_node_name(client)} ...")
        print(json.dumps(client.call("GET", "leveret/environment"), indent=None if opts.formatter == "json" else 2))
    elif c == "list_feature_flags":
        info(opts, "Listing feature flags ...")
        print_table(client.call("GET", "feature-flags"), _columns_plain(opts, ("name", "state")), opts)
    elif c == "rotate_logs":
        # The node writes its log to standard error: whatever collects it (journald, Docker) rotates it.
        info(opts, f"Rotating logs for node {_node_name(client)} ...")
    elif c == "await_startup":
        _await_startup(client, opts)
    elif c == "authenticate_user":
        _authenticate(client, opts)
    elif c == "report":
        _report(client, opts)
    elif c == "node_health_check":
        _node_health_check(client, opts)
    elif c == "set_vm_memory_high_watermark":
        _set_watermark(client, opts)
    elif c == "set_disk_free_limit":
        _set_disk_free_limit(client, opts)


def _backup_and_restore(client: Client, opts: Options) -> None:
    backup.main(client, opts.command, opts.args)


HANDLERS: dict[str, Callable[[Client, Options], Any]] = {
    **{c: _list for c in LISTS},
    **{c: _users_and_vhosts for c in ("add_user", "delete_user", "change_password", "set_user_tags",
                                      "list_user_permissions", "add_vhost", "delete_vhost", "set_permissions",
                                      "clear_permissions", "set_topic_permissions")},
    **{c: _limits for c in ("set_vhost_limits", "clear_vhost_limits", "list_vhost_limits", "set_user_limits",
                            "clear_user_limits", "list_user_limits")},
    **{c: _policies for c in ("set_policy", "clear_policy", "set_operator_policy", "clear_operator_policy")},
    **{c: _definitions for c in ("export_definitions", "import_definitions")},
    **{c: _queues_and_connections for c in ("close_connection", "close_all_connections", "purge_queue",
                                            "delete_queue", "list_unresponsive_queues")},
    **{c: _parameters for c in ("set_parameter", "clear_parameter", "list_parameters", "restart_shovel",
                                "shovel_status", "federation_status")},
    **{c: _global_parameters for c in ("list_global_parameters", "set_global_parameter", "clear_global_parameter")},
    **{c: _node for c in ("status", "cluster_status", "set_cluster_name", "environment", "list_feature_flags",
                          "rotate_logs", "await_startup", "authenticate_user", "report", "node_health_check",
                          "set_vm_memory_high_watermark", "set_disk_free_limit")},
    **{c: _backup_and_restore for c in backup.COMMANDS},
}
COMMANDS = tuple(HANDLERS)

USAGE = """usage: leveret ctl [-n HOST:PORT] [--username U] [--password P] [-p VHOST] [-q] [-s] [--no-table-headers]
                   [-t SECONDS] [--formatter table|json] COMMAND [ARGS...]

rabbitmqctl's commands over a node's management API (default 127.0.0.1:15672, guest/guest;
env LEVERET_CTL_NODE, LEVERET_CTL_USERNAME, LEVERET_CTL_PASSWORD). Commands:
  """


def usage() -> str:
    return USAGE + "\n  ".join(", ".join(COMMANDS[i:i + 6]) for i in range(0, len(COMMANDS), 6))


def run(argv: list[str]) -> int:
    """Parse rabbitmqctl's command line and run it: rabbitmqctl's exit codes."""
    try:
        opts = ctl_args.parse(argv, COMMANDS)
    except UsageError as exc:
        print(f"Error (argument validation): {exc}\nArguments given:\n\t{' '.join(argv)}\n\n{usage()}",
              file=sys.stderr)
        return EX_USAGE
    if opts.help:
        print(usage())
        return 0
    client = Client(opts.node, opts.username, opts.password, opts.timeout or DEFAULT_TIMEOUT)
    try:
        HANDLERS[opts.command](client, opts)
        return 0
    except UsageError as exc:
        print(f"Error (argument validation): {exc}\nArguments given:\n\t{' '.join(argv)}", file=sys.stderr)
        return EX_USAGE
    except CtlError as exc:
        print(f"Error:\n{exc}", file=sys.stderr)
        return exc.code
    except BrokenPipeError:
        return 0


# -- `leveret ctl ...`: the whole command line after "ctl" is rabbitmqctl's, parsed by run()
def add_parser(sub: Any) -> None:
    ctl = sub.add_parser("ctl", add_help=False, help="rabbitmqctl's commands against a running node (over its "
                                                     "management API); `leveret ctl --help` lists them")
    ctl.add_argument("ctl_argv", nargs=argparse.REMAINDER)


def _hoist_options(argv: list[str]) -> list[str]:
    """``leveret ctl ...``: hand everything after ``ctl`` to run() untouched ("--" stops argparse).
    ``leveret diagnostics ...``: a command line it refuses exits 64 here, as rabbitmq-diagnostics."""
    if argv and argv[0] == "ctl":
        return ["ctl", "--", *argv[1:]]
    if argv and argv[0] == "diagnostics" and not {"-h", "--help"} & set(argv):
        from leveret.cli import diagnostics

        diagnostics.check_command_line(argv[1:])
    return argv


def main(args: argparse.Namespace) -> int:
    argv = list(args.ctl_argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    return run(argv)


def rabbitmqctl_main() -> int:
    """The ``leveret-rabbitmqctl`` entry point: rabbitmqctl's command lines unchanged."""
    return run(sys.argv[1:])
