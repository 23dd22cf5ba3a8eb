"""Connect a notebook or script to Ray: nothing (in-process), a local instance, or a cluster.

    info = connect("local", num_cpus=2)            # starts Ray here, bound to 127.0.0.1
    info = connect("ray://10.0.0.5:10001")         # a remote cluster through Ray Client
    info = connect("auto")                         # the cluster this machine belongs to
    info = connect(None)                           # RAY_ADDRESS if set, else in-process
    disconnect()

Every call prints one line saying where it is connected. Services of a local instance bind to
127.0.0.1 (Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 as "use the loopback address"; it must
be set before ray is first imported, which connect does). Ray 2.60 turns token authentication
on by default: `ray start` writes ~/.ray/auth_token, and a client must send it. When a token is
there (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token) and RAY_AUTH_MODE is unset,
connect sets RAY_AUTH_MODE=token for this process, as Ray's docs ask clients to.
"""

from __future__ import annotations

import os
import platform
import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.deps import require

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray's node address is 127.0.0.1
CLIENT_RETRIES = 3  # Ray Client's per-client server sometimes dies as it starts (ray#63202)


@dataclass(frozen=True)
class ClusterInfo:
    """Where this process is connected."""

    kind: str  # "in-process" | "local" (started here) | "remote" (an existing cluster)
    address: str  # what was connected to ("" in-process)
    dashboard_url: str  # "" when there is no dashboard
    ray_version: str  # "" in-process
    python_version: str


def token_available() -> bool:
    """True when a Ray auth token is set in the environment or lies in ~/.ray/auth_token."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH", "")
    return bool(os.environ.get("RAY_AUTH_TOKEN")) or (bool(path) and Path(path).is_file()) \
        or (Path.home() / ".ray" / "auth_token").is_file()


def prepare_environment(loopback: bool = True) -> None:
    """Environment Ray reads at import or connect time: loopback binding, token auth mode."""
    if loopback and "ray" not in sys.modules:
        os.environ.setdefault(LOOPBACK_ENV, "0")
    if "RAY_AUTH_MODE" not in os.environ and token_available():
        os.environ["RAY_AUTH_MODE"] = "token"


def resolve_address(address: str | None) -> str:
    """None -> RAY_ADDRESS (or "" = in-process); anything else unchanged."""
    if address is None:
        return os.environ.get("RAY_ADDRESS", "")
    return address


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A TCP connect to host:port of `address`; ConnectionError saying what to check if not."""
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        return  # not host:port (e.g. a cluster name Ray resolves itself)
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise ConnectionError(
            f"cannot reach a Ray cluster at {address} ({err.strerror or err}). Check that the "
            "head node is running (`ray status` there), that the port is the Ray Client port "
            "(ray start --ray-client-server-port, default 10001) and that it is reachable from "
            "here (a port-forward or VPN for a remote cluster).") from None


def explain_connect_error(err: Exception, address: str) -> Exception:
    """Ray's connection errors as one clear ConnectionError (version mismatch, auth, ...)."""
    text = str(err)
    if "Version mismatch" in text:
        versions = re.findall(r"Ray: (\S+)\s+Python: (\S+)", text)
        (c_ray, c_py), (m_ray, m_py) = versions[:2] if len(versions) >= 2 else (("?", "?"),) * 2
        return ConnectionError(
            f"Ray Client at {address} needs the same Ray and Python versions on both sides: the "
            f"cluster runs Ray {c_ray} on Python {c_py}, this process Ray {m_ray} on Python "
            f"{m_py}. Install ray=={c_ray} in a Python {'.'.join(c_py.split('.')[:2])} "
            "environment, or submit the run as a Ray Job (python -m workbench submit).")
    lowered = text.lower()
    if "authentication" in lowered or ("auth" in lowered and "token" in lowered):
        return ConnectionError(
            f"the Ray cluster at {address} asks for its auth token: copy the head node's "
            "~/.ray/auth_token here (or set RAY_AUTH_TOKEN) and set RAY_AUTH_MODE=token. "
            f"Ray said: {text.splitlines()[0] if text else type(err).__name__}")
    hint = ""
    if "died while starting" in lowered or "startup failed" in lowered:
        hint = (" The head's Ray Client server could not start the process that serves this "
                "connection (it starts one a client, and that can fail when several clients "
                "connect at once): connect again.")
    elif ("timeout" in lowered or "timed out" in lowered) and not token_available():
        hint = (" Ray Client waits about 30 s and then times out when the cluster wants an auth "
                "token and this process has none (Ray 2.60 turns token auth on by default): "
                "copy the head node's ~/.ray/auth_token here or set RAY_AUTH_TOKEN.")
    return ConnectionError(f"could not connect to Ray at {address}: {type(err).__name__}: "
                           f"{text.splitlines()[0] if text else ''}.{hint}")


def _start_local(num_cpus: int | None, num_gpus: int | None, dashboard: bool,
                 temp_dir: str | Path | None, ray: Any) -> Any:
    # address "local": always a new instance (with none, ray.init joins a cluster that
    # `ray start` left running on this machine, and then refuses num_cpus / num_gpus)
    kwargs: dict[str, Any] = {"address": "local", "num_cpus": num_cpus or None,
                              "num_gpus": num_gpus or None,
                              "include_dashboard": dashboard, "dashboard_host": "127.0.0.1",
                              "log_to_driver": True}
    if temp_dir:
        Path(temp_dir).mkdir(parents=True, exist_ok=True)
        kwargs["_temp_dir"] = str(Path(temp_dir).resolve())
    return ray.init(**kwargs)


def connect(
    address: str | None = None,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    dashboard: bool = False,
    temp_dir: str | Path | None = None,
    loopback: bool = True,
    log: Any = print,
) -> ClusterInfo:
    """Connect to Ray as `address` says ("" in-process, "local", "auto", "ray://host:port",
    None = RAY_ADDRESS); prints one line. Reuses a connection that is already open."""
    address = resolve_address(address)
    python = platform.python_version()
    if not address:
        log("in-process: no Ray (set cluster.address=local or an address to use Ray)")
        return ClusterInfo("in-process", "", "", "", python)
    prepare_environment(loopback)
    ray = require("ray")
    if ray.is_initialized():  # one connection per process: keep the open one
        return _describe(ray, _current_address(ray, address),
                         "local" if address == "local" else "remote", log)
    if address == "local":
        if loopback and os.environ.get(LOOPBACK_ENV) != "0":
            log(f"note: ray was imported before connect() without {LOOPBACK_ENV}=0, so this "
                "instance binds to the machine's address, not only to 127.0.0.1")
        info = _start_local(num_cpus, num_gpus, dashboard, temp_dir, ray)
        return _describe(ray, info.address_info.get("address", "local"), "local", log,
                         info.dashboard_url or "")
    check_reachable(address)
    try:
        info = _init_remote(ray, address, log)
    except Exception as err:  # Ray raises RuntimeError, ConnectionError, AuthenticationError, ...
        raise explain_connect_error(err, address) from err
    shown = address if address.startswith("ray://") else _current_address(ray, address)
    return _describe(ray, shown, "remote", log, getattr(info, "dashboard_url", "") or "")


def _init_remote(ray: Any, address: str, log: Any, retries: int = CLIENT_RETRIES) -> Any:
    """ray.init(address), again when Ray Client's per-client server dies as it starts."""
    for _ in range(retries):
        try:
            return ray.init(address=address, log_to_driver=True)
        except ConnectionAbortedError as err:  # "Initialization failure from server"
            if "Initialization failure" not in str(err):
                raise
            log(f"Ray Client's server at {address} died while starting (a known Ray race, "
                "ray-project/ray#63202); connecting again")
    return ray.init(address=address, log_to_driver=True)


def _current_address(ray: Any, fallback: str) -> str:
    try:
        return ray.get_runtime_context().gcs_address or fallback
    except Exception:  # Ray Client has no GCS address here
        return fallback


def _describe(ray: Any, address: str, kind: str, log: Any, dashboard: str = "") -> ClusterInfo:
    info = ClusterInfo(kind, address, dashboard, ray.__version__, platform.python_version())
    where = {"local": "a local Ray instance", "remote": "the Ray cluster"}[kind]
    auth = os.environ.get("RAY_AUTH_MODE", "default")
    extra = f", dashboard {dashboard}" if dashboard else ""
    log(f"connected to {where} at {address} (Ray {info.ray_version}, Python "
        f"{info.python_version}, auth {auth}{extra})")
    return info


def disconnect() -> None:
    """Leave Ray (stops a local instance started by connect); a no-op when not connected."""
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()
