"""Storage: one interface over a local folder or an S3 prefix.

    store = open_store("s3://bucket/runs/a", endpoint_url="http://127.0.0.1:9000")
    put_folder(store, "exports/global_step_4", Path("runs/a/exports/global_step_4"))
    get_folder(store, "exports/global_step_4", Path("/tmp/adapter"))   # refuses a torn upload
    list_dir(store, "exports"); exists(store, "config.json"); read_json(store, "config.json")
    mirror(store, Path("wc"), whole=("exports",))   # a working copy: upload what changed

S3 goes through boto3 with the usual AWS settings: credentials and region from the environment,
~/.aws or an instance role; the endpoint from `endpoint_url`, else AWS_ENDPOINT_URL(_S3), else
AWS itself. Folders are uploaded file by file with their `COMPLETE` marker last (an existing
marker is deleted first), so a torn upload is never taken as complete: `get_folder` refuses a
folder without it. A working copy is a local folder that mirrors a prefix: `pull` downloads
into it, `mirror` uploads what changed in it since (files, then whole complete folders, then a
marker file last), judged by the size and mtime it recorded. Credentials are never stored here:
reprs show only the URL, and S3 errors become `StorageError`s whose text is scrubbed of any key
this process knows. What a run folder holds, and how a run opens one here or on S3, is
`workbench.runfolder`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path
from typing import Any

from workbench.deps import require
from workbench.session.checkpoint import COMPLETE, atomic_write

CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


class StorageError(RuntimeError):
    """A storage operation that failed (its message never holds credentials)."""


class IncompleteUpload(StorageError):
    """A folder without its COMPLETE marker: interrupted upload or write."""


def is_s3(url: str | Path) -> bool:
    """True for s3://bucket[/prefix]."""
    return str(url).startswith("s3://")


@dataclass(frozen=True)
class Store:
    """A storage root: a local folder or s3://bucket/prefix (no credentials in here)."""

    root: str  # local folder or s3://bucket/prefix
    endpoint_url: str = ""  # S3-compatible endpoint; "" = AWS_ENDPOINT_URL(_S3) or AWS

    @property
    def s3(self) -> bool:
        return is_s3(self.root)

    @property
    def bucket(self) -> str:
        return self.root[5:].split("/", 1)[0]

    @property
    def prefix(self) -> str:
        """Key prefix under the bucket, without slashes at either end."""
        parts = self.root[5:].split("/", 1)
        return parts[1].strip("/") if len(parts) > 1 else ""

    @cached_property
    def client(self) -> Any:
        """boto3 S3 client (made on first use; region and credentials from AWS settings)."""
        boto3 = require("boto3")
        return boto3.session.Session().client("s3", endpoint_url=self.endpoint_url or None)

    def __repr__(self) -> str:
        where = f", endpoint_url={redact(self.endpoint_url)!r}" if self.endpoint_url else ""
        return f"Store({redact(self.root)!r}{where})"

    def __getstate__(self) -> dict[str, Any]:  # the client stays behind (it is not picklable)
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            object.__setattr__(self, key, value)


def open_store(root: str | Path, endpoint_url: str = "") -> Store:
    """A Store over `root`: s3://bucket/prefix or a local folder (made absolute)."""
    text = str(root)
    if is_s3(text):
        if not text[5:].split("/", 1)[0]:
            raise StorageError(f"{text!r} names no bucket: use s3://bucket/prefix")
        return Store(text.rstrip("/"), endpoint_url)
    return Store(str(Path(text).expanduser().resolve()), endpoint_url)


def url(store: Store, *parts: str) -> str:
    """Full URL (or path) of a key under the store."""
    key = "/".join(p.strip("/") for p in parts if p.strip("/"))
    return f"{store.root}/{key}" if key else store.root


def _key(store: Store, *parts: str) -> str:
    return "/".join(p.strip("/") for p in (store.prefix, *parts) if p.strip("/"))


def _path(store: Store, *parts: str) -> Path:
    return Path(store.root, *[p.strip("/") for p in parts if p.strip("/")])


# ------------------------------------------------------------------------- redaction


def redact(text: str, store: Store | None = None) -> str:
    """`text` with credentials removed: AWS keys from the environment (and the store's client),
    and user:password@ in URLs."""
    text = re.sub(r"(\w+://)[^/@\s]+@", r"\1***@", str(text))
    for secret in _known_secrets(store):
        text = text.replace(secret, "***")
    return text


def _known_secrets(store: Store | None) -> list[str]:
    secrets = [os.environ.get(name, "") for name in CREDENTIAL_ENV]
    client = store.__dict__.get("client") if store is not None else None
    creds = getattr(getattr(client, "_request_signer", None), "_credentials", None)
    if creds is not None:
        secrets += [creds.access_key or "", creds.secret_key or "", creds.token or ""]
    return sorted({s for s in secrets if len(s) >= 4}, key=len, reverse=True)


@contextmanager
def _errors(store: Store, op: str, key: str) -> Iterator[None]:
    """Turn boto errors into StorageError / FileNotFoundError with scrubbed messages."""
    try:
        yield
    except (StorageError, FileNotFoundError):
        raise
    except Exception as err:
        if type(err).__module__.split(".")[0] not in ("botocore", "boto3", "urllib3", "s3transfer"):
            raise
        code = getattr(err, "response", {}).get("Error", {}).get("Code", type(err).__name__)
        where = url(store, key.removeprefix(store.prefix).strip("/"))
        message = redact(f"S3 {op} of {where} failed: {code}: {_first_line(err)}", store)
        if code in ("NoSuchKey", "404", "NotFound"):
            raise FileNotFoundError(message) from None
        raise StorageError(message) from None


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# ------------------------------------------------------------------------- files


def exists(store: Store, key: str) -> bool:
    """True when a file exists at key."""
    if not store.s3:
        return _path(store, key).is_file()
    with _errors(store, "head", _key(store, key)):
        try:
            store.client.head_object(Bucket=store.bucket, Key=_key(store, key))
            return True
        except Exception as err:
            if getattr(err, "response", {}).get("Error", {}).get("Code") in ("404", "NoSuchKey"):
                return False
            raise


def read_bytes(store: Store, key: str) -> bytes:
    """The bytes of a file (FileNotFoundError when absent)."""
    if not store.s3:
        path = _path(store, key)
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist")
        return path.read_bytes()
    with _errors(store, "get", _key(store, key)):
        return store.client.get_object(Bucket=store.bucket, Key=_key(store, key))["Body"].read()


def write_bytes(store: Store, key: str, data: bytes) -> None:
    """Write a file (a local one atomically)."""
    if not store.s3:
        atomic_write(_path(store, key), data)
        return
    with _errors(store, "put", _key(store, key)):
        store.client.put_object(Bucket=store.bucket, Key=_key(store, key), Body=data)


def read_json(store: Store, key: str) -> Any:
    """Parsed JSON of a file."""
    return json.loads(read_bytes(store, key))


def write_json(store: Store, key: str, data: Any) -> None:
    """Write data as indented JSON."""
    write_bytes(store, key, json.dumps(data, indent=1).encode())


def put_file(store: Store, key: str, local: Path) -> None:
    """Upload (or copy) one local file to key."""
    if not store.s3:
        write_bytes(store, key, Path(local).read_bytes())
        return
    with _errors(store, "upload", _key(store, key)):
        store.client.upload_file(str(local), store.bucket, _key(store, key))


def get_file(store: Store, key: str, local: Path) -> Path:
    """Download (or copy) one file to a local path."""
    local = Path(local)
    local.parent.mkdir(parents=True, exist_ok=True)
    if not store.s3:
        shutil.copyfile(_path(store, key), local)
        return local
    with _errors(store, "download", _key(store, key)):
        store.client.download_file(store.bucket, _key(store, key), str(local))
    return local


def list_dir(store: Store, key: str = "") -> list[str]:
    """Names directly under key (files and folders), sorted; [] when there is nothing."""
    if not store.s3:
        folder = _path(store, key)
        return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    prefix = _key(store, key)
    prefix = f"{prefix}/" if prefix else ""
    names: set[str] = set()
    with _errors(store, "list", prefix):
        pages = store.client.get_paginator("list_objects_v2").paginate(
            Bucket=store.bucket, Prefix=prefix, Delimiter="/")
        for page in pages:
            names |= {c["Prefix"][len(prefix):].rstrip("/") for c in page.get("CommonPrefixes", [])}
            names |= {o["Key"][len(prefix):] for o in page.get("Contents", [])}
    return sorted(n for n in names if n)


def list_files(store: Store, key: str = "") -> list[str]:
    """Every file under key, as paths relative to key, sorted."""
    if not store.s3:
        folder = _path(store, key)
        return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                      if p.is_file()) if folder.is_dir() else []
    prefix = _key(store, key)
    prefix = f"{prefix}/" if prefix else ""
    out = []
    with _errors(store, "list", prefix):
        for page in store.client.get_paginator("list_objects_v2").paginate(
                Bucket=store.bucket, Prefix=prefix):
            out += [o["Key"][len(prefix):] for o in page.get("Contents", [])]
    return sorted(out)


def delete(store: Store, key: str) -> None:
    """Remove a file or a whole folder (no error when absent)."""
    if not store.s3:
        path = _path(store, key)
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        return
    files = [f"{key}/{f}".strip("/") for f in list_files(store, key)]
    with _errors(store, "delete", _key(store, key)):
        if key.strip("/"):  # a file at key itself (deleting a missing key is not an error)
            store.client.delete_object(Bucket=store.bucket, Key=_key(store, key))
        for start in range(0, len(files), 1000):
            batch = [{"Key": _key(store, f)} for f in files[start:start + 1000]]
            store.client.delete_objects(Bucket=store.bucket, Delete={"Objects": batch})


# ------------------------------------------------------------------------- folders


def folder_complete(store: Store, key: str) -> bool:
    """True when the folder at key carries its COMPLETE marker."""
    return exists(store, f"{key}/{COMPLETE}")


def put_folder(store: Store, key: str, local: Path) -> None:
    """Upload a complete local folder to key: the remote marker is removed first, the files
    go up, files the folder no longer has are removed, and a new marker is written last."""
    local = Path(local)
    if not (local / COMPLETE).is_file():
        raise IncompleteUpload(f"{local} has no {COMPLETE} marker: not uploading a torn folder")
    marker = _marker_base((local / COMPLETE).read_text())
    delete(store, f"{key}/{COMPLETE}")
    names = sorted(p.relative_to(local).as_posix() for p in local.rglob("*")
                   if p.is_file() and p != local / COMPLETE)  # nested markers go up as files
    for name in names:
        put_file(store, f"{key}/{name}", local / name)
    for stale in set(list_files(store, key)) - set(names):
        delete(store, f"{key}/{stale}")
    write_bytes(store, f"{key}/{COMPLETE}", f"{marker} upload={uuid.uuid4().hex}\n".encode())


def _marker_base(text: str) -> str:
    """A COMPLETE marker without upload tokens: "ok" and the manifest's "sha256=..." (kept, so
    a downloaded folder still verifies; session.checkpoint.verify_folder)."""
    kept = [t for t in text.split() if t.startswith("sha256=")]
    return " ".join(["ok", *kept[:1]])


def get_folder(store: Store, key: str, local: Path) -> Path:
    """Download a complete folder into `local` (replaced atomically); IncompleteUpload when the
    remote folder has no COMPLETE marker (a torn or running upload)."""
    local = Path(local)
    if not folder_complete(store, key):
        raise IncompleteUpload(f"{redact(url(store, key), store)} has no {COMPLETE} marker "
                               "(an interrupted or unfinished upload): not using it")
    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{local.name}.tmp-", dir=local.parent))
    try:
        for name in list_files(store, key):
            get_file(store, f"{key}/{name}", tmp / name)
        if local.exists():
            shutil.rmtree(local)
        os.replace(tmp, local)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return local


def marker_token(store: Store, key: str) -> str:
    """Content of a folder's COMPLETE marker: changes with every upload (cache validation)."""
    return read_bytes(store, f"{key}/{COMPLETE}").decode().strip()


def cached_folder(store: Store, key: str, cache: Path) -> Path:
    """A local copy of the complete folder at key: a local store's own folder, or for S3 a
    download into `cache`, made once per upload (the COMPLETE marker's token names the copy).
    IncompleteUpload when the folder is missing or torn."""
    if not folder_complete(store, key):
        raise IncompleteUpload(f"{redact(url(store, key), store)} has no {COMPLETE} marker "
                               "(missing, interrupted or unfinished upload)")
    if not store.s3:
        return _path(store, key)
    token = marker_token(store, key)
    local = Path(cache) / re.sub(r"[^A-Za-z0-9._-]+", "_", url(store, key)[5:].strip("/"))
    if (local / COMPLETE).is_file() and (local / COMPLETE).read_text().strip() == token:
        return local
    return get_folder(store, key, local)


# ------------------------------------------------------------------------- working copies

MIRROR_STATE = ".mirror-state.json"  # in a working copy: each file's size and mtime as uploaded


def working_copy(local: Path) -> Path:
    """`local` made an empty working copy (whatever an earlier one held is removed)."""
    if local.exists():
        shutil.rmtree(local)
    local.mkdir(parents=True)
    _save_mirror_state(local, {})  # marks the folder as a working copy
    return local


def is_working_copy(local: Path) -> bool:
    """True for a folder that working_copy made (or that pull or mirror wrote)."""
    return (local / MIRROR_STATE).is_file()


def pull(store: Store, keys: list[str], local: Path) -> None:
    """Download the files `keys` into the working copy `local`, which then records everything
    it holds as uploaded."""
    for key in keys:
        get_file(store, key, local / key)
    _save_mirror_state(local, _local_state(local))


def mirror(store: Store, local: Path, whole: tuple[str, ...] = (), last: str = "") -> list[str]:
    """Upload what changed in the working copy `local` since the last call: the files first
    (those under `whole` folders excepted), then each changed folder directly under a `whole`
    folder once it is complete (put_folder: COMPLETE last), then the file `last` (a marker that
    must follow them). Returns the keys uploaded."""
    state = local / MIRROR_STATE
    done = json.loads(state.read_text()) if state.is_file() else {}
    now, sent = _local_state(local), []
    changed = {k for k, v in now.items() if done.get(k) != v}
    folders = sorted({"/".join(k.split("/")[:2]) for k in changed
                      if k.split("/")[0] in whole and k.count("/") >= 2})
    files = sorted(k for k in changed if k.split("/")[0] not in whole)
    for key in [k for k in files if k != last]:
        put_file(store, key, local / key)
        sent.append(key)
        done[key] = now[key]
    for folder in folders:
        if (local / folder / COMPLETE).is_file():
            put_folder(store, folder, local / folder)
            sent.append(folder)
            done |= {k: now[k] for k in now if k.startswith(folder + "/")}
    if last in files:
        put_file(store, last, local / last)
        sent.append(last)
        done[last] = now[last]
    _save_mirror_state(local, done)
    return sent


def _local_state(local: Path) -> dict[str, list[int]]:
    state = {}
    for path in local.rglob("*"):
        rel = path.relative_to(local)
        if path.is_file() and not any(part.startswith(".") for part in rel.parts):
            stat = path.stat()
            state[rel.as_posix()] = [stat.st_size, stat.st_mtime_ns]
    return state


def _save_mirror_state(local: Path, state: dict[str, list[int]]) -> None:
    (local / MIRROR_STATE).write_text(json.dumps(state))
