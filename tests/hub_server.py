"""A small local Hugging Face Hub for the tests: a real HTTP server on 127.0.0.1 (test infrastructure only).

It implements the endpoints huggingface_hub calls for `create_repo`, `upload_folder` / `create_commit`,
`push_to_hub`, `hf_hub_download`, `snapshot_download`, `model_info`, `ModelCard.load`,
`get_safetensors_metadata` and `from_pretrained(repo_id)` (see ../shared/docs/offline-assets.md):

    GET  /api/whoami-v2
    POST /api/repos/create
    POST /api/validate-yaml
    POST /api/models/{ns}/{name}/preupload/{rev}
    POST /api/models/{ns}/{name}/commit/{rev}          (application/x-ndjson)
    GET  /api/models/{ns}/{name}[/revision/{rev}]
    GET  /api/models/{ns}/{name}/tree/{rev}[/{path}]
    POST /api/models/{ns}/{name}/paths-info/{rev}
    HEAD/GET /{ns}/{name}/resolve/{rev}/{path}         (Range requests answered with 206)

Every file is "regular" (base64 inside the commit), so no LFS or Xet transfer is involved. Repositories live
in a temporary directory: one blob file per content (named by its git blob id) and a list of commits, each a
`{path: blob id}` snapshot.

Failures can be injected: `server.fail(method, path_regex, status=500)` answers matching requests with that
status, `server.fail(..., drop=True)` reads part of the request body and closes the connection without an
answer. Authentication: a request whose `Authorization: Bearer` token is not `server.token` gets 401; writes
need the token.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

USER = "tester"
TOKEN = "hf_local_test_token"


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _Repo:
    def __init__(self, repo_id: str, private: bool):
        self.repo_id = repo_id
        self.private = private
        self.commits: list[tuple[str, dict[str, str]]] = []  # (commit oid, {path: blob id}), oldest first
        self.refs = {"main": None}
        self.created = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())

    def snapshot(self, rev: str | None) -> tuple[str, dict[str, str]] | None:
        rev = rev or "main"
        if rev in self.refs:
            oid = self.refs[rev]
            if oid is None:
                return _EMPTY_COMMIT, {}
            rev = oid
        for oid, files in self.commits:
            if oid == rev:
                return oid, files
        return None


_EMPTY_COMMIT = "0" * 40


class LocalHub:
    """The server's state and its failure injection; `url` is its endpoint."""

    def __init__(self, root: str | None = None):
        self._own_root = root is None
        self.root = root or tempfile.mkdtemp(prefix="local-hub-")
        self.blobs = os.path.join(self.root, "blobs")
        os.makedirs(self.blobs, exist_ok=True)
        self.repos: dict[str, _Repo] = {}
        self.lock = threading.RLock()
        self.token = TOKEN
        self.failures: list[dict] = []
        self.log: list[tuple[str, str, int]] = []
        hub = self

        class Handler(_Handler):
            server_hub = hub

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="local-hub", daemon=True)

    # -- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> "LocalHub":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # -- failure injection -----------------------------------------------------------------------------------
    def fail(self, method: str, path_regex: str, status: int = 500, drop: bool = False, times: int | None = None):
        """Answer requests `method path` matching `path_regex` with `status` (or drop the connection), `times`
        times (None: until `clear_failures`)."""
        with self.lock:
            self.failures.append(dict(method=method.upper(), regex=re.compile(path_regex), status=status,
                                      drop=drop, times=times))

    def clear_failures(self) -> None:
        with self.lock:
            self.failures.clear()

    def _failure_for(self, method: str, path: str) -> dict | None:
        with self.lock:
            for rule in self.failures:
                if rule["method"] in (method, "*") and rule["regex"].search(path):
                    if rule["times"] is not None:
                        if rule["times"] <= 0:
                            continue
                        rule["times"] -= 1
                    return rule
        return None

    # -- storage ---------------------------------------------------------------------------------------------
    def put_blob(self, data: bytes) -> str:
        oid = git_blob_id(data)
        path = os.path.join(self.blobs, oid)
        if not os.path.exists(path):
            tmp = path + f".{threading.get_ident()}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        return oid

    def blob_path(self, oid: str) -> str:
        return os.path.join(self.blobs, oid)

    def files(self, repo_id: str, rev: str = "main") -> dict[str, bytes]:
        """`{path: content}` of a repository at `rev` (for assertions in tests)."""
        repo = self.repos[repo_id]
        _, snap = repo.snapshot(rev)
        out = {}
        for path, oid in snap.items():
            with open(self.blob_path(oid), "rb") as f:
                out[path] = f.read()
        return out

    def commit_count(self, repo_id: str) -> int:
        return len(self.repos[repo_id].commits) if repo_id in self.repos else 0


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_hub: LocalHub

    def log_message(self, fmt, *args):  # quiet; requests are recorded in hub.log
        pass

    # -- plumbing --------------------------------------------------------------------------------------------
    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            return self.rfile.read(n)
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        return b""

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, content_type="application/json"):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)
        self.server_hub.log.append((self.command, self.path, status))

    def _json(self, status: int, obj, headers: dict | None = None):
        self._send(status, json.dumps(obj).encode(), headers)

    def _error(self, status: int, message: str, code: str | None = None):
        headers = {"X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        self._json(status, {"error": message}, headers)

    def _drop(self):
        # Read part of what the client sends, then close the socket without answering.
        try:
            n = int(self.headers.get("Content-Length") or 0)
            if n:
                self.rfile.read(min(n, 1024))
        except OSError:
            pass
        self.server_hub.log.append((self.command, self.path, 0))
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        except OSError:
            pass
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _auth(self) -> bool | None:
        """True: valid token; False: no token; None: a wrong token (answered 401 already)."""
        header = self.headers.get("Authorization", "")
        if not header:
            return False
        if header != f"Bearer {self.server_hub.token}":
            self._error(401, "Invalid credentials in Authorization header", "Unauthorized")
            return None
        return True

    def _dispatch(self):
        hub = self.server_hub
        url = urlsplit(self.path)
        path, query = unquote(url.path), parse_qs(url.query)
        rule = hub._failure_for(self.command, path)
        if rule is not None:
            if rule["drop"]:
                return self._drop()
            self._body()
            return self._error(rule["status"], f"injected failure {rule['status']}")
        auth = self._auth()
        if auth is None:
            self._body()
            return
        for method, pattern, handler in _ROUTES:
            if method != self.command and not (method == "GET" and self.command == "HEAD"):
                continue
            m = re.fullmatch(pattern, path)
            if m:
                return handler(self, auth, query, *m.groups())
        self._body()
        self._error(404, f"no route for {self.command} {path}")

    do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = _dispatch

    # -- helpers ---------------------------------------------------------------------------------------------
    def _repo(self, ns, name, auth, write=False) -> _Repo | None:
        repo = self.server_hub.repos.get(f"{ns}/{name}")
        if repo is None or (repo.private and not auth):
            self._error(404, f"Repository {ns}/{name} not found", "RepoNotFound")
            return None
        if write and not auth:
            self._error(401, "You must be authenticated to write to a repository", "Unauthorized")
            return None
        return repo

    def _snapshot(self, repo: _Repo, rev: str):
        snap = repo.snapshot(rev)
        if snap is None:
            self._error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return snap

    def _entry(self, path: str, oid: str) -> dict:
        return {"type": "file", "path": path, "oid": oid, "size": os.path.getsize(self.server_hub.blob_path(oid))}

    # -- endpoints -------------------------------------------------------------------------------------------
    def whoami(self, auth, query):
        if not auth:
            return self._error(401, "Invalid credentials in Authorization header", "Unauthorized")
        self._json(200, {"type": "user", "name": USER, "fullname": "Test User", "orgs": [],
                         "auth": {"type": "access_token", "accessToken": {"displayName": "test", "role": "write"}}})

    def create_repo(self, auth, query):
        body = json.loads(self._body() or b"{}")
        if not auth:
            return self._error(401, "You must be authenticated to create a repository", "Unauthorized")
        if body.get("type", "model") not in (None, "model"):
            return self._error(400, "only model repositories are supported by the local hub")
        ns = body.get("organization") or USER
        repo_id = f"{ns}/{body['name']}"
        hub = self.server_hub
        with hub.lock:
            if repo_id in hub.repos:
                return self._json(409, {"error": "You already created this model repo", "url": f"{hub.url}/{repo_id}"})
            hub.repos[repo_id] = _Repo(repo_id, bool(body.get("private")))
        self._json(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id, "id": repo_id})

    def validate_yaml(self, auth, query):
        body = json.loads(self._body() or b"{}")
        content = body.get("content", "")
        m = re.match(r"^---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(\r?\n|$)", content, re.S)
        try:
            data = (yaml.safe_load(m.group(1)) if m else {}) or {}
        except yaml.YAMLError as e:
            return self._json(400, {"error": f"Invalid YAML: {e}"})
        errors = _validate_card_data(data)
        if errors:
            return self._json(400, {"error": "; ".join(errors)})
        self._json(200, {"errors": [], "warnings": []})

    def preupload(self, auth, query, ns, name, rev):
        body = json.loads(self._body() or b"{}")
        repo = self._repo(ns, name, auth, write=True)
        if repo is None:
            return
        snap = self._snapshot(repo, rev)
        if snap is None:
            return
        files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": snap[1].get(f["path"])}
                 for f in body.get("files", [])]
        self._json(200, {"files": files, "commitOid": snap[0]})

    def commit(self, auth, query, ns, name, rev):
        raw = self._body()
        repo = self._repo(ns, name, auth, write=True)
        if repo is None:
            return
        hub = self.server_hub
        with hub.lock:
            snap = self._snapshot(repo, rev)
            if snap is None:
                return
            files = dict(snap[1])
            summary = ""
            try:
                for line in raw.splitlines():
                    if not line.strip():
                        continue
                    item = json.loads(line)
                    key, value = item["key"], item["value"]
                    if key == "header":
                        summary = value.get("summary", "")
                    elif key == "file":
                        if value.get("encoding", "base64") != "base64":
                            raise ValueError(f"unsupported encoding {value.get('encoding')}")
                        files[value["path"]] = hub.put_blob(base64.b64decode(value["content"]))
                    elif key == "deletedFile":
                        files.pop(value["path"], None)
                    elif key == "deletedFolder":
                        prefix = value["path"].rstrip("/") + "/"
                        files = {p: o for p, o in files.items() if not p.startswith(prefix)}
                    else:
                        raise ValueError(f"unsupported commit operation {key!r} (the local hub stores regular files only)")
            except (ValueError, KeyError) as e:
                return self._error(400, f"bad commit payload: {e}")
            oid = hashlib.sha1(f"{repo.repo_id}{len(repo.commits)}{summary}{time.time()}".encode()).hexdigest()
            repo.commits.append((oid, files))
            repo.refs[rev if rev in repo.refs or not re.fullmatch(r"[0-9a-f]{40}", rev) else "main"] = oid
        self._json(200, {"commitUrl": f"{hub.url}/{repo.repo_id}/commit/{oid}", "commitOid": oid,
                         "pullRequestUrl": None})

    def model_info(self, auth, query, ns, name, rev=None):
        repo = self._repo(ns, name, auth)
        if repo is None:
            return
        snap = self._snapshot(repo, rev or "main")
        if snap is None:
            return
        sha, files = snap
        info = {"id": repo.repo_id, "modelId": repo.repo_id, "_id": repo.repo_id, "author": repo.repo_id.split("/")[0],
                "sha": sha, "private": repo.private, "disabled": False, "gated": False, "downloads": 0, "likes": 0,
                "createdAt": repo.created, "lastModified": repo.created,
                "siblings": [{"rfilename": p} for p in sorted(files)], "tags": []}
        if "README.md" in files:
            with open(self.server_hub.blob_path(files["README.md"]), encoding="utf-8") as f:
                card = f.read()
            m = re.match(r"^---\s*\n(.*?)\n---\s*\n", card, re.S)
            if m:
                data = yaml.safe_load(m.group(1)) or {}
                info["cardData"] = data
                info["tags"] = list(data.get("tags") or [])
                for key in ("library_name", "pipeline_tag"):
                    if key in data:
                        info[key] = data[key]
        if "config.json" in files:
            with open(self.server_hub.blob_path(files["config.json"]), encoding="utf-8") as f:
                config = json.load(f)
            info["config"] = {k: config[k] for k in ("architectures", "model_type", "quantization_config") if k in config}
        self._json(200, info)

    def tree(self, auth, query, ns, name, rev, sub=""):
        repo = self._repo(ns, name, auth)
        if repo is None:
            return
        snap = self._snapshot(repo, rev)
        if snap is None:
            return
        sub = (sub or "").strip("/")
        recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
        prefix = sub + "/" if sub else ""
        entries, dirs = [], set()
        for path, oid in sorted(snap[1].items()):
            if not path.startswith(prefix):
                continue
            rest = path[len(prefix):]
            parts = rest.split("/")
            for i in range(1, len(parts)):
                if recursive or i == 1:
                    dirs.add(prefix + "/".join(parts[:i]))
            if recursive or len(parts) == 1:
                entries.append(self._entry(path, oid))
        if sub and not entries and not dirs:
            return self._error(404, f"{sub} does not exist on {rev}", "EntryNotFound")
        out = [{"type": "directory", "path": d, "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0}
               for d in sorted(dirs)] + entries
        self._json(200, out)

    def paths_info(self, auth, query, ns, name, rev):
        raw = self._body()
        repo = self._repo(ns, name, auth)
        if repo is None:
            return
        snap = self._snapshot(repo, rev)
        if snap is None:
            return
        if self.headers.get("Content-Type", "").startswith("application/json"):
            paths = json.loads(raw or b"{}").get("paths", [])
        else:
            paths = parse_qs(raw.decode()).get("paths", [])
        out = []
        for p in paths:
            if p in snap[1]:
                out.append(self._entry(p, snap[1][p]))
            elif any(f.startswith(p.rstrip("/") + "/") for f in snap[1]):
                out.append({"type": "directory", "path": p, "oid": hashlib.sha1(p.encode()).hexdigest(), "size": 0})
        self._json(200, out)

    def resolve(self, auth, query, ns, name, rev, path):
        repo = self._repo(ns, name, auth)
        if repo is None:
            return
        snap = self._snapshot(repo, rev)
        if snap is None:
            return
        sha, files = snap
        if path not in files:
            return self._error(404, f"Entry not found: {path}", "EntryNotFound")
        oid = files[path]
        blob = self.server_hub.blob_path(oid)
        size = os.path.getsize(blob)
        headers = {"X-Repo-Commit": sha, "ETag": f'"{oid}"', "Accept-Ranges": "bytes"}
        start, stop, status = 0, size, 200
        rng = self.headers.get("Range") or self.headers.get("range")
        m = re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip()) if rng else None
        if m and size:
            if m.group(1):
                start = int(m.group(1))
                stop = min(size, int(m.group(2)) + 1) if m.group(2) else size
            else:  # suffix range
                start = max(0, size - int(m.group(2)))
            if start >= size:
                return self._send(416, b"", {"Content-Range": f"bytes */{size}"})
            status = 206
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
        if self.command == "HEAD":
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(stop - start))
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            self.server_hub.log.append((self.command, self.path, status))
            return
        with open(blob, "rb") as f:
            f.seek(start)
            data = f.read(stop - start)
        self._send(status, data, headers, content_type="application/octet-stream")


def _validate_card_data(data) -> list[str]:
    """The checks the Hub makes on a model card's metadata that matter here (types of the known fields)."""
    if not isinstance(data, dict):
        return ["metadata must be a YAML mapping"]
    errors = []
    for key in ("license", "license_name", "license_link", "library_name", "pipeline_tag", "base_model_relation"):
        if key in data and not isinstance(data[key], str):
            errors.append(f'"{key}" must be a string')
    for key in ("tags", "language", "base_model", "datasets"):
        value = data.get(key)
        if value is not None and not (isinstance(value, str) or (isinstance(value, list)
                                                                  and all(isinstance(v, str) for v in value))):
            errors.append(f'"{key}" must be a string or a list of strings')
    if data.get("base_model_relation") not in (None, "adapter", "merge", "quantized", "finetune"):
        errors.append('"base_model_relation" must be one of adapter, merge, quantized, finetune')
    if data.get("license") == "other" and not data.get("license_name"):
        errors.append('"license_name" is required when "license" is "other"')
    return errors


_REPO = r"([^/]+)/([^/]+)"
_ROUTES = [
    ("GET", r"/api/whoami-v2", _Handler.whoami),
    ("POST", r"/api/repos/create", _Handler.create_repo),
    ("POST", r"/api/validate-yaml", _Handler.validate_yaml),
    ("POST", rf"/api/models/{_REPO}/preupload/([^/]+)", _Handler.preupload),
    ("POST", rf"/api/models/{_REPO}/commit/([^/]+)", _Handler.commit),
    ("GET", rf"/api/models/{_REPO}/tree/([^/]+)(?:/(.*))?", _Handler.tree),
    ("POST", rf"/api/models/{_REPO}/paths-info/([^/]+)", _Handler.paths_info),
    ("GET", rf"/api/models/{_REPO}(?:/revision/([^/]+))?", _Handler.model_info),
    ("GET", rf"/{_REPO}/resolve/([^/]+)/(.+)", _Handler.resolve),
]


if __name__ == "__main__":  # a hub to poke at by hand: python tests/hub_server.py
    with LocalHub() as hub:
        print(f"HF_ENDPOINT={hub.url} HF_TOKEN={hub.token}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
