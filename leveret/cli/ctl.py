"""``leveret ctl``: rabbitmqctl's commands, over a running node's management API.

Command names and argument order are rabbitmqctl's, so a script ports by
changing the program name. Every change goes through the HTTP API and so
applies to the running node at once. Output is tab-separated with a header
line, as rabbitmqctl prints (``--quiet``/``-q`` drops the header,
``--formatter json`` prints JSON).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import quote

from leveret.cli import backup

DEFAULT_NODE = "127.0.0.1:15672"

# Default columns per list command (rabbitmqctl's defaults).
LISTS: dict[str, tuple[str, tuple[str, ...], bool]] = {
    # command: (API path, default columns, per vhost)
    "list_queues": ("queues", ("name", "messages"), True),
    "list_exchanges": ("exchanges", ("name", "type"), True),
    "list_bindings": ("bindings", ("source_name", "source_kind", "destination_name", "destination_kind",
                                   "routing_key", "arguments"), True),
    "list_connections": ("connections", ("user", "peer_host", "peer_port", "state"), False),
    "list_channels": ("channels", ("pid", "user", "consumer_count", "messages_unacknowledged"), False),
    "list_consumers": ("consumers", ("queue_name", "channel_pid", "consumer_tag", "ack_required",
                                     "prefetch_count", "active", "arguments"), True),
    "list_users": ("users", ("user", "tags"), False),
    "list_vhosts": ("vhosts", ("name",), False),
    "list_permissions": ("permissions", ("user", "configure", "write", "read"), True),
    "list_policies": ("policies", ("vhost", "name", "pattern", "apply-to", "definition", "priority"), True),
}

# rabbitmqctl's column names that differ from the API's fields.
ALIASES = {
    "source_name": "source", "source_kind": "_source_kind", "destination_name": "destination",
    "destination_kind": "destination_type", "user": "user", "pid": "name", "channel_pid": "channel_details.name",
    "queue_name": "queue.name",
}


class CtlError(Exception):
    pass


class Client:
    def __init__(self, node: str, username: str, password: str, timeout: float = 30.0) -> None:
        self.base = node if node.startswith(("http://", "https://")) else f"http://{node}"
        token = base64.b64encode(f"{username}:{password}".encode()).decode()
        self.headers = {"Authorization": f"Basic {token}", "Content-Type": "application/json"}
        self.timeout = timeout

    def call(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> Any:
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
            except ValueError:
                reason = text
            raise CtlError(f"{method} /api/{path}: {exc.code} {reason}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise CtlError(f"cannot reach the node's management API at {self.base}: "
                           f"{getattr(exc, 'reason', exc)}") from None
        return json.loads(raw) if raw.strip() else None


def q(name: str) -> str:
    return quote(name, safe="")


def _value(item: dict[str, Any], column: str) -> Any:
    field = ALIASES.get(column, column)
    if field == "_source_kind":
        return "exchange"
    value: Any = item
    for part in field.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if column == "user" and value is None:
        value = item.get("name")
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


def print_table(items: list[dict[str, Any]], columns: list[str], args: argparse.Namespace) -> None:
    if args.formatter == "json":
        print(json.dumps([{c: _value(i, c) for c in columns} for i in items]))
        return
    if not args.quiet:
        print("\t".join(columns))
    for item in items:
        print("\t".join(_text(_value(item, c)) for c in columns))


def _list(client: Client, command: str, args: argparse.Namespace) -> int:
    path, default_columns, per_vhost = LISTS[command]
    if command == "list_permissions":
        path = f"vhosts/{q(args.vhost)}/permissions"
    elif per_vhost:
        path += "/" + q(args.vhost)
    if command == "list_users":
        columns = list(args.rest) or list(default_columns)
        items = [dict(u, user=u["name"]) for u in client.call("GET", path)]
    else:
        columns = list(args.rest) or list(default_columns)
        items = client.call("GET", path)
    print_table(items, columns, args)
    return 0


def _need(args: argparse.Namespace, n: int, usage: str) -> list[str]:
    if len(args.rest) < n:
        raise CtlError(f"usage: leveret ctl {args.ctl_command} {usage}")
    return list(args.rest)


def _connection_name(client: Client, wanted: str) -> str:
    """rabbitmqctl takes a connection pid; here the API's name, or a unique part of it (e.g. the peer port)."""
    names = [c["name"] for c in client.call("GET", "connections")]
    if wanted in names:
        return wanted
    matches = [n for n in names if wanted in n]
    if len(matches) != 1:
        raise CtlError(f"no single connection matches {wanted!r} (open: {', '.join(names) or 'none'})")
    return matches[0]


def _json_object(text: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise CtlError(f"{what} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise CtlError(f"{what} must be a JSON object, e.g. '{{\"max-connections\": 10}}'")
    return value


def _limits(client: Client, args: argparse.Namespace) -> None:
    """rabbitmqctl's set/clear/list_vhost_limits and set/clear/list_user_limits, one API call per limit."""
    c, v = args.ctl_command, args.vhost
    if c == "set_vhost_limits":
        (text,) = _need(args, 1, "[-p VHOST] '{\"max-connections\": N, \"max-queues\": N}'")[:1]
        for name, value in _json_object(text, "LIMITS").items():
            client.call("PUT", f"vhost-limits/{q(v)}/{q(name)}", {"value": value})
    elif c == "clear_vhost_limits":
        for entry in client.call("GET", f"vhost-limits/{q(v)}"):
            for name in entry["value"]:
                client.call("DELETE", f"vhost-limits/{q(v)}/{q(name)}")
    elif c == "list_vhost_limits":
        print(json.dumps(client.call("GET", f"vhost-limits/{q(v)}")))
    elif c == "set_user_limits":
        user, text = _need(args, 2, "USER '{\"max-connections\": N, \"max-channels\": N}'")[:2]
        for name, value in _json_object(text, "LIMITS").items():
            client.call("PUT", f"user-limits/{q(user)}/{q(name)}", {"value": value})
    elif c == "clear_user_limits":
        user, which = _need(args, 2, "USER LIMIT_NAME|all")[:2]
        names = ([n for e in client.call("GET", f"user-limits/{q(user)}") for n in e["value"]]
                 if which == "all" else [which])
        for name in names:
            client.call("DELETE", f"user-limits/{q(user)}/{q(name)}")
    else:
        print(json.dumps(client.call("GET", f"user-limits/{q(args.rest[0])}" if args.rest else "user-limits")))


def run_command(client: Client, args: argparse.Namespace) -> int:
    c, v = args.ctl_command, args.vhost
    if c in LISTS:
        return _list(client, c, args)
    if c == "close_connection":
        name, reason = _need(args, 2, "CONNECTION EXPLANATION")[:2]
        client.call("DELETE", "connections/" + q(_connection_name(client, name)), headers={"X-Reason": reason})
    elif c == "purge_queue":
        (name,) = _need(args, 1, "[-p VHOST] QUEUE")[:1]
        client.call("DELETE", f"queues/{q(v)}/{q(name)}/contents")
    elif c == "delete_queue":
        (name,) = _need(args, 1, "[-p VHOST] QUEUE [--if-empty] [--if-unused]")[:1]
        flags = "&".join(f"{f}=true" for f, on in (("if-empty", args.if_empty), ("if-unused", args.if_unused)) if on)
        client.call("DELETE", f"queues/{q(v)}/{q(name)}" + (f"?{flags}" if flags else ""))
    elif c == "add_user":
        name, password = _need(args, 2, "USER PASSWORD")[:2]
        client.call("PUT", f"users/{q(name)}", {"password": password, "tags": ""})
    elif c == "delete_user":
        (name,) = _need(args, 1, "USER")[:1]
        client.call("DELETE", f"users/{q(name)}")
    elif c == "change_password":
        name, password = _need(args, 2, "USER NEW_PASSWORD")[:2]
        user = client.call("GET", f"users/{q(name)}")
        client.call("PUT", f"users/{q(name)}", {"password": password, "tags": user.get("tags", [])})
    elif c == "set_user_tags":
        rest = _need(args, 1, "USER [TAG ...]")
        user = client.call("GET", f"users/{q(rest[0])}")
        client.call("PUT", f"users/{q(rest[0])}", {"password_hash": user["password_hash"],
                                                  "hashing_algorithm": user["hashing_algorithm"],
                                                  "tags": rest[1:]})
    elif c == "add_vhost":
        (name,) = _need(args, 1, "VHOST")[:1]
        client.call("PUT", f"vhosts/{q(name)}", {})
    elif c == "delete_vhost":
        (name,) = _need(args, 1, "VHOST")[:1]
        client.call("DELETE", f"vhosts/{q(name)}")
    elif c == "set_permissions":
        user, conf, write, read = _need(args, 4, "[-p VHOST] USER CONF WRITE READ")[:4]
        client.call("PUT", f"permissions/{q(v)}/{q(user)}", {"configure": conf, "write": write, "read": read})
    elif c == "clear_permissions":
        (user,) = _need(args, 1, "[-p VHOST] USER")[:1]
        client.call("DELETE", f"permissions/{q(v)}/{q(user)}")
    elif c == "set_topic_permissions":
        user, exchange, write, read = _need(args, 4, "[-p VHOST] USER EXCHANGE WRITE READ")[:4]
        client.call("PUT", f"topic-permissions/{q(v)}/{q(user)}",
                    {"exchange": exchange, "write": write, "read": read})
    elif c == "set_policy":
        name, pattern, definition = _need(args, 3, "[-p VHOST] [--priority N] [--apply-to KIND] NAME PATTERN "
                                                   "DEFINITION")[:3]
        try:
            parsed = json.loads(definition)
        except ValueError as exc:
            raise CtlError(f"DEFINITION is not JSON: {exc}") from None
        client.call("PUT", f"policies/{q(v)}/{q(name)}", {"pattern": pattern, "definition": parsed,
                                                          "priority": args.priority, "apply-to": args.apply_to})
    elif c == "clear_policy":
        (name,) = _need(args, 1, "[-p VHOST] NAME")[:1]
        client.call("DELETE", f"policies/{q(v)}/{q(name)}")
    elif c in ("set_vhost_limits", "clear_vhost_limits", "list_vhost_limits", "set_user_limits",
               "clear_user_limits", "list_user_limits"):
        _limits(client, args)
    elif c == "set_parameter":
        component, name, value = _need(args, 3, "[-p VHOST] COMPONENT NAME VALUE")[:3]
        try:
            parsed = json.loads(value)
        except ValueError as exc:
            raise CtlError(f"VALUE is not JSON: {exc}") from None
        client.call("PUT", f"parameters/{q(component)}/{q(v)}/{q(name)}", {"value": parsed})
    elif c == "clear_parameter":
        component, name = _need(args, 2, "[-p VHOST] COMPONENT NAME")[:2]
        client.call("DELETE", f"parameters/{q(component)}/{q(v)}/{q(name)}")
    elif c == "list_parameters":
        items = [i for i in client.call("GET", "parameters") if i["vhost"] == v]
        print_table(items, list(args.rest) or ["component", "name", "value"], args)
    elif c == "restart_shovel":
        (name,) = _need(args, 1, "[-p VHOST] NAME")[:1]
        client.call("DELETE", f"shovels/vhost/{q(v)}/{q(name)}/restart")
    elif c == "shovel_status":
        print_table(client.call("GET", "shovels"), list(args.rest) or ["name", "vhost", "type", "state", "node",
                                                                        "reason"], args)
    elif c == "federation_status":
        print_table(client.call("GET", "federation-links"), list(args.rest) or [
            "exchange", "upstream", "vhost", "status", "node", "uri", "error"], args)
    elif c == "set_cluster_name":
        (name,) = _need(args, 1, "NAME")[:1]
        client.call("PUT", "cluster-name", {"name": name})
    elif c == "export_definitions":
        (path,) = _need(args, 1, "FILE (- for standard output)")[:1]
        data = json.dumps(client.call("GET", "definitions"), indent=2)
        if path == "-":
            print(data)
        else:
            with open(path, "w") as f:
                f.write(data)
    elif c == "import_definitions":
        (path,) = _need(args, 1, "FILE (- for standard input)")[:1]
        text = sys.stdin.read() if path == "-" else open(path).read()
        try:
            definitions = json.loads(text)
        except ValueError as exc:
            raise CtlError(f"{path} is not JSON: {exc}") from None
        client.call("POST", "definitions", definitions)
    elif c == "status":
        overview, nodes = client.call("GET", "overview"), client.call("GET", "nodes")
        print(json.dumps({"node": overview["node"], "product": overview["product_name"],
                          "version": overview["product_version"], "listeners": overview["listeners"],
                          "alarms": [n["name"] for n in nodes if n.get("mem_alarm")],
                          "memory_used": nodes[0]["mem_used"] if nodes else None,
                          "totals": overview["object_totals"], "queue_totals": overview["queue_totals"]}, indent=2))
    elif c == "cluster_status":
        overview, nodes = client.call("GET", "overview"), client.call("GET", "nodes")
        print(json.dumps({"cluster_name": overview["cluster_name"],
                          "disk_nodes": [n["name"] for n in nodes],
                          "running_nodes": [n["name"] for n in nodes if n.get("running")],
                          "alarms": [n["name"] for n in nodes if n.get("mem_alarm")]}, indent=2))
    else:
        raise CtlError(f"unknown command {c!r}; commands: {', '.join(COMMANDS)}")
    return 0


COMMANDS = (*LISTS, "close_connection", "purge_queue", "delete_queue", "add_user", "delete_user",
            "change_password", "set_user_tags", "add_vhost", "delete_vhost", "set_permissions",
            "clear_permissions", "set_topic_permissions", "set_vhost_limits", "clear_vhost_limits",
            "list_vhost_limits", "set_user_limits", "clear_user_limits", "list_user_limits", "set_policy",
            "clear_policy", "set_parameter", "clear_parameter", "list_parameters", "shovel_status", "restart_shovel",
            "federation_status", "set_cluster_name", "export_definitions",
            "import_definitions", "status", "cluster_status", *backup.COMMANDS)


def add_parser(sub: Any) -> None:
    ctl = sub.add_parser(
        "ctl", help="rabbitmqctl-style commands against a running node (over its management API)",
        description="rabbitmqctl's commands and argument order, sent to a running node's management API. "
        f"Commands: {', '.join(COMMANDS)}.")
    ctl.add_argument("--node", "-n", default=os.environ.get("LEVERET_CTL_NODE", DEFAULT_NODE),
                     help="HOST:PORT of the management API (env LEVERET_CTL_NODE; default %(default)s)")
    ctl.add_argument("--username", default=os.environ.get("LEVERET_CTL_USERNAME", "guest"),
                     help="env LEVERET_CTL_USERNAME; default guest")
    ctl.add_argument("--password", default=os.environ.get("LEVERET_CTL_PASSWORD", "guest"),
                     help="env LEVERET_CTL_PASSWORD; default guest")
    ctl.add_argument("--vhost", "-p", default="/", help="virtual host (default /)")
    ctl.add_argument("--quiet", "-q", action="store_true", help="no header line in lists")
    ctl.add_argument("--formatter", choices=["table", "json"], default="table")
    ctl.add_argument("--priority", type=int, default=0, help="set_policy: the policy's priority")
    ctl.add_argument("--apply-to", default="all", help="set_policy: queues, exchanges or all")
    ctl.add_argument("--if-empty", action="store_true", help="delete_queue: only when empty")
    ctl.add_argument("--if-unused", action="store_true", help="delete_queue: only without consumers")
    ctl.add_argument("ctl_command", metavar="COMMAND", choices=COMMANDS)
    ctl.add_argument("rest", nargs=argparse.REMAINDER, metavar="ARG")


def _hoist_options(argv: list[str]) -> list[str]:
    """rabbitmqctl accepts -p VHOST (and its other flags) after the command name too."""
    if not argv or argv[0] != "ctl":
        return argv
    head, tail = argv[:1], argv[1:]
    opts: list[str] = []
    rest: list[str] = []
    with_value = {"-p", "--vhost", "--priority", "--apply-to", "--formatter", "-n", "--node", "--username",
                  "--password"}
    it = iter(tail)
    for arg in it:
        if arg in with_value:
            opts += [arg, next(it, "")]
        elif arg.split("=", 1)[0] in with_value and "=" in arg:
            opts.append(arg)
        elif arg in ("-q", "--quiet", "--if-empty", "--if-unused"):
            opts.append(arg)
        else:
            rest.append(arg)
    return head + opts + rest


def main(args: argparse.Namespace) -> int:
    client = Client(args.node, args.username, args.password)
    try:
        if args.ctl_command in backup.COMMANDS:
            return backup.main(client, args)
        return run_command(client, args)
    except CtlError as exc:
        print(f"leveret ctl: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0
