"""A Hugging Face hub on 127.0.0.1, for tests: the part of the hub's HTTP API that huggingface_hub 0.36, datasets 4
and transformers 4.57 call, over a folder of repositories.

Layout of the folder: ``models/<id>/...`` and ``datasets/<id>/...`` (``<id>`` as on the hub, ``org/name``), each a
repository's files at its one revision ``main``. A file ``gated.json`` at the top lists repository paths
(``models/<id>``) that answer as a gated repository does to a request without an accepted token: as on the hub
since August 2024 (huggingface_hub issue #2457, "Gated dataset info is leaked"; datasets PR #7110 checks access with
``/auth-check`` because of it), the repository's info (``"gated": "manual"``), tree, paths-info, README.md and
.gitattributes are public, and only its other files and ``/api/<kind>/<id>/auth-check`` are refused.

The answers follow the hub's, as huggingface_hub reads them (``utils/_http.py`` ``hf_raise_for_status``,
``file_download.py`` ``get_hf_file_metadata``): a file's HEAD carries ``X-Repo-Commit``, ``ETag`` and
``Content-Length``; a repository it does not hold is a 404 with ``X-Error-Code: RepoNotFound`` and the hub's page
text; a missing file of a repository it holds is a 404 ``EntryNotFound`` that still names the commit (clients cache
the miss and go on, as they do for optional files such as ``added_tokens.json``); a bad revision is a 404
``RevisionNotFound``; a gated file without a token is a 401 ``GatedRepo`` with the hub's message, with a token
that was not granted access a 403 ``GatedRepo`` (``hf_raise_for_status`` turns either into ``GatedRepoError``). Files are
served directly (no LFS redirect). Every request is logged with its status and the bytes sent, so a test can say
what a run fetched.

Why not PyPI's ``olah``: in its offline mode it answers every miss, even a missing optional file of a repository it
holds, with 401 RepoNotFound, which the clients turn into errors, and it needs each repository as a git repository;
the clients' calls are few enough to answer here directly.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple
from urllib.parse import parse_qs, unquote, urlsplit

REPO_TYPES = {"models": "model", "datasets": "dataset"}
NOT_FOUND_PAGE = "Sorry, we can't find the page you are looking for."
PUBLIC_FILES = ("README.md", ".gitattributes")  # a gated repository's card stays public
_ID = r"(?P<repo>[^/]+(?:/[^/]+)?)"
_ROUTES = [
    ("auth", re.compile(rf"^/api/(?P<kind>models|datasets)/{_ID}/auth-check$")),
    ("info", re.compile(rf"^/api/(?P<kind>models|datasets)/{_ID}(?:/revision/(?P<rev>[^/]+))?$")),
    ("tree", re.compile(rf"^/api/(?P<kind>models|datasets)/{_ID}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$")),
    ("paths", re.compile(rf"^/api/(?P<kind>models|datasets)/{_ID}/paths-info/(?P<rev>[^/]+)$")),
    ("file", re.compile(rf"^(?:/(?P<kind>datasets))?/{_ID}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")),
]


@dataclass
class Repo:
    kind: str  # models | datasets
    repo_id: str
    root: Path
    sha: str
    files: Dict[str, Path]

    @classmethod
    def read(cls, kind: str, repo_id: str, root: Path) -> "Repo":
        files = {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}
        digest = hashlib.sha1(repo_id.encode())
        for name, path in files.items():
            digest.update(name.encode())
            digest.update(hashlib.sha1(path.read_bytes()).digest())
        return cls(kind, repo_id, root, digest.hexdigest(), files)

    def entry(self, name: str) -> dict:
        path = self.files[name]
        return {"type": "file", "oid": _etag(path), "size": path.stat().st_size, "path": name}

    def folders(self) -> List[str]:
        found = set()
        for name in self.files:
            parts = name.split("/")[:-1]
            found.update("/".join(parts[: i + 1]) for i in range(len(parts)))
        return sorted(found)


def _etag(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()


@dataclass
class Request:
    method: str
    path: str
    status: int
    sent: int


@dataclass
class HubMirror:
    """``with HubMirror(folder) as hub:`` serves the folder at ``hub.endpoint`` until the block ends."""

    folder: Path
    token: Optional[str] = None  # the token that opens gated repositories
    port: int = 0  # 0: any free port
    gated: Set[str] = field(default_factory=set)  # repository paths (models/<id>) gated besides gated.json's
    log: List[Request] = field(default_factory=list)

    def __post_init__(self):
        self.folder = Path(self.folder)
        self.repos: Dict[Tuple[str, str], Repo] = {}
        for kind in REPO_TYPES:
            for top in sorted((self.folder / kind).glob("*")):
                # a bare id (``glue``) holds files itself; an ``org/name`` id is one level down
                holders = [top] if any(p.is_file() for p in top.iterdir()) else sorted(top.glob("*"))
                for root in holders:
                    repo_id = root.relative_to(self.folder / kind).as_posix()
                    self.repos[(kind, repo_id)] = Repo.read(kind, repo_id, root)
        gated = self.folder / "gated.json"
        self.gated = set(self.gated) | (set(json.loads(gated.read_text())) if gated.exists() else set())
        self._server: Optional[ThreadingHTTPServer] = None
        self._lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "HubMirror":
        mirror = self

        class Handler(_Handler):
            hub = mirror

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="hub-mirror", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "HubMirror":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def record(self, request: Request) -> None:
        with self._lock:
            self.log.append(request)

    def fetched(self, prefix: str = "") -> Dict[str, int]:
        """Bytes sent per file URL path (GETs that succeeded), for paths that start with ``prefix``."""
        sent: Dict[str, int] = {}
        with self._lock:
            for r in self.log:
                if r.method == "GET" and r.status in (200, 206) and "/resolve/" in r.path and r.path.startswith(prefix):
                    sent[r.path] = sent.get(r.path, 0) + r.sent
        return sent


class _Handler(BaseHTTPRequestHandler):
    hub: HubMirror
    protocol_version = "HTTP/1.1"
    # Headers and body leave in two writes on a kept-alive connection: with Nagle's algorithm the body waited for the
    # client's delayed ACK (about 40 ms a request, seconds a run; the hub's servers answer at once).
    disable_nagle_algorithm = True

    def log_message(self, *args) -> None:  # the mirror's own log is the record
        pass

    def do_HEAD(self) -> None:
        self._answer("HEAD")

    def do_GET(self) -> None:
        self._answer("GET")

    def do_POST(self) -> None:
        self._answer("POST")

    def _answer(self, method: str) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        query = parse_qs(url.query)
        body = b""
        if method == "POST":
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        for route, pattern in _ROUTES:
            match = pattern.match(path)
            if match and (route != "paths" or method == "POST"):
                status, headers, payload = self._route(route, match.groupdict(), query, body)
                break
        else:
            if path.startswith("/api/telemetry"):
                status, headers, payload = 200, {}, b"{}"
            else:
                status, headers, payload = 404, {"Content-Type": "text/plain"}, NOT_FOUND_PAGE.encode()
        start, end = 0, len(payload)
        if status == 200 and route == "file" and self.headers.get("Range"):
            start, end = _byte_range(self.headers["Range"], len(payload))
            status, headers = 206, {**headers, "Content-Range": f"bytes {start}-{end - 1}/{len(payload)}"}
        # recorded before the client can read a byte of the answer: a test that reads the log after its request
        # returned finds the request there
        self.hub.record(Request(method, self.path, status, 0 if method == "HEAD" else end - start))
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(end - start))
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(payload[start:end])

    def _route(self, route: str, match: dict, query: dict, body: bytes):
        kind = match.get("kind") or "models"
        repo = self.hub.repos.get((kind, match["repo"]))
        if repo is None:
            return _error(404, "RepoNotFound", "Repository not found", NOT_FOUND_PAGE)
        gated = f"{kind}/{repo.repo_id}" in self.hub.gated
        if gated and (route == "auth" or (route == "file" and match["path"] not in PUBLIC_FILES)):
            refused = self._refused(REPO_TYPES[kind], repo.repo_id)
            if refused is not None:
                return refused
        if route == "auth":
            return 200, {"Content-Type": "application/json"}, b"{}"
        rev = match.get("rev")
        if rev is not None and rev not in ("main", repo.sha):
            return _error(404, "RevisionNotFound", "Invalid rev id: " + rev, "Invalid rev id: " + rev, repo)
        commit = {"X-Repo-Commit": repo.sha}
        if route == "info":
            return 200, {"Content-Type": "application/json", **commit}, json.dumps(_info(repo, gated)).encode()
        if route == "tree":
            return 200, {"Content-Type": "application/json", **commit}, json.dumps(
                _tree(repo, match.get("path") or "", query.get("recursive", ["false"])[0] in ("1", "true", "True"))
            ).encode()
        if route == "paths":
            wanted = parse_qs(body.decode()).get("paths", []) if body else []
            if body and body.lstrip().startswith(b"{"):
                wanted = json.loads(body).get("paths", [])
            entries = [repo.entry(p) for p in wanted if p in repo.files]
            entries += [{"type": "directory", "oid": repo.sha, "size": 0, "path": p}
                        for p in wanted if p in repo.folders()]
            return 200, {"Content-Type": "application/json", **commit}, json.dumps(entries).encode()
        name = match["path"]
        if name not in repo.files:
            return _error(404, "EntryNotFound", "Entry not found", "Entry not found", repo)
        path = repo.files[name]
        return 200, {**commit, "ETag": f'"{_etag(path)}"', "Accept-Ranges": "bytes",
                     "Content-Type": "application/octet-stream"}, path.read_bytes()

    def _refused(self, singular: str, repo_id: str):
        """None where the request carries the token that was granted access; else the hub's answer."""
        given = self.headers.get("Authorization")
        if given is None:
            message = (f"Access to {singular} {repo_id} is restricted. You must have access to it and be "
                       "authenticated to access it. Please log in.")
            return _error(401, "GatedRepo", message, message)
        if self.hub.token is not None and given == f"Bearer {self.hub.token}":
            return None
        message = (f"Access to {singular} {repo_id} is restricted and you are not in the authorized list. "
                   f"Visit {self.hub.endpoint}/{repo_id} to ask for access.")
        return _error(403, "GatedRepo", message, message)


def _error(status: int, code: str, message: str, text: str, repo: Optional[Repo] = None):
    headers = {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "text/plain"}
    if repo is not None:
        headers["X-Repo-Commit"] = repo.sha
    return status, headers, text.encode()


def _info(repo: Repo, gated: bool) -> dict:
    info = {"_id": repo.sha[:24], "id": repo.repo_id, "sha": repo.sha, "private": False, "disabled": False,
            "gated": "manual" if gated else False, "downloads": 0, "likes": 0, "tags": [], "lastModified": "2026-01-01T00:00:00.000Z",
            "createdAt": "2026-01-01T00:00:00.000Z", "siblings": [{"rfilename": name} for name in repo.files]}
    if repo.kind == "models":
        info["modelId"] = repo.repo_id
    return info


def _tree(repo: Repo, prefix: str, recursive: bool) -> list:
    prefix = prefix.strip("/")
    under = (prefix + "/") if prefix else ""
    def shown(name: str) -> bool:
        return name.startswith(under) and (recursive or "/" not in name[len(under):])
    folders = [{"type": "directory", "oid": repo.sha, "size": 0, "path": p} for p in repo.folders() if shown(p)]
    return folders + [repo.entry(name) for name in repo.files if shown(name)]


def _byte_range(header: str, size: int) -> Tuple[int, int]:
    match = re.match(r"bytes=(\d*)-(\d*)", header)
    first, last = match.groups()
    if first == "":
        return max(size - int(last), 0), size
    return int(first), min(int(last) + 1, size) if last else size
