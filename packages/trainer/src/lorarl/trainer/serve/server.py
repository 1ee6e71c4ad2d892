"""`trainer serve`: an HTTP server speaking the Tinker API as the `tinker` SDK sends it (JSON bodies, protobuf for
`forward_backward` and for the results of it and of sampling), over lorarl's models: many LoRA training runs and
samplers on shared base models, in one process.

Work requests answer at once with a request id; the result is fetched with `retrieve_future` (long-polled: held until
it is ready or `POLL_S` passes, then `try_again`). Compute runs on one thread, in arrival order, except that one
training run's requests run in their `seq_id` order (the SDK sends `optim_step` before the `forward_backward` before it
has finished uploading). A request that fails fails its own future only: `{"error", "category": "user"|"server"}`,
one line, no traceback."""

import argparse
import asyncio
import collections
import concurrent.futures
import functools
import hashlib
import json
import logging
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lorarl.trainer import threads
from lorarl.trainer.serve.sampling import Sampler, SampleRequest
from lorarl.trainer.serve.service import Service
from lorarl.trainer.serve.tenancy import LoraShape, NotFound, RequestError, SessionFinished
from lorarl.trainer.serve.wire import (
    PROTOBUF,
    forward_backward_output,
    parse_forward_backward,
    read_data,
    sample_response,
)

SESSION_TIMEOUT_S = 300.0  # a session that sends nothing this long (the SDK heartbeats every 10 s) has lost its client
RESULT_TTL_S = 600.0  # how long a ready result waits for its client (then let go: a server lives long)
POLL_S = 20.0  # how long retrieve_future holds a request for a result (the SDK gives up on a poll after 45 s)
ORDER_WAIT_S = 30.0  # how long a run's request waits for a missing earlier seq_id, then fails (never out of order)
API = "/api/v1"
# the SDK's AdamParams defaults (torch's AdamW: decoupled weight decay; grad_clip_norm 0 = no clipping)
ADAM_DEFAULTS = {
    "learning_rate": None,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-12,
    "weight_decay": 0.0,
    "grad_clip_norm": 0.0,
}
log = logging.getLogger("lorarl.serve")


class Server:
    """The HTTP layer over a `Service`: sessions, futures, per-run ordering, the API key."""

    def __init__(self, service: Service, *, api_keys: tuple[str, ...] = (), bases: tuple[str, ...] = (),
                 result_ttl: float = RESULT_TTL_S, session_timeout: float = SESSION_TIMEOUT_S,
                 order_wait: float = ORDER_WAIT_S):  # fmt: skip
        self.service, self.api_keys, self.bases = service, api_keys, bases
        self.result_ttl, self.session_timeout, self.order_wait = result_ttl, session_timeout, order_wait
        self.started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        self.epoch = uuid.uuid4().hex[:8]  # this server's life: a request id made before a restart is not its own
        self.compute = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lorarl-serve")
        self.futures: dict[str, asyncio.Future] = {}
        self.next_seq: dict[str, int] = {}  # training run -> the seq_id its next request should carry
        self.waiting: dict[str, dict[int, tuple]] = {}  # training run -> seq_id -> (fn, future): ahead of their turn
        self.order = asyncio.Condition()
        self.by_seq: dict[tuple[str, int | None], str] = {}  # (run, seq_id) -> its request id
        self.samples: collections.deque = collections.deque()  # sample requests not yet taken by `answer_samples`
        self.draining = False  # an `answer_samples` round is queued on the compute thread
        self.loop: asyncio.AbstractEventLoop | None = None
        self.counters: dict[str, int] = {}

    # -- plumbing --
    def run_async(self, fn: Callable[[], Any]) -> asyncio.Future:
        return asyncio.get_running_loop().run_in_executor(self.compute, threads.busy()(fn))

    def submit(self, fn: Callable[[], Any], owner: str) -> str:
        """Run `fn` on the compute thread; its result is the future's (a request id), which only `owner` reads."""
        return self.hold(self.run_async(fn), owner)

    def hold(self, future: asyncio.Future, owner: str, key: tuple | None = None) -> str:
        """A new request id for `future`, whose result is kept `result_ttl` seconds once ready (the SDK may poll
        again after a network error), then let go — with its `(run, seq_id)` entry, `key`."""
        request_id = f"{self.epoch}-{uuid.uuid4()}"
        self.futures[request_id] = (future, owner)

        def expire() -> None:
            self.futures.pop(request_id, None)
            if key is not None and self.by_seq.get(key) == request_id:
                del self.by_seq[key]

        future.add_done_callback(lambda _: asyncio.get_running_loop().call_later(self.result_ttl, expire))
        return request_id

    async def submit_in_order(self, model_id: str, seq_id: int | None, fn: Callable[[], Any], owner: str) -> str:
        """`fn`'s request id, at once: `fn` joins the compute queue after the run's requests with lower seq_ids — at
        once if they are all in, or when the missing one arrives (the SDK sends a forward_backward's first chunk last).
        Never out of order: a request still waiting for a seq_id after `order_wait` seconds fails. A retried request
        (the same run and seq_id) gets the first one's request id and runs once."""
        key = (model_id, seq_id)
        if seq_id and key in self.by_seq:
            return self.by_seq[key]
        if model_id in self.service.runs:  # another key's run: refused at once, never queued behind its turn
            try:
                self.service.run(model_id, owner)
            except PermissionError as error:
                return self.hold(_failed(error), owner)
        if not seq_id:
            return self.submit(fn, owner)
        expected = self.next_seq.setdefault(model_id, seq_id)  # a run the server resumed: its first seq_id seen
        if seq_id < expected:
            raise RequestError(f"seq_id {seq_id} of {model_id}: that turn has passed (the run is at {expected}), and "
                               "its result is gone")  # fmt: skip
        future = asyncio.get_running_loop().create_future()
        request_id = self.by_seq[key] = self.hold(future, owner, key)
        self.waiting.setdefault(model_id, {})[seq_id] = (fn, future)
        self._release(model_id)
        if seq_id in self.waiting.get(model_id, {}):  # ahead of its turn
            asyncio.get_running_loop().call_later(self.order_wait, self._give_up, model_id, seq_id)
        return request_id

    def _release(self, model_id: str) -> None:
        """The run's waiting requests that are next, onto the compute queue in seq_id order."""
        waiting = self.waiting.get(model_id, {})
        while self.next_seq[model_id] in waiting:
            fn, future = waiting.pop(self.next_seq[model_id])
            self.next_seq[model_id] += 1
            asyncio.ensure_future(self.run_async(fn)).add_done_callback(functools.partial(_forward, future))

    def _give_up(self, model_id: str, seq_id: int) -> None:
        waiting = self.waiting.get(model_id, {})
        if seq_id in waiting:
            _, future = waiting.pop(seq_id)
            missing = self.next_seq[model_id]
            future.set_exception(RequestError(
                f"seq_id {seq_id} of {model_id} waited {self.order_wait:g} s for seq_id {missing}, which never came; "
                "not run out of order"))  # fmt: skip

    async def ordered(self, model_id: str, seq_id: int | None, fn: Callable[[], Any], owner: str) -> dict:
        """The answer to a training run's request: `fn` submitted in the run's order."""
        return {"request_id": await self.submit_in_order(model_id, seq_id, fn, owner), "model_id": model_id}

    def new_id(self, session_id: str, kind: str, seq: int | None) -> str:
        if seq is None:
            key = f"{session_id}:{kind}"
            seq = self.counters[key] = self.counters.get(key, -1) + 1
        return f"{session_id}:{kind}:{seq}"

    # -- the API --
    async def client_config(self, body: dict, owner: str) -> dict:
        return {"pjwt_auth_enabled": False}

    async def capabilities(self, body: dict, owner: str) -> dict:
        return {
            "supported_models": [{"model_name": name, "trainable": True, "sampleable": True} for name in self.bases]
        }

    async def create_session(self, body: dict, owner: str) -> dict:
        session_id = str(uuid.uuid4())
        self.service.create_session(session_id, owner)
        return {"type": "create_session", "session_id": session_id}

    async def heartbeat(self, body: dict, owner: str) -> dict:
        self.service.session(_field(body, "session_id", str), owner)
        return {"type": "session_heartbeat"}

    async def finish(self, session_id: str, owner: str, why: str) -> None:
        """Let go of what session `session_id` made (`Service.finish_session`, on the compute thread: after what
        its runs had queued), and of this server's records of its runs. A second finish changes nothing."""
        if session_id in self.service.finished:
            return
        self.service.session(session_id, owner)
        runs = await self.run_async(lambda: self.service.finish_session(session_id, why))
        for model_id in runs:
            self.next_seq.pop(model_id, None)
            for _, future in self.waiting.pop(model_id, {}).values():
                future.set_exception(SessionFinished(f"model_id={model_id!r}: its session finished ({why})"))
        for key in [k for k in self.counters if k.startswith(f"{session_id}:")]:
            del self.counters[key]

    async def reap(self) -> None:
        """Every so often, finish the sessions whose clients have gone silent (`session_timeout`)."""
        while True:
            await asyncio.sleep(min(60.0, self.session_timeout / 4))
            for session_id in self.service.idle_sessions(self.session_timeout):
                log.info("session %s: nothing for %g s; letting go of its runs", session_id, self.session_timeout)
                await self.finish(session_id, self.service.owners[session_id],
                                  f"idle for {self.session_timeout:g} s")  # fmt: skip

    async def create_model(self, body: dict, owner: str) -> dict:
        session = _field(body, "session_id", str)
        model_id = self.new_id(session, "train", body.get("model_seq_id"))
        lora = body.get("lora_config") or {}
        if not isinstance(lora, dict):
            raise RequestError("lora_config: expected an object")
        shape = LoraShape(rank=_number(lora, "rank", int, 32, "lora_config"),
                          train_attn=_flag(lora, "train_attn", True), train_mlp=_flag(lora, "train_mlp", True),
                          train_unembed=_flag(lora, "train_unembed", False),
                          seed=_number(lora, "seed", int, None, "lora_config"))  # fmt: skip
        base = _field(body, "base_model", str)
        optimizer = (body.get("optimizer_config") or {}).get("type", "adamw")
        if optimizer != "adamw":
            raise RequestError(f"optimizer_config.type={optimizer!r}: this server trains with adamw only")
        self.next_seq[model_id] = 1

        def create() -> dict:
            self.service.create_run(model_id, session, base, shape, owner)
            return {"type": "create_model", "model_id": model_id}

        return {"request_id": self.submit(create, owner), "model_id": model_id}

    async def get_info(self, body: dict, owner: str) -> dict:
        model_id = _field(body, "model_id", str)
        return {"type": "get_info", **(await self.run_async(lambda: self.service.info(model_id, owner)))}

    async def forward_backward(self, body: bytes, owner: str) -> dict:
        """Parsed here for its run and seq_id; checked on the compute thread, so that a bad datum fails its own
        future and its seq_id still counts."""
        message = parse_forward_backward(body)
        model_id, backward = message.model_id, not message.forward_only

        def run() -> bytes:
            data, loss_fn, config = read_data(message)
            result = self.service.forward_backward(model_id, owner, data, loss_fn, config, backward=backward)
            return forward_backward_output(result["outputs"], result["loss"])

        return await self.ordered(model_id, message.seq_id, run, owner)

    async def optim_step(self, body: dict, owner: str) -> dict:
        model_id = _field(body, "model_id", str)

        def step() -> dict:
            adam = _field(body, "adam_params", dict)
            params = {key: float(_field(adam, key, (int, float), "adam_params") if key == "learning_rate"
                                 else adam.get(key, default))
                      for key, default in ADAM_DEFAULTS.items()}  # fmt: skip
            metrics = self.service.optim_step(model_id, owner, params)
            return {"type": "optim_step", "metrics": {"optim/grad_norm:mean": metrics["grad_norm"]}}

        return await self.ordered(model_id, body.get("seq_id"), step, owner)

    async def save_weights(self, body: dict, owner: str) -> dict:
        model_id, name = _field(body, "model_id", str), _field(body, "path", str)
        overwrite = bool(body.get("overwrite", False))

        def save() -> dict:
            path = self.service.save_weights(model_id, owner, name, overwrite=overwrite)
            return {"type": "save_weights", "path": path}

        return await self.ordered(model_id, body.get("seq_id"), save, owner)

    async def save_weights_for_sampler(self, body: dict, owner: str) -> dict:
        model_id = _field(body, "model_id", str)
        name = body.get("path")
        client = model_id.split(":train:")[0]  # the session that made the run
        session = self.new_id(client, "sample", body.get("sampling_session_seq_id")) if name is None else None

        def save() -> dict:
            path = self.service.save_for_sampler(model_id, owner, name)
            if session is None:
                return {"type": "save_weights_for_sampler", "path": path}
            self.service.create_sampling_session(session, owner, None, path)
            return {"type": "save_weights_for_sampler", "path": path, "sampling_session_id": session}

        return await self.ordered(model_id, body.get("seq_id"), save, owner)

    async def load_weights(self, body: dict, owner: str) -> dict:
        path, optimizer = _field(body, "path", str), bool(body.get("optimizer", False))
        if body.get("session_id") is not None:  # a new run from saved weights
            session = _field(body, "session_id", str)
            model_id = self.new_id(session, "train", body.get("model_seq_id"))
            self.next_seq[model_id] = 1

            def create() -> dict:
                self.service.create_run_from(model_id, session, owner, path, optimizer=optimizer)
                return {"type": "load_weights", "path": path, "model_id": model_id}

            return {"request_id": self.submit(create, owner), "model_id": model_id}
        model_id = _field(body, "model_id", str)

        def load() -> dict:
            self.service.load_weights(model_id, owner, path, optimizer=optimizer)
            return {"type": "load_weights", "path": path}

        return await self.ordered(model_id, body.get("seq_id"), load, owner)

    async def weights_info(self, body: dict, owner: str) -> dict:
        path = _field(body, "tinker_path", str)
        return await self.run_async(lambda: self.service.weights_info(path, owner))

    async def checkpoints(self, model_id: str, owner: str) -> dict:
        return {"checkpoints": self.service.checkpoints(model_id, owner)}

    async def create_sampling_session(self, body: dict, owner: str) -> dict:
        client = _field(body, "session_id", str)
        self.service.session(client, owner)
        session = self.new_id(client, "sample", body.get("sampling_session_seq_id"))
        base, path = body.get("base_model"), body.get("model_path")
        await self.run_async(lambda: self.service.create_sampling_session(session, owner, base, path))
        return {"type": "create_sampling_session", "sampling_session_id": session}

    async def sampler(self, session_id: str, owner: str) -> dict:
        session = self.service.sampling_session(session_id, owner)
        return {"sampler_id": session_id, "base_model": session.base_name, "model_path": session.model_path}

    async def sample(self, body: dict, owner: str) -> dict:
        session = _field(body, "sampling_session_id", str)
        self.service.sampling_session(session, owner)
        prompt = _prompt_tokens(_field(body, "prompt", dict))
        params = body.get("sampling_params") or {}
        stop = params.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str | int) for s in stop):
            raise RequestError("sampling_params.stop: expected a list of strings or of token ids")
        top_k = params.get("top_k", -1)
        if top_k not in (-1, 0, None):
            raise RequestError(f"sampling_params.top_k={top_k}: this server samples with top_k=-1 (all tokens) only")
        request = SampleRequest(
            prompt=prompt, num_samples=_number(body, "num_samples", int, 1),
            max_tokens=_number(params, "max_tokens", int, 16, "sampling_params"),
            temperature=_number(params, "temperature", float, 1.0, "sampling_params"),
            top_p=_number(params, "top_p", float, 1.0, "sampling_params"),
            seed=_number(params, "seed", int, None, "sampling_params"),
            stop_strings=tuple(s for s in stop if isinstance(s, str)),
            stop_tokens=tuple(s for s in stop if isinstance(s, int)),
        )  # fmt: skip
        if request.num_samples < 1 or request.max_tokens < 1:
            raise RequestError(f"num_samples and sampling_params.max_tokens must be >= 1 (got {request.num_samples} "
                               f"and {request.max_tokens})")  # fmt: skip
        if body.get("topk_prompt_logprobs") or body.get("topk_sample_logprobs") or body.get("prompt_alt_tokens_k"):
            raise RequestError("top-k log-probs: not served (prompt_logprobs and the sampled tokens' log-probs are)")
        with_prompt = bool(body.get("prompt_logprobs"))
        future = asyncio.get_running_loop().create_future()
        request_id = self.hold(future, owner)
        self.samples.append((session, owner, request, with_prompt, future))
        if not self.draining:
            self.draining = True
            self.run_async(self.answer_samples)
        return {"request_id": request_id,
                "sample_sequence_ids": [f"{request_id}:{i}" for i in range(request.num_samples)]}  # fmt: skip

    def answer_samples(self) -> None:
        """On the compute thread: every sample request queued by now, decoded together (`Service.sample_many`) —
        requests that arrive while training runs wait for it and then share one decode."""
        self.draining = False  # before taking: a request queued after this schedules the next round
        taken = []
        while self.samples:
            taken.append(self.samples.popleft())
        if not taken:
            return
        log.info("sampling %d requests of %d sessions together", len(taken), len({t[0] for t in taken}))
        try:
            answers = self.service.sample_many([(session, owner, request) for session, owner, request, _, _ in taken])
        except Exception as error:  # the decode itself failed: every request of the round fails with it
            answers = [error] * len(taken)
        for (session, owner, request, with_prompt, future), answer in zip(taken, answers, strict=True):
            if not isinstance(answer, Exception) and with_prompt:
                try:
                    answer = sample_response(answer, self.service.prompt_logprobs(session, owner, request.prompt))
                except Exception as error:
                    answer = error
            elif not isinstance(answer, Exception):
                answer = sample_response(answer, None)
            self.loop.call_soon_threadsafe(_settle, future, answer)

    async def retrieve(self, body: dict, owner: str):
        """A result when ready (JSON, or protobuf bytes), `try_again` after `POLL_S`, or the request's error."""
        request_id = _field(body, "request_id", str)
        future, requester = self.futures.get(request_id, (None, None))
        if future is None and not request_id.startswith(f"{self.epoch}-"):
            raise NotFound(f"request_id={request_id!r}: made before this server restarted (at {self.started}); "
                              "its result is gone: send the request again")  # fmt: skip
        if future is None:
            raise NotFound(f"request_id={request_id!r}: no such request (results are kept {self.result_ttl:g} s "
                              "after they are ready: --result-ttl)")  # fmt: skip
        if requester != owner:
            raise PermissionError(f"request_id={request_id!r}: belongs to another API key")
        try:
            result = await asyncio.wait_for(asyncio.shield(future), POLL_S)
        except TimeoutError:
            return Pending({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        except RequestError as error:
            return {"error": str(error), "category": "user"}
        except (NotFound, PermissionError) as error:
            return {"error": str(error).strip("'\""), "category": "user"}
        except Exception as error:
            log.exception("request %s failed", request_id)
            return {"error": f"{type(error).__name__}: {error}", "category": "server"}
        return result


def _failed(error: Exception) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_exception(error)
    return future


def _forward(future: asyncio.Future, done: asyncio.Future) -> None:
    """`done`'s outcome onto `future` (the one a client polls)."""
    if done.exception() is not None:
        future.set_exception(done.exception())
    else:
        future.set_result(done.result())


def _settle(future: asyncio.Future, answer) -> None:
    if isinstance(answer, Exception):
        future.set_exception(answer)
    else:
        future.set_result(answer)


class Pending(dict):
    """A `retrieve_future` answer for a request still running: HTTP 408, which the SDK polls again at once."""


def _owner(request) -> str:
    """Who sends a request: a digest of its API key. Runs, sampler sessions and saved weights belong to the key whose
    session made them; other keys can neither read nor change them."""
    return hashlib.sha256(request.headers.get("x-api-key", "").encode()).hexdigest()[:16]


def _field(body: dict, key: str, kind, where: str = "body"):
    """`body[key]`, checked: a missing or mistyped field is the client's error, named."""
    if not isinstance(body, dict) or key not in body or body[key] is None:
        raise RequestError(f"{where}: expected the field {key!r}")
    if not isinstance(body[key], kind) or (isinstance(body[key], bool) and bool not in _kinds(kind)):
        raise RequestError(f"{where}.{key}: expected {_kind_name(kind)}, got {repr(body[key])[:80]}")
    return body[key]


def _kinds(kind) -> tuple:
    return kind if isinstance(kind, tuple) else (kind,)


def _kind_name(kind) -> str:
    """What a JSON client would call `kind`: a number, a string, an object, a list, an integer."""
    names = {int: "an integer", float: "a number", str: "a string", dict: "an object", list: "a list",
             bool: "true or false"}  # fmt: skip
    kinds = _kinds(kind)
    if set(kinds) == {int, float}:
        return "a number"
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _number(body: dict, key: str, kind: type, default, where: str = "body"):
    """`body[key]` as a number of `kind` (None or absent: `default`); anything else is the client's error, named."""
    value = body.get(key) if isinstance(body, dict) else None
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and value != int(value)):
        raise RequestError(f"{where}.{key}: expected {'an integer' if kind is int else 'a number'}, got {value!r}")
    return kind(value)


def _flag(body: dict, key: str, default: bool) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise RequestError(f"lora_config.{key}: expected true or false, got {value!r}")
    return value


def _prompt_tokens(prompt: dict) -> list[int]:
    chunks = _field(prompt, "chunks", list, "prompt")
    ids = []
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            raise RequestError(f"prompt.chunks[{i}]: this server takes encoded_text chunks only")
        tokens = _field(chunk, "tokens", list, f"prompt.chunks[{i}]")
        if not all(isinstance(t, int) for t in tokens):
            raise RequestError(f"prompt.chunks[{i}].tokens: expected integers")
        ids.extend(tokens)
    return ids


def make_app(server: Server):
    """The aiohttp application: routes, the API key check, errors as JSON with a category."""
    from aiohttp import web

    @web.middleware
    async def guard(request: web.Request, handler):
        if server.api_keys and request.headers.get("x-api-key") not in server.api_keys:
            return web.json_response({"error": "a valid API key is required (x-api-key)", "category": "user"},
                                     status=401)  # fmt: skip
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except RequestError as error:
            return web.json_response({"error": str(error), "category": "user"}, status=400)
        except SessionFinished as error:
            return web.json_response({"error": str(error).strip("'\""), "category": "user"}, status=410)
        except NotFound as error:
            return web.json_response({"error": str(error).strip("'\""), "category": "user"}, status=404)
        except PermissionError as error:
            return web.json_response({"error": str(error), "category": "user"}, status=403)
        except Exception as error:
            log.exception("%s failed", request.path)
            return web.json_response({"error": f"{type(error).__name__}: {error}", "category": "server"}, status=500)

    def json_route(method: Callable):
        async def handle(request: web.Request):
            raw = await request.read()
            try:
                body = json.loads(raw) if raw else {}
            except ValueError:
                raise RequestError(f"{request.path}: the body is not JSON") from None
            return _respond(await method(body, _owner(request)))

        return handle

    def _respond(result):
        if isinstance(result, bytes):
            return web.Response(body=result, content_type=PROTOBUF)
        return web.json_response(result, status=408 if isinstance(result, Pending) else 200)

    async def forward_backward(request: web.Request):
        return _respond(await server.forward_backward(await request.read(), _owner(request)))

    async def checkpoints(request: web.Request):
        return _respond(await server.checkpoints(request.match_info["model_id"], _owner(request)))

    async def sampler(request: web.Request):
        return _respond(await server.sampler(request.match_info["sampler_id"], _owner(request)))

    async def finish(request: web.Request):
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        status = body.get("status", "finished") if isinstance(body, dict) else "finished"
        await server.finish(request.match_info["session_id"], _owner(request), f"closed by its client: {status}")
        return web.json_response({})

    async def accepted(request: web.Request):
        return web.json_response({"status": "accepted"})

    async def started(app) -> None:
        server.loop = asyncio.get_running_loop()
        app["reaper"] = asyncio.create_task(server.reap())

    async def stopped(app) -> None:  # after the last request: the samplers (a vLLM engine) stop on the compute thread
        app["reaper"].cancel()
        await server.run_async(server.service.close)

    app = web.Application(middlewares=[guard], client_max_size=1 << 31)
    app.on_startup.append(started)
    app.on_cleanup.append(stopped)
    routes = {
        "client/config": server.client_config,
        "create_session": server.create_session,
        "session_heartbeat": server.heartbeat,
        "create_model": server.create_model,
        "get_info": server.get_info,
        "optim_step": server.optim_step,
        "save_weights": server.save_weights,
        "save_weights_for_sampler": server.save_weights_for_sampler,
        "load_weights": server.load_weights,
        "weights_info": server.weights_info,
        "create_sampling_session": server.create_sampling_session,
        "asample": server.sample,
        "retrieve_future": server.retrieve,
    }
    for path, method in routes.items():
        app.router.add_post(f"{API}/{path}", json_route(method))
    app.router.add_post(f"{API}/forward_backward", forward_backward)
    app.router.add_get(f"{API}/get_server_capabilities", json_route(server.capabilities))
    app.router.add_get(f"{API}/training_runs/{{model_id}}/checkpoints", checkpoints)
    app.router.add_get(f"{API}/samplers/{{sampler_id}}", sampler)
    app.router.add_post(f"{API}/sessions/{{session_id}}/finish", finish)
    app.router.add_post(f"{API}/telemetry", accepted)
    return app


def arguments() -> argparse.ArgumentParser:
    """`trainer serve`'s options."""
    parser = argparse.ArgumentParser(prog="trainer serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--base", action="append", default=[],
                        help="a base model to load at start (an embedded model's name, a directory, a Hub id); "
                             "create_model may name others")  # fmt: skip
    parser.add_argument("--state-dir", default="outputs/serve", help="where saved weights are kept (resumable)")
    parser.add_argument("--api-key", action="append", default=[],
                        help="accept requests with this key only (the client's TINKER_API_KEY, starting tml-); "
                             "repeat it for several tenants, each of which sees only its own runs")  # fmt: skip
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--sampler-snapshots", type=int, default=4,
                        help="each run's newest sampler weights held in memory (older unnamed: let go)")  # fmt: skip
    parser.add_argument("--result-ttl", type=float, default=RESULT_TTL_S,
                        help="seconds a request's result is kept once ready (for the client's polls)")  # fmt: skip
    parser.add_argument("--sampler", choices=("hf", "vllm"), default="hf",
                        help="what samples: the HF decode loop with peft's mixed-adapter batches, or vLLM's multi-LoRA "
                             "(GPUs, or its CPU build: run from scripts/vllm_cpu_env.sh's environment)")  # fmt: skip
    parser.add_argument("--vllm-adapters", choices=("merged", "batched"),
                        help="--sampler vllm: each snapshot's factors merged into the engine's weights for its requests"
                             " (default on the CPU, where vLLM's LoRA kernels are slow), or every snapshot a LoRA "
                             "request in one batch (default on GPUs)")  # fmt: skip
    parser.add_argument("--max-lora-rank", type=int, default=64, help="--sampler vllm: the highest rank it serves")
    parser.add_argument("--max-loras", type=int, default=8, help="--sampler vllm: snapshots decoded in one batch")
    parser.add_argument("--kv-cache-gb", type=float, default=1.0, help="--sampler vllm on the CPU: its KV cache")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                        help="--sampler vllm on a GPU: the share vLLM takes (training needs the rest)")  # fmt: skip
    parser.add_argument("--session-timeout", type=float, default=SESSION_TIMEOUT_S,
                        help="seconds without a heartbeat or request after which a session's runs are let go (what "
                        "they saved stays on disk)")  # fmt: skip
    parser.add_argument("--order-wait", type=float, default=ORDER_WAIT_S,
                        help="seconds a run's request waits for an earlier seq_id that has not arrived, then fails "
                        "(requests never run out of their run's order)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (0: the cores available, fewer while other work keeps them busy)")
    return parser


def main(argv: list[str]) -> int:
    """`trainer serve [--host H] [--port P] [--base NAME ...] [--state-dir DIR] [--api-key KEY]`."""
    parser = arguments()
    args = parser.parse_args(argv)
    if args.threads < 0:
        return _refused(f"--threads: expected a count >= 0, got {args.threads}")
    chosen = threads.configure(args.threads or None, key="--threads")
    from aiohttp import web

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    sampler = Sampler
    if args.sampler == "vllm":
        import importlib.util

        from lorarl.trainer.engines import VLLM_INSTALL
        from lorarl.trainer.serve.vllm_sampling import VllmSampler

        if importlib.util.find_spec("vllm") is None:
            return _refused(f"--sampler vllm: vLLM is not installed here ({VLLM_INSTALL})")
        sampler = functools.partial(VllmSampler, adapters=args.vllm_adapters, max_lora_rank=args.max_lora_rank,
                                    max_loras=args.max_loras, kv_cache_gb=args.kv_cache_gb,
                                    gpu_memory_utilization=args.gpu_memory_utilization)  # fmt: skip
    service = Service(Path(args.state_dir), args.device, args.micro_batch_tokens, args.sampler_snapshots, sampler)
    for name in args.base:
        try:
            service.base(name)
        except RequestError as error:
            return _refused(f"--base {name}: {error}")
    server = Server(service, api_keys=tuple(args.api_key), bases=tuple(args.base), result_ttl=args.result_ttl,
                    session_timeout=args.session_timeout, order_wait=args.order_wait)  # fmt: skip
    print(chosen.describe(), flush=True)
    print(f"serving the Tinker API at http://{args.host}:{args.port} (TINKER_BASE_URL)", flush=True)
    web.run_app(make_app(server), host=args.host, port=args.port, print=None)
    return 0


def _refused(problem: str) -> int:
    """A server that cannot start as asked: one line saying why (no usage, no traceback), exit status 2."""
    print(f"trainer serve: error: {problem}", file=sys.stderr)
    return 2
