"""The etcd key layout of a cluster (docs/CLUSTER.md) and the JSON values under it.

    /leveret/<cluster>/nodes/<node>                       on the node's lease:
        {id, amqp, grpc, cluster, cluster_remote, region, lease, queues, draining, started}
    /leveret/<cluster>/meta/vhosts/<vhost>                {}
    /leveret/<cluster>/meta/users/<user>                  {salt, hash, tags, vhosts, loopback_only, permissions}
    /leveret/<cluster>/meta/exchanges/<vhost>/<name>      {type, durable, auto_delete, internal, arguments}
    /leveret/<cluster>/meta/queues/<vhost>/<name>         {durable, exclusive, auto_delete, arguments, node, region}
    /leveret/<cluster>/meta/bindings/<vhost>/<source>/<kind>/<destination>/<digest>  {routing_key, arguments}
    /leveret/<cluster>/owners/<vhost>/<queue>             <node>  on the owner's lease; create revision = epoch
    /leveret/<cluster>/meta/policies/<vhost>/<policy|operator>/<name>   {pattern, definition, apply_to, priority}
    /leveret/<cluster>/meta/parameters/<vhost>/<component>/<name>       {value}  (global ones: vhost "")
    /leveret/<cluster>/drain/<node>                       asks a live node to hand its queues over
    /leveret/<cluster>/<kind>/<vhost>/<name>              <node>  on the holder's lease: a named hold
                                                          (kind: shovels, federation)

Every name is percent-encoded (``urllib.parse.quote(name, safe="")``), so
``/`` in a vhost or queue name never splits a key. Arguments are AMQP field
tables (core/fieldtable.py), base64 in the JSON, so nothing is lost.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

from core.model import fieldtable


def q(name: str) -> str:
    return quote(name, safe="")


def encode_args(arguments: dict[str, Any]) -> str:
    return base64.b64encode(fieldtable.encode_table(arguments)).decode()


def decode_args(text: str) -> dict[str, Any]:
    if not text:
        return {}
    table, _ = fieldtable.decode_table(base64.b64decode(text))
    return dict(table)


def dumps(value: dict[str, Any]) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def user_value(user: Any) -> bytes:
    """A user's record under meta/users/ (a core.engine.broker.User: salted hash, never the password)."""
    return dumps({"salt": user.salt.hex(), "hash": user.password_hash.hex(), "tags": list(user.tags),
                  "vhosts": sorted(user.vhosts), "loopback_only": user.loopback_only,
                  "permissions": user.grants_record()})


def policy_value(policy: Any) -> bytes:
    """A policy's record under meta/policies/ (a core.model.policy.Policy)."""
    return dumps({"pattern": policy.pattern, "definition": policy.definition, "apply_to": policy.apply_to,
                  "priority": policy.priority})


def loads(raw: bytes) -> dict[str, Any]:
    value = json.loads(raw) if raw else {}
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class Key:
    """A parsed key under the cluster prefix: its section and its (decoded) parts."""

    section: str  # nodes, vhosts, users, exchanges, queues, bindings, policies, parameters, owners, drain, holds
    parts: tuple[str, ...]


class Layout:
    def __init__(self, cluster: str) -> None:
        self.prefix = f"/leveret/{q(cluster)}/"

    def _k(self, *parts: str) -> bytes:
        return (self.prefix + "/".join(parts)).encode()

    def node(self, node: str) -> bytes:
        return self._k("nodes", q(node))

    def vhost(self, vhost: str) -> bytes:
        return self._k("meta", "vhosts", q(vhost))

    def user(self, name: str) -> bytes:
        return self._k("meta", "users", q(name))

    def exchange(self, vhost: str, name: str) -> bytes:
        return self._k("meta", "exchanges", q(vhost), q(name))

    def queue(self, vhost: str, name: str) -> bytes:
        return self._k("meta", "queues", q(vhost), q(name))

    def binding(
        self, vhost: str, source: str, kind: str, dest: str, routing_key: str, arguments: dict[str, Any]
    ) -> bytes:
        digest = hashlib.sha1(routing_key.encode() + b"\0" + encode_args(arguments).encode()).hexdigest()[:20]
        return self._k("meta", "bindings", q(vhost), q(source), kind, q(dest), digest)

    def bindings_from(self, vhost: str, source: str) -> bytes:
        return self._k("meta", "bindings", q(vhost), q(source)) + b"/"

    def policy(self, vhost: str, name: str, operator: bool) -> bytes:
        return self._k("meta", "policies", q(vhost), "operator" if operator else "policy", q(name))

    def parameter(self, vhost: str, component: str, name: str) -> bytes:
        return self._k("meta", "parameters", q(vhost), q(component), q(name))

    def hold(self, kind: str, vhost: str, name: str) -> bytes:
        return self._k(q(kind), q(vhost), q(name))

    def owner(self, vhost: str, name: str) -> bytes:
        return self._k("owners", q(vhost), q(name))

    def drain(self, node: str) -> bytes:
        return self._k("drain", q(node))

    def parse(self, raw: bytes) -> Key | None:
        text = raw.decode()
        if not text.startswith(self.prefix):
            return None
        parts = text[len(self.prefix):].split("/")
        if parts[0] == "meta" and len(parts) >= 2:
            return Key(parts[1], tuple(unquote(p) for p in parts[2:]))
        return Key(parts[0], tuple(unquote(p) for p in parts[1:]))
