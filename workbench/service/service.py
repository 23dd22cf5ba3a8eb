"""The session server's state: its users' sessions, their training clients (one LoRA tenant
each over the one base, `session.tenants`), their samplers, the calls in flight and the tokens
each session used. The HTTP routes (`service.app`) read a request, then call one method here.

    service = Service(open_session(spec), ServiceSettings())
    sid = service.create_session()
    call = service.create_model(sid, base_model, rank=8, seed=0)       # a Call: a future
    call = service.train(model_id, seq_id, "forward_backward", datums, ...)

Order. Every call reaches the session's executor through one dispatch thread, in the order it
was accepted, so the executor's lanes run them in that order, as they run an in-process
user's. A training client's calls carry tinker's `seq_id` (1, 2, ...): one that comes early
waits until those before it have come; one that comes twice gets the first one's request id.

Limits. At most `max_queue` calls not finished, over every user: one more gets 429 with
Retry-After (the SDK waits and sends it again). A session that sends no heartbeat (the SDK sends
one every 10 s) for `session_timeout_s` is ended: its adapters are freed and its ids answer 404.

Usage. Each finished call adds its tokens to its session's `Usage` (the prompt tokens a sampler
read, the tokens it sampled, the tokens trained on and the tokens scored without a gradient)
and writes one line to `<workdir>/usage.jsonl`.

Every method runs on the app's event loop thread except `_dispatch`'s thunks (the dispatch
thread) and the futures' callbacks (the executor's threads), which touch only `Call`s and,
under a lock, the usage.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from workbench.policy import SamplingParams, Stream
from workbench.serve.errors import RequestError
from workbench.session import checkpoint, host
from workbench.session.protocols import SessionLike
from workbench.session.tenants import Tenant, call_as, drop_tenant, forward_as

NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
TINKER_PATH = re.compile(r"tinker://(?P<model>[^/]+)/(?P<kind>weights|sampler_weights)/"
                         r"(?P<name>[^/]+)")


class ServiceError(RequestError):
    """A request refused before it is queued: the endpoint's RequestError (`status` is the HTTP
    status it gets), positional as this server raises it."""

    def __init__(self, message: str, status: int = 400, headers: dict | None = None) -> None:
        super().__init__(message, status=status, headers=headers)


@dataclass(frozen=True)
class ServiceSettings:
    """What the server takes and keeps (`python -m workbench session-server --help`)."""

    api_key_sha256: str = ""  # sha256 of the key clients send as X-API-Key ("" = no key)
    max_queue: int = 64  # calls accepted and not finished, over every user; then 429
    session_timeout_s: float = 60.0  # a session without a heartbeat this long is ended
    poll_s: float = 20.0  # how long retrieve_future holds a call that is not done
    keep_results_s: float = 600.0  # a finished call's result is kept this long
    max_body_bytes: int = 64 * 2**20  # a request body (images travel in it); then 413
    body_timeout_s: float = 30.0  # a request body must have arrived by then; then 408
    max_image_pixels: int = 4096 * 4096  # pixels of one image, read from its header
    default_max_tokens: int = 256  # a sample request without max_tokens
    max_context: int = 0  # prompt + reply tokens of a sample (0: the model's, up to 32,768)


@dataclass
class Usage:
    """Tokens a session used, as the seed's per-token billing counts them."""

    prompt_tokens: int = 0  # prompt tokens a sampler read
    sampled_tokens: int = 0  # tokens sampled
    trained_tokens: int = 0  # tokens of forward_backward datums
    forward_tokens: int = 0  # tokens of forward datums (no gradient)

    def add(self, other: Usage) -> None:
        for key, value in asdict(other).items():
            setattr(self, key, getattr(self, key) + value)


@dataclass
class Call:
    """One accepted call: its future and how its result goes back (json, forward or sample)."""

    request_id: str
    session_id: str
    kind: str  # "json" | "forward" | "sample"
    result_of: Callable[[Any], Any]  # the executor's result -> what the future holds
    future: Future = field(default_factory=Future)
    finished_at: float = 0.0


@dataclass
class Model:
    """A training client: its tenant and its seq_id order."""

    model_id: str
    session_id: str
    tenant: Tenant
    next_seq: int = 1
    waiting: dict[int, tuple[Call, Callable[[], Any]]] = field(default_factory=dict)
    requests: dict[int, str] = field(default_factory=dict)  # seq_id -> request id


@dataclass
class Client:
    """A user's session (tinker's `create_session`)."""

    session_id: str
    last_seen: float
    models: list[str] = field(default_factory=list)
    samplers: dict[str, int] = field(default_factory=dict)  # sampling session -> version
    usage: Usage = field(default_factory=Usage)
    ended: str = ""  # why it ended ("" while it runs)


class Service:
    """One session behind many users: see the module docstring."""

    def __init__(self, session: SessionLike, settings: ServiceSettings,
                 base_model: str, max_rank: int, aliases: tuple[str, ...] = ()) -> None:
        self.session, self.settings, self.max_rank = session, settings, max_rank
        self.executor: Any = session  # the clients' Executor (both backends are one)
        self.base_model, self.aliases = base_model, (base_model, *aliases)
        self.workdir = Path(session.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)  # usage.jsonl goes here
        self.clients: dict[str, Client] = {}
        self.models: dict[str, Model] = {}
        self.calls: dict[str, Call] = {}
        self._dispatcher = ThreadPoolExecutor(1, thread_name_prefix="workbench-dispatch")
        self._usage_lock = threading.Lock()
        self._ids = 0

    # ------------------------------------------------------------------------ sessions

    def create_session(self) -> str:
        sid = f"sess-{secrets.token_hex(4)}"
        self.clients[sid] = Client(sid, time.monotonic())
        return sid

    def client(self, session_id: str) -> Client:
        """A running session, or 404 naming why not."""
        c = self.clients.get(session_id)
        if c is None:
            raise ServiceError(f"no session {session_id!r} on this server", 404)
        if c.ended:
            raise ServiceError(f"session {session_id} ended ({c.ended})", 404)
        c.last_seen = time.monotonic()
        return c

    def heartbeat(self, session_id: str) -> None:
        c = self.clients.get(session_id)
        if c is None or c.ended:
            raise ServiceError(f"session {session_id} is not running", 410)
        c.last_seen = time.monotonic()

    def end_session(self, session_id: str, why: str) -> None:
        """Free the session's adapters and samplers; its ids answer 404 from now on."""
        c = self.clients.get(session_id)
        if c is None or c.ended:
            return
        c.ended = why
        for model_id in c.models:
            model = self.models.pop(model_id, None)
            for call, _ in (model.waiting.values() if model else ()):  # their turn never comes
                call.future.set_exception(ServiceError(f"session {session_id} ended ({why}) "
                                                       "before this call's turn"))
                call.finished_at = time.monotonic()
        self._dispatch(lambda: [self.executor.submit_all(drop_tenant, m) for m in c.models])
        c.samplers.clear()
        self._record(session_id, "end", Usage(), {"why": why, "total": asdict(c.usage)})

    def expire(self) -> list[str]:
        """End the sessions past session_timeout_s without a heartbeat, and forget results
        kept past keep_results_s -> the sessions ended."""
        now = time.monotonic()
        gone = [sid for sid, c in self.clients.items()
                if not c.ended and now - c.last_seen > self.settings.session_timeout_s]
        for sid in gone:
            self.end_session(sid, f"no heartbeat for {self.settings.session_timeout_s:g} s")
        for rid in [rid for rid, call in self.calls.items() if call.finished_at
                    and now - call.finished_at > self.settings.keep_results_s]:
            del self.calls[rid]
        return gone

    # -------------------------------------------------------------------------- models

    def check_base(self, base_model: str) -> None:
        if base_model not in self.aliases:
            raise ServiceError(f"base model {base_model!r} is not served here: this server "
                               f"serves {self.base_model!r}", 404)

    def create_model(self, session_id: str, model_seq_id: int, base_model: str, rank: int,
                     seed: int | None) -> tuple[str, Call]:
        """A training client: a fresh tenant of `rank` -> (model id, its call)."""
        client = self.client(session_id)
        self.check_base(base_model)
        if not 0 <= rank <= self.max_rank:
            raise ServiceError(f"LoRA rank {rank} is not served: this server's adapters have "
                               f"rank 1 to {self.max_rank} (its base's LoRA rank)")
        model_id = f"{session_id}:train:{model_seq_id}"
        if model_id in self.models:
            raise ServiceError(f"model {model_id} exists: model_seq_id {model_seq_id} was used")
        tenant = Tenant(model_id, rank or self.max_rank, 0 if seed is None else seed)
        self.models[model_id] = Model(model_id, session_id, tenant)
        client.models.append(model_id)
        self._write_model(model_id, tenant)
        call = self._call(session_id, "json", lambda: self.executor.submit(
            call_as, tenant, _rank_of), lambda r: {"model_id": model_id, "type": "create_model"})
        return model_id, call

    def model(self, model_id: str) -> Model:
        m = self.models.get(model_id)
        if m is None:
            raise ServiceError(f"no training client {model_id!r} on this server (its session "
                               "may have ended; create_training_client_from_state resumes a "
                               "saved state)", 404)
        self.client(m.session_id)
        return m

    def load_model(self, session_id: str, model_seq_id: int, path: str, optimizer: bool
                   ) -> tuple[str, Call]:
        """A training client started from a saved state (tinker's create-via-load)."""
        client = self.client(session_id)
        folder, source = self.state_folder(path, "weights")
        record = self._read_model(source)
        model_id = f"{session_id}:train:{model_seq_id}"
        if model_id in self.models:
            raise ServiceError(f"model {model_id} exists: model_seq_id {model_seq_id} was used")
        tenant = Tenant(model_id, record["rank"], record["seed"])
        self.models[model_id] = Model(model_id, session_id, tenant)
        client.models.append(model_id)
        self._write_model(model_id, tenant)
        call = self._call(session_id, "json", lambda: self.executor.submit_all(
            call_as, tenant, checkpoint.load_state, folder, optimizer),
            lambda _: {"path": path, "model_id": model_id, "type": "load_weights"})
        return model_id, call

    def info(self, model_id: str, tokenizer_dir: str) -> dict[str, Any]:
        self.model(model_id)
        return {"type": "get_info", "model_id": model_id, "is_lora": True,
                "lora_rank": self._read_model(model_id)["rank"], "model_name": self.base_model,
                "model_data": {"arch": "qwen3_vl", "model_name": self.base_model,
                               "tokenizer_id": tokenizer_dir},
                "optimizer_config": {"type": "adamw"}}

    # --------------------------------------------------------------- training calls in order

    def train(self, model_id: str, seq_id: int, what: str, *args: Any) -> str:
        """Accept training call `what` of a model at its seq_id -> its request id (the first
        one's when this seq_id came before). It runs once the seq_ids before it have come."""
        m = self.model(model_id)
        if seq_id in m.requests:
            return m.requests[seq_id]
        if seq_id < m.next_seq:
            raise ServiceError(f"seq_id {seq_id} of {model_id} ran already (next is "
                               f"{m.next_seq})")
        self._check_queue()
        submit, kind, result = self._training_call(m, what, *args)
        call = self._call(m.session_id, kind, None, result)
        m.requests[seq_id] = call.request_id
        m.waiting[seq_id] = (call, submit)
        while m.next_seq in m.waiting:
            self._start(*m.waiting.pop(m.next_seq))
            m.next_seq += 1
        return call.request_id

    def _training_call(self, m: Model, what: str, *args: Any
                       ) -> tuple[Callable[[], Any], str, Callable[[Any], Any]]:
        """(submit, result kind, result -> wire) of one training call of model m."""
        ex, tenant = self.executor, m.tenant
        if what in ("forward", "forward_backward"):
            datums, known, loss_fn, cfg = args
            tokens = sum(len(d.stream) - 1 for d in datums)
            usage = Usage(trained_tokens=tokens) if what == "forward_backward" \
                else Usage(forward_tokens=tokens)
            return (lambda: ex.submit_batch(forward_as, datums, tenant, loss_fn, cfg,
                                            what == "forward_backward"),
                    "forward", lambda out: (out, known, loss_fn, usage))
        if what == "optim_step":
            (adam,) = args
            return (lambda: ex.submit_all(call_as, tenant, host.optim_step, adam), "json",
                    lambda out: {"type": "optim_step", "metrics": {
                        "grad_norm:mean": out.grad_norm, "learning_rate:mean": out.learning_rate,
                        "optimizer_step:max": float(out.step)}})
        if what == "save_weights":
            (name,) = args
            folder, path = self.new_path(m.model_id, "weights", name)
            return (lambda: ex.submit(call_as, tenant, checkpoint.save_state, folder), "json",
                    lambda _: {"path": path, "type": "save_weights"})
        if what == "save_weights_for_sampler":
            name, sampler_seq = args
            if name:
                folder, path = self.new_path(m.model_id, "sampler_weights", name)
                return (lambda: ex.submit(call_as, tenant, checkpoint.export_adapter, folder),
                        "json", lambda _: {"path": path, "type": "save_weights_for_sampler"})
            sampler_id = f"{m.session_id}:sample:{sampler_seq}"

            def sampler(version: int) -> dict[str, str]:
                self.add_sampler(m.session_id, sampler_id, version)
                return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}
            return lambda: self._version_of(tenant), "json", sampler
        if what == "load_weights":
            path, optimizer = args
            folder, _ = self.state_folder(path, "weights")
            return (lambda: ex.submit_all(call_as, tenant, checkpoint.load_state, folder,
                                          optimizer), "json",
                    lambda _: {"path": path, "model_id": m.model_id, "type": "load_weights"})
        raise ServiceError(f"unknown training call {what!r}")

    # ----------------------------------------------------------------------------- sampling

    def start_sampler(self, session_id: str, sampler_seq: int, base_model: str | None,
                      model_path: str | None) -> tuple[str, Future]:
        """A sampling session on the base (a fresh adapter: every B zero) or on saved sampler
        weights -> (its id, the future of its version); `add_sampler` once that is done (the
        SDK samples as soon as it has the id)."""
        self.client(session_id)
        sampler_id = f"{session_id}:sample:{sampler_seq}"
        load = None
        if model_path:
            folder, _ = self.state_folder(model_path, "sampler_weights")
            load = (checkpoint.load_adapter_weights, folder)
        else:
            self.check_base(base_model or "")
        tenant = Tenant(f"sampler:{sampler_id}")
        return sampler_id, self._dispatch(lambda: self._version_of(tenant, load, True))

    def sampler(self, sampler_id: str) -> tuple[Client, int]:
        session_id = sampler_id.split(":", 1)[0]
        c = self.client(session_id)
        if sampler_id not in c.samplers:
            raise ServiceError(f"no sampling session {sampler_id!r} on this server", 404)
        return c, c.samplers[sampler_id]

    def sample(self, sampler_id: str, seq_id: int, prompt: Stream, n: int,
               params: SamplingParams, seed: int | None, prompt_logprobs: bool) -> str:
        """Accept a sample call -> its request id."""
        client, version = self.sampler(sampler_id)
        self._check_queue()
        if seed is None:  # the same request samples the same replies
            seed = zlib.crc32(f"{sampler_id}:{seq_id}".encode())
        ex = self.executor

        def submit() -> Future:
            drawn = ex.submit_sampling(host.sample, version, prompt, n, params, seed)
            scored = ex.submit_sampling(host.compute_logprobs, version, prompt,
                                        params.temperature or 1.0, model=True) \
                if prompt_logprobs else None
            return gather([drawn] + ([scored] if scored else []))

        def result(out: list[Any]) -> Any:
            sequences = out[0].sequences
            usage = Usage(prompt_tokens=len(prompt),
                          sampled_tokens=sum(len(s.tokens) for s in sequences))
            return sequences, out[1] if prompt_logprobs else None, usage

        call = self._call(client.session_id, "sample", submit, result)
        return call.request_id

    def _version_of(self, tenant: Tenant, load: tuple | None = None,
                    temporary: bool = False) -> int:
        """On the dispatch thread: a sampler version of `tenant`'s weights (after `load`); a
        temporary tenant is freed after."""
        ex = self.executor
        ex.submit_all(call_as, tenant, *(load or (_rank_of,))).result()
        version = ex.sync_weights()
        if temporary:
            ex.submit_all(drop_tenant, tenant.name).result()
        return version

    def add_sampler(self, session_id: str, sampler_id: str, version: int) -> None:
        """Sampler `sampler_id` samples version `version` (while its session runs)."""
        c = self.clients.get(session_id)
        if c is not None and not c.ended:
            c.samplers[sampler_id] = version

    # -------------------------------------------------------------------------------- calls

    def _check_queue(self) -> None:
        busy = sum(1 for c in self.calls.values() if not c.future.done())
        if busy >= self.settings.max_queue:
            raise ServiceError(f"this server holds {busy} calls not finished, its limit "
                               f"(max_queue {self.settings.max_queue}): retry after 1 s", 429,
                               {"Retry-After": "1"})

    def _call(self, session_id: str, kind: str, submit: Callable[[], Any] | None,
              result: Callable[[Any], Any]) -> Call:
        """A new call whose future resolves to result(executor's result); `submit` (if given)
        is dispatched now, else by `_start` once its turn comes."""
        self._ids += 1
        call = Call(f"req-{self._ids}", session_id, kind, result)
        self.calls[call.request_id] = call
        if submit is not None:
            self._start(call, submit)
        return call

    def _start(self, call: Call, submit: Callable[[], Any]) -> None:
        def done(inner: Future) -> None:
            try:
                value = call.result_of(inner.result())
            except BaseException as exc:  # noqa: BLE001 - handed to the client
                call.future.set_exception(exc)
            else:
                if isinstance(value, tuple) and isinstance(value[-1], Usage):
                    self._add_usage(call.session_id, value[-1])
                call.future.set_result(value)
            call.finished_at = time.monotonic()
        chain(self._dispatch(submit), done)

    def _dispatch(self, thunk: Callable[[], Any]) -> Future:
        """thunk() on the dispatch thread, in order -> a future of what it gives (a future it
        returns is waited for)."""
        out: Future = Future()

        def run() -> None:
            try:
                value = thunk()
            except BaseException as exc:  # noqa: BLE001
                out.set_exception(exc)
                return
            if isinstance(value, Future):
                chain(value, lambda f: _copy(f, out))
            else:
                out.set_result(value)
        self._dispatcher.submit(run)
        return out

    # ---------------------------------------------------------------------------- usage

    def _add_usage(self, session_id: str, usage: Usage) -> None:
        with self._usage_lock:
            c = self.clients.get(session_id)
            if c is not None:
                c.usage.add(usage)
            self._record(session_id, "call", usage, {})

    def _record(self, session_id: str, event: str, usage: Usage, extra: dict) -> None:
        line = {"time": time.time(), "session_id": session_id, "event": event,
                **asdict(usage), **extra}
        with open(self.workdir / "usage.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")

    def usage(self, session_id: str) -> dict[str, Any]:
        c = self.clients.get(session_id)
        if c is None:
            raise ServiceError(f"no session {session_id!r} on this server", 404)
        return {"session_id": session_id, "ended": c.ended, **asdict(c.usage)}

    # ---------------------------------------------------------------------------- paths

    def new_path(self, model_id: str, kind: str, name: str) -> tuple[Path, str]:
        if not NAME.fullmatch(name):
            raise ServiceError(f"checkpoint name {name!r}: 1 to 128 of A-Z a-z 0-9 . _ -")
        return self._folder(model_id, kind, name), f"tinker://{model_id}/{kind}/{name}"

    def state_folder(self, path: str, kind: str) -> tuple[Path, str]:
        """The folder of a tinker path this server wrote -> (folder, its model id)."""
        match = TINKER_PATH.fullmatch(path or "")
        if match is None or match["kind"] != kind or not NAME.fullmatch(match["name"]):
            raise ServiceError(f"path {path!r} is not a tinker://<model_id>/{kind}/<name> path "
                               "of this server")
        folder = self._folder(match["model"], kind, match["name"])
        if not folder.is_dir():
            raise ServiceError(f"no checkpoint {path} on this server", 404)
        return folder, match["model"]

    def checkpoints(self, model_id: str) -> list[dict[str, Any]]:
        """The saved states and sampler weights of a model, oldest first (also after a
        restart: they are read from the run folder)."""
        out = []
        for kind, ctype in (("weights", "training"), ("sampler_weights", "sampler")):
            root = self._folder(model_id, kind, "")
            for folder in sorted(root.glob("*"), key=lambda p: p.stat().st_mtime):
                if folder.is_dir() and checkpoint.is_complete(folder):
                    out.append({"checkpoint_id": f"{kind}/{folder.name}",
                                "checkpoint_type": ctype, "public": False,
                                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                      time.gmtime(folder.stat().st_mtime)),
                                "tinker_path": f"tinker://{model_id}/{kind}/{folder.name}"})
        return out

    def _folder(self, model_id: str, kind: str, name: str) -> Path:
        return self.workdir / kind / model_id.replace(":", "-") / name

    def _write_model(self, model_id: str, tenant: Tenant) -> None:
        path = self.workdir / "models" / f"{model_id.replace(':', '-')}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"model_id": model_id, "base_model": self.base_model,
                                    "rank": tenant.rank, "seed": tenant.seed}) + "\n")

    def _read_model(self, model_id: str) -> dict[str, Any]:
        path = self.workdir / "models" / f"{model_id.replace(':', '-')}.json"
        if not path.is_file():
            raise ServiceError(f"no training run {model_id!r} on this server", 404)
        return json.loads(path.read_text())

    def close(self) -> None:
        self._dispatcher.shutdown(wait=True)
        self.session.close()


def _rank_of(h: Any) -> int:
    """Nothing but the tenant switch call_as made (a tenant put in the model)."""
    return h.lora.rank if h.lora else 0


def chain(inner: Future, then: Callable[[Future], None]) -> None:
    inner.add_done_callback(then)


def _copy(source: Future, target: Future) -> None:
    if source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(source.result())


def gather(futures: list[Future]) -> Future:
    """A future of the futures' results, in order (the first exception if one fails)."""
    out: Future = Future()
    left = [len(futures)]
    lock = threading.Lock()

    def one(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        failed = next((f.exception() for f in futures if f.exception() is not None), None)
        if failed is not None:
            out.set_exception(failed)
        else:
            out.set_result([f.result() for f in futures])
    for f in futures:
        f.add_done_callback(one)
    return out
