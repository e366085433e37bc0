"""A stand-in for the Hugging Face hub on 127.0.0.1, for tests: the part of its HTTP protocol
huggingface_hub and parity use, with switches that make it misbehave.

Two listeners share one state: the hub itself and a "CDN" on another port (another origin, as
the hub's LFS storage is).  The protocol subset:

- ``HEAD|GET /{org}/{name}/resolve/{revision}/{file}``: the revision (a branch or a 40-hex
  commit) is resolved to a commit, sent as ``X-Repo-Commit``.  Plain files (JSON) are answered
  here with ``ETag`` (the git blob sha1), ``Content-Length`` and ``Range`` support; LFS files
  (``*.safetensors``) with a 302 to the CDN, carrying ``X-Linked-Size`` and ``X-Linked-Etag``
  (the sha256), as the hub does.  Errors as the hub sends them: ``X-Error-Code`` RepoNotFound,
  RevisionNotFound, EntryNotFound, GatedRepo (401 without a token, 403 with a token not granted).
- ``HEAD|GET /cdn/{sha256}?file=...`` on the CDN: the blob, honouring ``Range`` (206 +
  ``Content-Range``, 416 when unsatisfiable).
- ``GET /api/models/{org}/{name}[/revision/{revision}]``: repo info (``sha``, ``siblings``);
  ``GET /api/models/{org}/{name}/tree/{revision}``: the file listing (one page; HfFileSystem reads it).
- ``GET /api/agent-harnesses``: the registry huggingface_hub fetches (once a day, 3 s timeout) to tell
  whether an AI agent runs it; an empty one.

Every request is logged (``hub.log``) and every body byte sent is counted per file
(``hub.sent``).  ``hub.faults`` holds ``Fault`` rules, applied in order to the requests they match.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pth")
RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?$")
TREE = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$")
CDN = re.compile(r"^/cdn/(?P<sha>[0-9a-f]{64})$")
CHUNK = 1 << 12  # bytes per write (a tensor of the tiny checkpoints takes a few)
SOCKET_TIMEOUT_S = 5.0  # a client that stops talking never pins a server thread for long


@dataclass
class Fault:
    """Instead of the normal answer, ``action`` for requests it matches, ``times`` times (None: always).

    actions: ``status`` (answer ``status`` with ``headers``), ``drop`` (send half the body, then close
    the connection), ``short`` (a well-framed 206 for the first half of the range only), ``long`` (a
    well-framed 206 for more than the range asked), ``wrong_length`` (Content-Range states the range
    asked, Content-Length and the body only half of it), ``ignore_range`` (200 and the whole file),
    ``reset`` (close the connection without an answer),
    ``stall`` (wait ``seconds`` before answering), ``stall_body`` (send half the body, then wait
    ``seconds``), ``trickle`` (the body in pieces of ``CHUNK`` bytes, ``seconds`` apart)."""

    action: str
    file: str | None = None  # only requests for this file
    where: str | None = None  # "hub" or "cdn"; None: both
    method: str | None = None  # "GET" or "HEAD"; None: both
    ranged: bool | None = None  # only requests with (True) or without (False) a Range header
    status: int = 503
    headers: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    times: int | None = 1
    skip: int = 0  # let this many matching requests through first (a shard's header reads, say)
    hits: int = 0
    seen: int = 0

    def matches(self, where: str, method: str, file: str | None, ranged: bool) -> bool:
        if not (self.where in (None, where) and self.method in (None, method) and self.file in (None, file)
                and self.ranged in (None, ranged)):
            return False
        self.seen += 1
        return self.seen > self.skip and (self.times is None or self.hits < self.times)


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]]  # commit -> {file: content}
    refs: dict[str, str]  # branch -> commit
    gated: bool = False


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_lfs(file: str) -> bool:
    return file.endswith(LFS_SUFFIXES)


class _QuietServer(ThreadingHTTPServer):
    """A client that hangs up (parity giving up on a faulty answer) is expected here, not an error to
    print: socketserver's default handle_error writes a traceback to stderr, which the tests read."""

    def handle_error(self, request, client_address) -> None:
        self.hub.handler_errors.append(sys.exc_info()[1])


class FakeHub:
    """The hub's state, its two listeners, the log and the fault switches.  Use as a context manager."""

    def __init__(self, granted_tokens: tuple[str, ...] = ("hf_granted",)):
        self.repos: dict[str, Repo] = {}
        self.blobs: dict[str, bytes] = {}  # sha256 -> content (the CDN's store)
        self.faults: list[Fault] = []
        self.log: list[dict] = []
        self.sent: Counter[str] = Counter()  # file -> body bytes sent (hub and CDN)
        self.granted = set(granted_tokens)
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.handler_errors: list[BaseException | None] = []  # connections the client dropped, and the like
        self._servers: list[ThreadingHTTPServer] = []
        self._connections: set[socket.socket] = set()

    # -- the repositories ---------------------------------------------------------------------------

    def add_repo(self, repo_id: str, folder: Path | None = None, files: dict[str, bytes] | None = None,
                 gated: bool = False, branch: str = "main") -> str:
        """Serve ``folder``'s files (or ``files``) as a new commit of ``repo_id`` on ``branch``; the commit."""
        files = dict(files or {}) | ({p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
                                     if folder is not None else {})
        digest = hashlib.sha1(repo_id.encode() + b"".join(name.encode() + git_blob_sha1(data).encode()
                                                           for name, data in sorted(files.items())))
        commit = digest.hexdigest()
        with self.lock:
            repo = self.repos.setdefault(repo_id, Repo({}, {}))
            repo.commits[commit], repo.refs[branch], repo.gated = files, commit, repo.gated or gated
            for name, data in files.items():
                if is_lfs(name):
                    self.blobs[hashlib.sha256(data).hexdigest()] = data
        return commit

    def add_fault(self, action: str, **kwargs) -> Fault:
        fault = Fault(action, **kwargs)
        with self.lock:
            self.faults.append(fault)
        return fault

    def take_fault(self, where: str, method: str, file: str | None, ranged: bool,
                   actions: tuple[str, ...] | None = None) -> Fault | None:
        with self.lock:
            for fault in self.faults:
                if (actions is None or fault.action in actions) and fault.matches(where, method, file, ranged):
                    fault.hits += 1
                    return fault
        return None

    def record(self, **entry) -> dict:
        with self.lock:
            self.log.append(entry)
        return entry

    def count(self, file: str, n: int) -> None:
        with self.lock:
            self.sent[file] += n

    def requests(self, where: str | None = None, file: str | None = None, method: str | None = None) -> list[dict]:
        with self.lock:
            return [e for e in self.log if where in (None, e["where"]) and file in (None, e.get("file"))
                    and method in (None, e["method"])]

    def reset_counts(self) -> None:
        with self.lock:
            self.sent.clear()
            self.log.clear()

    # -- the listeners ------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._servers[0].server_address[1]}"

    @property
    def cdn(self) -> str:
        return f"http://127.0.0.1:{self._servers[1].server_address[1]}"

    def start(self) -> FakeHub:
        for where in ("hub", "cdn"):
            server = _QuietServer(("127.0.0.1", 0), _Handler)
            server.daemon_threads, server.block_on_close = True, False
            server.hub, server.where = self, where
            self._servers.append(server)
            threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop accepting, end every open connection (keep-alive ones too), close the listeners."""
        self.stopping.set()
        for server in self._servers:
            server.shutdown()
        with self.lock:
            connections, self._connections = list(self._connections), set()
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for server in self._servers:
            server.server_close()

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def track(self, conn: socket.socket, alive: bool) -> None:
        with self.lock:
            (self._connections.add if alive else self._connections.discard)(conn)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the hub
    timeout = SOCKET_TIMEOUT_S

    def setup(self):
        super().setup()
        self.server.hub.track(self.connection, True)

    def finish(self):
        try:
            super().finish()
        finally:
            self.server.hub.track(self.connection, False)

    def log_message(self, *args):  # quiet: the hub's own log is hub.log
        pass

    def do_HEAD(self):
        self._route("HEAD")

    def do_GET(self):
        self._route("GET")

    def _route(self, method: str) -> None:
        hub: FakeHub = self.server.hub
        url = urlsplit(self.path)
        entry = hub.record(where=self.server.where, method=method, path=url.path, range=self.headers.get("Range"),
                           auth=self.headers.get("Authorization"), status=None, file=None)
        try:
            if self.server.where == "cdn" and (m := CDN.match(url.path)):
                entry["file"] = parse_qs(url.query).get("file", [m["sha"]])[0]
                return self._serve_cdn(entry, m["sha"])
            if self.server.where == "hub" and (m := RESOLVE.match(url.path)):
                entry["file"] = unquote(m["file"])
                return self._serve_resolve(entry, unquote(m["repo"]), unquote(m["rev"]))
            if self.server.where == "hub" and url.path == "/api/agent-harnesses":
                body = json.dumps({"standardEnvVars": [], "harnesses": {}}).encode()
                return self._answer(entry, 200, {"Content-Type": "application/json"}, body, None)
            if self.server.where == "hub" and (m := TREE.match(url.path)):
                return self._serve_tree(entry, unquote(m["repo"]), unquote(m["rev"]))
            if self.server.where == "hub" and (m := API.match(url.path)):
                return self._serve_api(entry, unquote(m["repo"]), unquote(m["rev"] or "main"))
            entry["unknown"] = True
            self._error(entry, 404, "NotFound", f"no route for {url.path}")
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True

    # -- the routes ---------------------------------------------------------------------------------

    def _repo_commit(self, entry: dict, repo_id: str, rev: str) -> tuple[Repo, str] | None:
        hub: FakeHub = self.server.hub
        repo = hub.repos.get(repo_id)
        if repo is None:
            return self._error(entry, 404, "RepoNotFound", "Repository not found")
        if repo.gated:
            token = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
            if token not in hub.granted:
                return self._error(entry, 403 if token else 401, "GatedRepo",
                                   f"Access to model {repo_id} is restricted. You must have access to it and be "
                                   "authenticated to access it. Please log in.")
        commit = rev if rev in repo.commits else repo.refs.get(rev)
        if commit is None:
            return self._error(entry, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return repo, commit

    def _serve_api(self, entry: dict, repo_id: str, rev: str) -> None:
        found = self._repo_commit(entry, repo_id, rev)
        if found is None:
            return
        repo, commit = found
        body = json.dumps({"id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                           "gated": "manual" if repo.gated else False,
                           "siblings": [{"rfilename": name} for name in sorted(repo.commits[commit])]}).encode()
        self._answer(entry, 200, {"Content-Type": "application/json"}, body, None)

    def _serve_tree(self, entry: dict, repo_id: str, rev: str) -> None:
        found = self._repo_commit(entry, repo_id, rev)
        if found is None:
            return
        repo, commit = found
        rows = []
        for name, data in sorted(repo.commits[commit].items()):
            row = {"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": name}
            if is_lfs(name):
                row["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            rows.append(row)
        self._answer(entry, 200, {"Content-Type": "application/json"}, json.dumps(rows).encode(), None)

    def _serve_resolve(self, entry: dict, repo_id: str, rev: str) -> None:
        found = self._repo_commit(entry, repo_id, rev)
        if found is None:
            return
        repo, commit = found
        files = repo.commits[commit]
        file = entry["file"]
        if file not in files:
            return self._error(entry, 404, "EntryNotFound", f"{file} does not exist on \"{rev}\"",
                               {"X-Repo-Commit": commit})
        data = files[file]
        if is_lfs(file):
            sha = hashlib.sha256(data).hexdigest()
            headers = {"X-Repo-Commit": commit, "X-Linked-Size": str(len(data)), "X-Linked-Etag": f'"{sha}"',
                       "ETag": f'"{git_blob_sha1(data)}"',
                       "Location": f"{self.server.hub.cdn}/cdn/{sha}?file={quote(file)}"}
            self._fault(entry, file, ("status", "stall", "reset"))  # a redirect has no body to misbehave with
            if entry["status"] is None:
                self._answer(entry, 302, headers, b"", None)
            return
        self._serve_bytes(entry, file, data, {"X-Repo-Commit": commit, "ETag": f'"{git_blob_sha1(data)}"'})

    def _serve_cdn(self, entry: dict, sha: str) -> None:
        data = self.server.hub.blobs.get(sha)
        if data is None:
            return self._error(entry, 404, "NotFound", "no such blob")
        self._serve_bytes(entry, entry["file"], data, {"ETag": f'"{sha}"'})

    # -- answering ----------------------------------------------------------------------------------

    def _serve_bytes(self, entry: dict, file: str, data: bytes, headers: dict[str, str]) -> None:
        """``data``, or the part ``Range`` asks for; faults applied."""
        span = parse_range(self.headers.get("Range"), len(data))
        if span == "unsatisfiable":
            return self._answer(entry, 416, headers | {"Content-Range": f"bytes */{len(data)}"}, b"", file)
        fault = self._fault(entry, file)
        if entry["status"] is not None:  # the fault answered
            return
        start, end = span or (0, len(data))
        action = fault.action if fault is not None else None
        if action == "ignore_range" or span is None:
            return self._answer(entry, 200, headers | {"Accept-Ranges": "bytes"}, data, file, fault)
        if action == "short":
            end = start + max(1, (end - start) // 2)
        elif action == "long":
            end = min(len(data), end + 64)
        part = data[start:end]
        headers = headers | {"Accept-Ranges": "bytes", "Content-Range": f"bytes {start}-{end - 1}/{len(data)}"}
        if action == "wrong_length":  # Content-Range: the range asked; the body: half of it
            return self._answer(entry, 206, headers | {"Connection": "close"}, part[:(len(part) + 1) // 2], file)
        self._answer(entry, 206, headers, part, file, fault)

    def _fault(self, entry: dict, file: str, actions: tuple[str, ...] | None = None) -> Fault | None:
        """The fault for this request, if any; ``status``, ``reset`` (answered here) and ``stall`` are acted on here."""
        hub: FakeHub = self.server.hub
        fault = hub.take_fault(self.server.where, self.command, file, "Range" in self.headers, actions)
        if fault is None:
            return None
        entry["fault"] = fault.action
        if fault.action == "stall":
            hub.stopping.wait(fault.seconds)
            return None
        if fault.action == "reset":
            entry["status"], self.close_connection = "reset", True
            self.connection.shutdown(socket.SHUT_RDWR)
        if fault.action == "status":
            code = fault.headers.get("X-Error-Code", "ServerError")
            self._error(entry, fault.status, code, f"injected {fault.status}", fault.headers)
        return fault

    def _error(self, entry: dict, status: int, code: str, message: str, headers: dict[str, str] | None = None):
        body = json.dumps({"error": message}).encode()
        self._answer(entry, status, {"X-Error-Code": code, "X-Error-Message": message,
                                     "Content-Type": "application/json"} | (headers or {}), body, None)
        return None

    def _answer(self, entry: dict, status: int, headers: dict[str, str], body: bytes, file: str | None,
                fault: Fault | None = None) -> None:
        entry["status"] = status
        self.send_response(status)
        headers = {"Content-Length": str(len(body))} | headers
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if headers.get("Connection") == "close":
            self.close_connection = True
        if self.command == "HEAD" or not body:
            return
        self._write_body(entry, body, file, fault)

    def _write_body(self, entry: dict, body: bytes, file: str | None, fault: Fault | None) -> None:
        hub: FakeHub = self.server.hub
        action = fault.action if fault is not None else None
        cut = (len(body) + 1) // 2 if action in ("drop", "stall_body") else len(body)  # at least a byte
        sent = 0
        for offset in range(0, cut, CHUNK):
            piece = body[offset:min(offset + CHUNK, cut)]
            self.wfile.write(piece)
            sent += len(piece)
            if file is not None:
                hub.count(file, len(piece))
            if action == "trickle" and hub.stopping.wait(fault.seconds):
                break
        entry["sent"] = sent
        self.wfile.flush()
        if action == "stall_body":
            hub.stopping.wait(fault.seconds)
        if action in ("drop", "stall_body"):
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)


def parse_range(header: str | None, size: int) -> tuple[int, int] | str | None:
    """``bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` -> (start, end) clipped to the file; None without a
    header; "unsatisfiable" when it starts past the end or does not parse."""
    if header is None:
        return None
    m = re.fullmatch(r"bytes=(\d*)-(\d*)", header.strip())
    if m is None or m[1] == m[2] == "":
        return "unsatisfiable"
    if m[1] == "":
        return (max(0, size - int(m[2])), size)
    start, end = int(m[1]), (int(m[2]) + 1 if m[2] else size)
    if start >= size or end <= start:
        return "unsatisfiable"
    return start, min(end, size)
