"""A local stand-in for the Hugging Face Hub HTTP API, enough for `huggingface_hub` pushes and downloads.

Standard library only (http.server in a thread), repositories held in memory. It answers the
endpoints the client uses to create a repository, validate a card, upload a folder (every file as a
"regular" upload: no LFS / Xet) and download files:

    POST /api/repos/create                      POST /api/validate-yaml
    POST /api/models/{repo}/preupload/{rev}     POST /api/models/{repo}/commit/{rev}   (NDJSON)
    GET  /api/models/{repo}[/revision/{rev}]    GET  /api/models/{repo}/tree/{rev}[/{path}]
    POST /api/models/{repo}/paths-info/{rev}    HEAD/GET /{repo}/resolve/{rev}/{path}

`validate-yaml` checks the model-card metadata the way the Hub's schema does for the fields our cards
use (licence id, tags, base_model, datasets, model-index) and answers 400 with the reasons otherwise.
Every request is recorded in `HubServer.requests`; unknown routes answer 404 so a missing endpoint
shows up in the test failure.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import yaml

# Licence ids the Hub accepts (an excerpt of its list; enough for these tests).
LICENSES = {"apache-2.0", "mit", "bsd-3-clause", "cc-by-4.0", "cc0-1.0", "llama3.2", "gemma", "other", "unknown"}
_REPO = r"(?P<repo>[\w.-]+(?:/[\w.-]+)?)"
_REV = r"(?P<rev>[^/]+)"


@dataclass
class Repository:
    files: dict[str, bytes] = field(default_factory=dict)
    commits: list[str] = field(default_factory=list)

    @property
    def sha(self) -> str:
        return self.commits[-1] if self.commits else "0" * 40


def _git_blob_sha(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def card_metadata_errors(content: str) -> list[str]:
    """Why the YAML header of a model card would be rejected (empty when it is valid)."""
    match = re.match(r"^---\n(.*?)\n---\n", content, flags=re.DOTALL)
    if not match:
        return ["no YAML metadata block at the top of the card"]
    try:
        meta = yaml.safe_load(match.group(1)) or {}
    except yaml.YAMLError as error:
        return [f"metadata is not valid YAML: {error}"]
    errors = []
    if "license" in meta and meta["license"] not in LICENSES:
        errors.append(f"license {meta['license']!r} is not a known licence id")
    for key in ("tags", "datasets", "base_model"):
        value = meta.get(key)
        values = value if isinstance(value, list) else [value] if value is not None else []
        if not all(isinstance(v, str) and v for v in values):
            errors.append(f"{key} must be a string or a list of strings")
    for entry in meta.get("model-index") or []:
        if not isinstance(entry, dict) or not entry.get("name"):
            errors.append("model-index entries need a name")
            continue
        for result in entry.get("results") or []:
            if not isinstance(result.get("task"), dict) or "type" not in result["task"]:
                errors.append("model-index result without task.type")
            dataset = result.get("dataset")
            if not isinstance(dataset, dict) or not dataset.get("name") or not dataset.get("type"):
                errors.append("model-index result without dataset.name and dataset.type")
            metrics = result.get("metrics") or []
            if not metrics or not all(isinstance(m, dict) and "type" in m and "value" in m for m in metrics):
                errors.append("model-index result needs metrics with type and value")
    return errors


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    # Routing -------------------------------------------------------------------------------------
    def do_HEAD(self) -> None:
        self._route("HEAD")

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def _route(self, method: str) -> None:
        path = unquote(urlsplit(self.path).path)
        self.server.hub.requests.append((method, path))
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) if method == "POST" else b""
        routes = [
            ("POST", r"/api/repos/create", self._create_repo),
            ("POST", r"/api/validate-yaml", self._validate_yaml),
            ("POST", rf"/api/models/{_REPO}/preupload/{_REV}", self._preupload),
            ("POST", rf"/api/models/{_REPO}/commit/{_REV}", self._commit),
            ("POST", rf"/api/models/{_REPO}/paths-info/{_REV}", self._paths_info),
            ("GET", rf"/api/models/{_REPO}/tree/{_REV}(?:/(?P<path>.*))?", self._tree),
            ("GET", rf"/api/models/{_REPO}(?:/revision/{_REV})?", self._model_info),
            ("GET", rf"/{_REPO}/resolve/{_REV}/(?P<path>.+)", self._resolve),
            ("HEAD", rf"/{_REPO}/resolve/{_REV}/(?P<path>.+)", self._resolve),
        ]
        for route_method, pattern, handler in routes:
            match = re.fullmatch(pattern, path)
            if route_method == method and match:
                handler(body=body, head=method == "HEAD", **{k: v for k, v in match.groupdict().items() if v})
                return
        self._send(404, {"error": f"{method} {path} is not served by the test hub"})

    # Responses -----------------------------------------------------------------------------------
    def _send(self, status: int, payload: Any = None, headers: dict[str, str] | None = None, raw: bytes | None = None,
              head: bool = False) -> None:
        data = raw if raw is not None else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream" if raw is not None else "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(data)

    def _repository(self, repo: str, head: bool = False) -> Repository | None:
        found = self.server.hub.repos.get(repo)
        if found is None:
            self._send(404, {"error": f"Repository {repo} not found"}, {"X-Error-Code": "RepoNotFound"}, head=head)
        return found

    # Endpoints -----------------------------------------------------------------------------------
    def _create_repo(self, body: bytes, **_: Any) -> None:
        request = json.loads(body)
        repo = f"{request['organization']}/{request['name']}" if request.get("organization") else request["name"]
        url = f"{self.server.hub.url}/{repo}"
        if repo in self.server.hub.repos:
            self._send(409, {"error": "You already created this model repo", "url": url})
            return
        self.server.hub.repos[repo] = Repository()
        self._send(200, {"url": url, "name": repo})

    def _validate_yaml(self, body: bytes, **_: Any) -> None:
        errors = card_metadata_errors(json.loads(body)["content"])
        self.server.hub.validations.append(errors)
        if errors:
            self._send(400, {"error": "; ".join(errors)})
        else:
            self._send(200, {"errors": [], "warnings": []})

    def _preupload(self, body: bytes, repo: str, **_: Any) -> None:
        if self._repository(repo) is not None:
            files = json.loads(body)["files"]
            self._send(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                       for f in files]})

    def _commit(self, body: bytes, repo: str, **_: Any) -> None:
        repository = self._repository(repo)
        if repository is None:
            return
        for line in body.decode().splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            if item["key"] == "file":
                value = item["value"]
                repository.files[value["path"]] = base64.b64decode(value["content"])
            elif item["key"] == "deletedFile":
                repository.files.pop(item["value"]["path"], None)
        sha = hashlib.sha1(f"{repo}{len(repository.commits)}{sorted(repository.files)}".encode()).hexdigest()
        repository.commits.append(sha)
        self._send(200, {"commitUrl": f"{self.server.hub.url}/{repo}/commit/{sha}", "commitOid": sha,
                         "pullRequestUrl": None})

    def _entry(self, path: str, content: bytes) -> dict[str, Any]:
        return {"type": "file", "path": path, "size": len(content), "oid": _git_blob_sha(content)}

    def _paths_info(self, body: bytes, repo: str, **_: Any) -> None:
        repository = self._repository(repo)
        if repository is not None:
            paths = json.loads(body).get("paths", [])
            self._send(200, [self._entry(p, repository.files[p]) for p in paths if p in repository.files])

    def _tree(self, repo: str, path: str = "", **_: Any) -> None:
        repository = self._repository(repo)
        if repository is None:
            return
        prefix = f"{path.strip('/')}/" if path.strip("/") else ""
        entries = [self._entry(p, c) for p, c in sorted(repository.files.items()) if p.startswith(prefix)]
        if prefix and not entries:
            self._send(404, {"error": f"{path} not found"}, {"X-Error-Code": "EntryNotFound"})
            return
        self._send(200, entries)

    def _model_info(self, repo: str, **_: Any) -> None:
        repository = self._repository(repo)
        if repository is not None:
            self._send(200, {"id": repo, "modelId": repo, "sha": repository.sha, "private": False, "tags": [],
                             "siblings": [{"rfilename": p} for p in sorted(repository.files)]})

    def _resolve(self, repo: str, path: str, head: bool, **_: Any) -> None:
        repository = self._repository(repo, head=head)
        if repository is None:
            return
        content = repository.files.get(path)
        if content is None:
            self._send(404, {"error": f"{path} not found"}, {"X-Error-Code": "EntryNotFound"}, head=head)
            return
        headers = {"X-Repo-Commit": repository.sha, "ETag": f'"{_git_blob_sha(content)}"'}
        self._send(200, headers=headers, raw=content, head=head)


class _Server(ThreadingHTTPServer):
    hub: HubServer


class HubServer:
    """`with HubServer() as hub:` serves on `hub.url` (127.0.0.1, a free port) until the block ends."""

    def __init__(self) -> None:
        self.repos: dict[str, Repository] = {}
        self.requests: list[tuple[str, str]] = []
        self.validations: list[list[str]] = []
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.hub = self
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def env(self, home: Path) -> dict[str, str]:
        """Environment variables of a process that talks to this server (online, a token, `home` as HF_HOME)."""
        return {"HF_ENDPOINT": self.url, "HF_HUB_OFFLINE": "0", "HF_TOKEN": "hf_test", "HF_HOME": str(home)}

    def use_in_this_process(self, monkeypatch: Any, home: Path) -> None:
        """Point huggingface_hub in this process at the server (what `env` does for a subprocess)."""
        from huggingface_hub import constants

        monkeypatch.setattr(constants, "ENDPOINT", self.url)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setenv("HF_TOKEN", "hf_test")
        monkeypatch.setenv("HF_HOME", str(home))

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
