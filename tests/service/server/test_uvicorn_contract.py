"""What ``service.server.connections`` takes from uvicorn and httptools, checked against the
installed releases, so that an upgrade that changes them fails here, loudly, rather than in
a connection under load.

``GuardedHttpProtocol`` subclasses uvicorn's ``HttpToolsProtocol``: the methods it
overrides keep their signatures, the methods it calls through ``super()`` exist, and every
attribute it reads but does not set itself (``self.pipeline``, ``self.cycle``,
``self.flow``, ``self._unset_keepalive_if_required``...) exists on a live protocol, as do the
attributes it reads of the request cycle, the flow control and the server state. The names
are read from the module's source (its AST), so a new use is checked without editing this
file. pyproject.toml bounds both packages to the minor releases the code was tested with
(requirements/lock.txt), and the installed ones are within them."""

from __future__ import annotations

import ast
import asyncio
import importlib.metadata
import inspect
import re
from pathlib import Path

import httptools
import pytest
import uvicorn
from packaging.requirements import Requirement
from packaging.version import Version
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

tomllib = pytest.importorskip("tomllib", reason="Python < 3.11: no tomllib")

ROOT = Path(__file__).resolve().parents[3]
SOURCE = ROOT / "service" / "server" / "connections.py"
# objects reached from the protocol whose attributes the guarded protocol reads
HELD = ("cycle", "flow", "server_state")
# attributes it is known to read: the scan below must find them (or it found nothing)
KNOWN_READS = {"pipeline", "cycle", "flow", "_unset_keepalive_if_required", "server_state"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def serve_requirement(name: str) -> Requirement:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    serve = [Requirement(r) for r in project["optional-dependencies"]["serve"]]
    (found,) = [r for r in serve if canonical(r.name) == name]
    return found


def locked(name: str) -> Version:
    for line in (ROOT / "requirements" / "lock.txt").read_text().splitlines():
        package, _, version = line.strip().partition("==")
        if canonical(package) == name:
            return Version(version)
    raise AssertionError(f"{name} is not in requirements/lock.txt")


@pytest.mark.parametrize("name", ["uvicorn", "httptools"])
def test_the_installed_release_is_within_bounds_just_above_the_locked_one(name):
    """An upper bound at most the next minor release of the locked (tested) one, and the
    installed release within the range."""
    requirement = serve_requirement(name)
    uppers = [Version(s.version) for s in requirement.specifier if s.operator == "<"]
    assert uppers, f"pyproject.toml's {requirement} has no upper bound"
    pinned = locked(name)
    assert min(uppers) <= Version(f"{pinned.major}.{pinned.minor + 1}"), (
        f"{requirement} admits minor releases after the locked {pinned}, never tested"
    )
    installed = importlib.metadata.version(name)
    assert requirement.specifier.contains(installed), (
        f"{name} {installed} is installed, outside pyproject.toml's {requirement}: "
        "service.server.connections relies on its internals; test it, then move the bounds"
    )


# ---------------------------------------------------------------- what the source uses


def guarded_class() -> ast.ClassDef:
    tree = ast.parse(SOURCE.read_text(), filename=str(SOURCE))
    (found,) = [
        node
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name == "GuardedHttpProtocol"
    ]
    return found


def is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def set_here(cls: ast.ClassDef) -> set[str]:
    """Names the class defines: its methods, class attributes and ``self.X = ...``."""
    names = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for node in ast.walk(cls):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        while targets:
            target = targets.pop()
            if isinstance(target, ast.Tuple):
                targets.extend(target.elts)
            elif isinstance(target, ast.Attribute) and is_self(target.value):
                names.add(target.attr)
    return names


def read_on_self(cls: ast.ClassDef) -> set[str]:
    return {
        node.attr
        for node in ast.walk(cls)
        if isinstance(node, ast.Attribute) and is_self(node.value)
    }


def called_on_super(cls: ast.ClassDef) -> set[str]:
    return {
        node.attr
        for node in ast.walk(cls)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id == "super"
    }


def read_on_held(cls: ast.ClassDef) -> dict[str, set[str]]:
    """{held: attributes read of it}, for ``self.HELD.X`` and a local named HELD
    (``cycle = self.cycle``)."""
    found: dict[str, set[str]] = {held: set() for held in HELD}
    for node in ast.walk(cls):
        if not isinstance(node, ast.Attribute):
            continue
        value = node.value
        if isinstance(value, ast.Attribute) and is_self(value.value) and value.attr in HELD:
            found[value.attr].add(node.attr)
        elif isinstance(value, ast.Name) and value.id in HELD:
            found[value.id].add(node.attr)
    return found


# ---------------------------------------------------------------- a live protocol


class FakeTransport:
    """What uvicorn's protocol calls on a transport."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(
            name, default
        )

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


@pytest.fixture(scope="module")
def live():
    """uvicorn's own protocol (not the guarded one) in the middle of a request: (protocol,
    its transport, the ASGI ``send`` the app was given, the cycle the app ran in)."""
    seen = {}

    async def app(scope, receive, send):
        if scope["type"] == "http":
            seen["send"], seen["cycle"] = send, seen["protocol"].cycle
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

    async def run():
        config = uvicorn.Config(app=app, lifespan="off", log_level="warning")
        config.load()
        protocol = HttpToolsProtocol(
            config=config,
            server_state=ServerState(),
            app_state={},
            _loop=asyncio.get_running_loop(),
        )
        seen["protocol"] = protocol
        transport = FakeTransport()
        protocol.connection_made(transport)
        protocol.data_received(b"GET / HTTP/1.1\r\nhost: t\r\n\r\n")
        for _ in range(100):
            if transport.written:
                break
            await asyncio.sleep(0.01)
        protocol.connection_lost(None)
        return protocol, transport

    protocol, transport = asyncio.run(run())
    assert b"".join(transport.written).startswith(b"HTTP/1.1 200"), transport.written
    return protocol, transport, seen["send"], seen["cycle"]


def test_every_attribute_the_guarded_protocol_reads_but_does_not_set_is_uvicorns(live):
    protocol = live[0]
    cls = guarded_class()
    inherited = read_on_self(cls) - set_here(cls)
    assert KNOWN_READS <= inherited, "the scan missed the names it is known to read"
    missing = sorted(name for name in inherited if not hasattr(protocol, name))
    assert not missing, (
        f"uvicorn {uvicorn.__version__}'s HttpToolsProtocol has no {missing}, which "
        "service.server.connections.GuardedHttpProtocol relies on"
    )


def test_overridden_and_super_called_methods_keep_uvicorns_signatures():
    cls = guarded_class()
    overridden = {
        node.name
        for node in cls.body
        if isinstance(node, ast.FunctionDef) and hasattr(HttpToolsProtocol, node.name)
    } - {"__init__"}
    assert {"on_headers_complete", "on_body", "connection_made", "data_received"} <= overridden
    from service.server.connections import GuardedHttpProtocol

    for name in sorted(overridden):
        ours = list(inspect.signature(getattr(GuardedHttpProtocol, name)).parameters)
        theirs = list(inspect.signature(getattr(HttpToolsProtocol, name)).parameters)
        assert ours == theirs, f"{name}: uvicorn's parameters are {theirs}, ours {ours}"
    missing = sorted(
        n for n in called_on_super(cls) if not callable(getattr(HttpToolsProtocol, n, None))
    )
    assert not missing, f"super().{missing} do not exist in uvicorn {uvicorn.__version__}"
    # new_protocol builds one as uvicorn does
    inspect.signature(HttpToolsProtocol.__init__).bind(
        None, config=None, server_state=None, app_state={}, _loop=None
    )


def test_what_it_reads_of_the_cycle_the_flow_and_the_server_state_exists(live):
    protocol, _, _, cycle = live
    objects = {"cycle": cycle, "flow": protocol.flow, "server_state": protocol.server_state}
    used = read_on_held(guarded_class())
    assert {"response_complete", "scope"} <= used["cycle"] and "write_paused" in used["flow"]
    for held, names in used.items():
        missing = sorted(name for name in names if not hasattr(objects[held], name))
        assert not missing, f"uvicorn {uvicorn.__version__}'s {held} has no {missing}"


def test_an_asgi_send_leads_back_to_its_connections_transport(live):
    """``answer_sink``: the ``send`` an app is given is its request cycle's bound method,
    whose ``transport`` is the one the protocol was made with."""
    _, transport, send, cycle = live
    assert send.__self__ is cycle and cycle.transport is transport


def test_httptools_reports_chunk_boundaries_and_its_errors():
    """The guarded protocol counts chunked framing from the parser's on_chunk_header and
    on_chunk_complete callbacks and catches HttpParserError / HttpParserUpgrade."""
    calls = []

    class Recorder:
        def on_chunk_header(self):
            calls.append("header")

        def on_chunk_complete(self):
            calls.append("complete")

        def on_body(self, body):
            calls.append(body)

    parser = httptools.HttpRequestParser(Recorder())
    parser.feed_data(
        b"POST / HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
        b"2\r\nab\r\n1\r\nc\r\n0\r\n\r\n"
    )
    assert calls[:6] == ["header", b"ab", "complete", "header", b"c", "complete"]
    assert issubclass(httptools.HttpParserUpgrade, Exception)
    with pytest.raises(httptools.HttpParserError):
        httptools.HttpRequestParser(Recorder()).feed_data(b"NOT HTTP\r\n\r\n")
