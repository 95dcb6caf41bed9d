"""rabbitmqctl's command line: global flags before or after the command, per-command options, EX_USAGE.

rabbitmqctl refuses an option it does not know for a command (exit 64,
EX_USAGE) instead of taking it as an argument; so does this parser, so a
``--no-table-headers`` or ``-t 10`` is never read as a column name.
``--`` ends the options (for an argument that starts with ``-``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

EX_OK = 0
EX_USAGE = 64  # a command line rabbitmqctl refuses
EX_DATAERR = 65  # bad input (a 400), failed authentication
EX_NOUSER = 67  # the user named does not exist
EX_UNAVAILABLE = 69  # the node cannot be reached, or what was named does not exist
EX_SOFTWARE = 70  # it exists already
EX_TEMPFAIL = 75  # timed out
EX_NOPERM = 77  # the API refused (401/403)

DEFAULT_NODE = "127.0.0.1:15672"


class UsageError(Exception):
    """The command line is wrong: printed with the usage, exit 64."""


@dataclass
class Options:
    node: str = field(default_factory=lambda: os.environ.get("LEVERET_CTL_NODE", DEFAULT_NODE))
    username: str = field(default_factory=lambda: os.environ.get("LEVERET_CTL_USERNAME", "guest"))
    password: str = field(default_factory=lambda: os.environ.get("LEVERET_CTL_PASSWORD", "guest"))
    vhost: str = "/"
    quiet: bool = False  # no informational lines ("Listing queues ..."); the table header stays
    silent: bool = False  # -s: quiet, and no table header either
    no_table_headers: bool = False
    timeout: float | None = None  # seconds for each request (and await_startup's wait)
    formatter: str = "table"
    help: bool = False
    priority: int = 0
    apply_to: str = "all"
    if_empty: bool = False
    if_unused: bool = False
    global_: bool = False
    all_: bool = False
    command: str = ""
    args: list[str] = field(default_factory=list)
    given: set[str] = field(default_factory=set)  # the options the command line named

    @property
    def headers(self) -> bool:
        return not (self.silent or self.no_table_headers)

    @property
    def informative(self) -> bool:
        return not (self.quiet or self.silent)


# Options every command takes: flag -> (attribute, takes a value).
GLOBAL: dict[str, tuple[str, bool]] = {
    "-n": ("node", True), "--node": ("node", True),
    "-p": ("vhost", True), "--vhost": ("vhost", True),
    "-t": ("timeout", True), "--timeout": ("timeout", True),
    "--formatter": ("formatter", True),
    "--username": ("username", True), "--password": ("password", True),
    "-q": ("quiet", False), "--quiet": ("quiet", False),
    "-s": ("silent", False), "--silent": ("silent", False),
    "--no-table-headers": ("no_table_headers", False),
    "-h": ("help", False), "--help": ("help", False),
    # Erlang distribution settings: Leveret's CLI speaks HTTP, so they have nothing to set.
    "-l": ("", False), "--longnames": ("", False), "--erlang-cookie": ("", True),
}

# Options only some commands take (rabbitmqctl's; an option another command takes is an error here).
PER_COMMAND: dict[str, dict[str, tuple[str, bool]]] = {
    "set_policy": {"--priority": ("priority", True), "--apply-to": ("apply_to", True)},
    "set_operator_policy": {"--priority": ("priority", True), "--apply-to": ("apply_to", True)},
    "delete_queue": {"--if-empty": ("if_empty", False), "-e": ("if_empty", False),
                     "--if-unused": ("if_unused", False), "-u": ("if_unused", False)},
    # Every Leveret queue is online and local to the node that serves it: the filters select all.
    "list_queues": {"--online": ("", False), "--offline": ("", False), "--local": ("", False)},
    "list_vhost_limits": {"--global": ("global_", False)},
    "list_user_limits": {"--all": ("all_", False), "--user": ("", True)},
    "list_unresponsive_queues": {"--local": ("", False), "--queue-timeout": ("", True)},
}

FORMATTERS = ("table", "json")


def parse(argv: list[str], commands: tuple[str, ...]) -> Options:
    """rabbitmqctl's command line. Raises UsageError for what rabbitmqctl would refuse."""
    opts = Options()
    positional: list[str] = []
    it = iter(argv)
    ended = False
    for arg in it:
        if ended or not arg.startswith("-") or arg == "-" or _is_number(arg):
            if not opts.command and not ended:
                opts.command = arg
            else:
                positional.append(arg)
            continue
        if arg == "--":
            ended = True
            continue
        name, eq, inline = arg.partition("=")
        known = {**GLOBAL, **PER_COMMAND.get(opts.command, {})}
        if name not in known:
            if any(name in per for per in PER_COMMAND.values()) and not opts.command:
                known = {name: next(per[name] for per in PER_COMMAND.values() if name in per)}  # before the command
            else:
                where = f" for {opts.command}" if opts.command else ""
                raise UsageError(f"Invalid options{where}: {name}")
        attr, takes_value = known[name]
        if takes_value:
            value = inline if eq else next(it, None)
            if value is None:
                raise UsageError(f"option {name} needs a value")
            _set(opts, attr, name, value)
        elif eq:
            raise UsageError(f"option {name} takes no value")
        elif attr:
            setattr(opts, attr, True)
        opts.given.add(name)
    opts.args = positional
    if opts.help:
        return opts
    if not opts.command:
        raise UsageError("no command given")
    if opts.command not in commands:
        raise UsageError(f"Command '{opts.command}' not found.")
    # An option given before the command name that this command does not take.
    for name in opts.given:
        if name not in GLOBAL and name not in PER_COMMAND.get(opts.command, {}):
            raise UsageError(f"Invalid options for {opts.command}: {name}")
    return opts


def _is_number(arg: str) -> bool:
    try:
        float(arg)
    except ValueError:
        return False
    return True


def _set(opts: Options, attr: str, name: str, value: str) -> None:
    if not attr:
        return
    if attr == "timeout":
        try:
            seconds = float(value)
        except ValueError:
            raise UsageError(f"{name}: {value!r} is not a number of seconds") from None
        if seconds <= 0:
            raise UsageError(f"{name} must be positive")
        opts.timeout = seconds
    elif attr == "priority":
        try:
            opts.priority = int(value)
        except ValueError:
            raise UsageError(f"{name}: {value!r} is not an integer") from None
    elif attr == "formatter":
        if value not in FORMATTERS:
            raise UsageError(f"--formatter {value!r}: one of {', '.join(FORMATTERS)}")
        opts.formatter = value
    elif attr == "node":
        opts.node = node_address(value)
    else:
        setattr(opts, attr, value)


def node_address(value: str) -> str:
    """-n: the management API's HOST:PORT (or URL); an Erlang-style NAME@HOST means that host's
    management API on the port LEVERET_CTL_NODE names (15672 by default)."""
    if "@" in value and "://" not in value:
        host = value.split("@", 1)[1]
        port = os.environ.get("LEVERET_CTL_NODE", DEFAULT_NODE).rsplit(":", 1)[-1]
        return f"{host}:{port}"
    return value
