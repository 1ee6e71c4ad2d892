"""What the server does, apart from HTTP: sessions, training runs on shared bases, sampler snapshots and sampling
sessions, saved states on disk. Every call here runs on the server's one compute thread, in the order the server
hands them over; none knows about the wire format.

Names follow the Tinker API: a training run is `<session>:train:<n>`, a sampling session `<session>:sample:<n>`, saved
weights `tinker://<run>/weights/<name>` (adapter and optimizer: resumes a run) and `tinker://<run>/sampler_weights/<name>`
(adapter only). A run's state lives on disk under the server's state directory, so a restarted server loads what an
earlier one saved; its unnamed sampler snapshots live in memory only."""

import json
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lorarl.trainer.models import resolve_device
from lorarl.trainer.serve.sampling import Sampler, SampleRequest, Sequence, Snapshot
from lorarl.trainer.serve.tenancy import (
    Datum,
    LoraShape,
    NotFound,
    RequestError,
    SessionFinished,
    SharedBase,
    TrainingRun,
    write_adapter,
)

TINKER_PATH = re.compile(r"^tinker://(?P<run>[^/]+)/(?P<kind>weights|sampler_weights)/(?P<name>[^/]+)$")
SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


@dataclass
class Run:
    """A training run and who owns it."""

    training: TrainingRun
    base_name: str
    session: str


@dataclass
class SamplingSession:
    base_name: str
    model_path: str | None  # a sampler snapshot's path, or None: the base model
    owner: str


class Service:
    """Every tenant's state, on one process's models."""

    def __init__(self, state_dir: Path, device: str = "cpu", micro_batch_tokens: int = 4096,
                 sampler_snapshots: int = 4, sampler: Callable[[SharedBase], Sampler] = Sampler):  # fmt: skip
        """`sampler` makes a base's sampler: `Sampler` (the HF decode loop) or a `VllmSampler` factory."""
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.device = resolve_device(device)
        self.micro_batch_tokens = micro_batch_tokens
        self.make_sampler = sampler
        self.bases: dict[str, SharedBase] = {}
        self.samplers: dict[str, Sampler] = {}
        self.sessions: dict[str, float] = {}  # session id -> last heartbeat
        self.owners: dict[str, str] = {}  # session id -> its API key's digest (`server._owner`)
        self.runs: dict[str, Run] = {}
        self.sampling_sessions: dict[str, SamplingSession] = {}
        self.snapshots: dict[str, tuple[str, Snapshot, str]] = {}  # sampler path -> (base name, snapshot, owner)
        self.sampler_snapshots = sampler_snapshots  # per run: its newest, in memory (a long run makes one a step)
        self.recent: dict[str, list[str]] = {}  # run -> the paths of its snapshots in memory, oldest first
        self.dropped: set[str] = set()  # unnamed snapshots let go (nothing on disk to read them back from)
        self.finished: dict[str, str] = {}  # session id -> why it finished (the client's close, or idle)

    # -- bases --
    def base(self, name: str) -> SharedBase:
        """The shared base model `name` (an embedded model's name, a local directory, a cached Hub id), loaded once."""
        if name not in self.bases:
            try:
                self.bases[name] = SharedBase(name, self.device, micro_batch_tokens=self.micro_batch_tokens)
            except Exception as error:
                raise RequestError(f"base_model={name!r}: cannot be loaded ({error})") from None
            try:
                self.samplers[name] = self.make_sampler(self.bases[name])
            except Exception as error:
                del self.bases[name]
                raise RequestError(f"base_model={name!r}: its sampler cannot start ({error})") from None
        return self.bases[name]

    def close(self) -> None:
        """Stop the samplers (a vLLM engine, and its adapters' directories)."""
        for sampler in self.samplers.values():
            sampler.close()

    # -- sessions and runs --
    def create_session(self, session_id: str, owner: str) -> None:
        self.sessions[session_id], self.owners[session_id] = time.monotonic(), owner

    def session(self, session_id: str, owner: str) -> None:
        """Check that `owner` may use session `session_id`, and note that it is alive."""
        if session_id in self.finished:
            raise SessionFinished(f"session_id={session_id!r}: finished ({self.finished[session_id]})")
        if session_id not in self.sessions:
            raise NotFound(f"session_id={session_id!r}: no such session")
        _same_owner(self.owners[session_id], owner, f"session_id={session_id!r}")
        self.sessions[session_id] = time.monotonic()

    def run(self, model_id: str, owner: str) -> Run:
        """Training run `model_id`, if `owner`'s."""
        if model_id not in self.runs:
            raise NotFound(f"model_id={model_id!r}: no such training run")
        run = self.runs[model_id]
        _same_owner(self.owners.get(run.session), owner, f"model_id={model_id!r}")
        return run

    def create_run(self, model_id: str, session: str, base_name: str, shape: LoraShape, owner: str) -> None:
        self.session(session, owner)
        base = self.base(base_name)
        self.runs[model_id] = Run(TrainingRun(model_id, base, shape), base_name, session)

    def info(self, model_id: str, owner: str) -> dict:
        run = self.run(model_id, owner)
        shape = run.training.shape
        arch = getattr(run.training.base.base.config, "model_type", "unknown")
        return {"model_id": model_id, "model_name": run.base_name, "is_lora": True, "lora_rank": shape.rank,
                "model_data": {"arch": arch, "model_name": run.base_name, "tokenizer_id": run.base_name}}  # fmt: skip

    def forward_backward(self, model_id: str, owner: str, data: list[Datum], loss_fn: str, config: dict, *,
                         backward: bool) -> dict:  # fmt: skip
        run = self.run(model_id, owner)
        vocab = run.training.base.vocab_size
        for i, datum in enumerate(data):
            if datum.tokens and (max(datum.tokens) >= vocab or min(datum.tokens) < 0):
                raise RequestError(f"data[{i}].model_input: token ids must be in [0, {vocab})")
            if len(datum.targets) and (int(datum.targets.max()) >= vocab or int(datum.targets.min()) < 0):
                raise RequestError(f"data[{i}].loss_fn_inputs.target_tokens: token ids must be in [0, {vocab})")
        return run.training.forward(data, loss_fn, config, backward=backward)

    def optim_step(self, model_id: str, owner: str, adam: dict) -> dict:
        return self.run(model_id, owner).training.optim_step(**adam)

    def close_run(self, model_id: str) -> None:
        """Let go of a run: its adapter and optimizer state, and its sampler snapshots in memory (what it saved stays
        on disk)."""
        run = self.runs.pop(model_id, None)
        if run is not None:
            run.training.close()
        for path in self.recent.pop(model_id, []):
            self._drop_snapshot(path)

    def finish_session(self, session_id: str, why: str) -> list[str]:
        """Let go of everything session `session_id` made — its runs (`close_run`), its sampling sessions — and
        answer its later requests that it has finished (`why`). Returns its runs' ids."""
        runs = [model_id for model_id, run in self.runs.items() if run.session == session_id]
        for model_id in runs:
            self.close_run(model_id)
        for sampling in [s for s in self.sampling_sessions if s.startswith(f"{session_id}:")]:
            del self.sampling_sessions[sampling]
        self.sessions.pop(session_id, None)
        self.finished[session_id] = why
        return runs

    def idle_sessions(self, timeout: float) -> list[str]:
        """Sessions that have sent nothing (a heartbeat, a request) for `timeout` seconds: their clients are gone."""
        now = time.monotonic()
        return [session_id for session_id, seen in self.sessions.items() if now - seen > timeout]

    # -- saved weights --
    def save_weights(self, model_id: str, owner: str, name: str, *, overwrite: bool = False) -> str:
        """The run's adapter and optimizer state on disk as `name`: what `load_weights` resumes from, also after a
        restart. The adapter is a peft adapter directory (`adapter/`), loadable by `PeftModel.from_pretrained`."""
        run = self.run(model_id, owner)
        path, directory = self._saved(model_id, "weights", name)
        if directory.exists() and not overwrite:
            raise RequestError(f"path={name!r}: {path} exists (pass overwrite=True to replace it)")
        state = run.training.state()
        self._write(directory, run, owner, state["weights"], {"optimizer": state["optimizer"], "steps": state["steps"]})
        return path

    def save_for_sampler(self, model_id: str, owner: str, name: str | None) -> str:
        """A sampler snapshot of the run's adapter as it is now: in memory (`name` None: an ephemeral path), and on
        disk too when named."""
        run = self.run(model_id, owner)
        tensors = run.training.base.adapter_tensors(model_id)
        if name is None:
            path = f"tinker://{model_id}/sampler_weights/ephemeral-{len(self.snapshots)}-{time.monotonic_ns()}"
        else:
            path, directory = self._saved(model_id, "sampler_weights", name)
            self._write(directory, run, owner, tensors, None)
        self._hold(model_id, path, (run.base_name, Snapshot(run.training.shape, tensors), owner))
        return path

    def _hold(self, run_id: str, path: str, snapshot: tuple[str, Snapshot, str]) -> None:
        """Keep `snapshot` in memory, and only the run's newest `sampler_snapshots`: older named ones are read from
        disk again when asked for, older unnamed ones are gone."""
        recent = self.recent.setdefault(run_id, [])
        if path in self.snapshots:  # saved again under its name: the loaded adapter holds the old weights
            self.samplers[self.snapshots[path][0]].forget(path)
            recent.remove(path)
        self.snapshots[path] = snapshot
        recent.append(path)
        while len(recent) > self.sampler_snapshots:
            self._drop_snapshot(recent.pop(0))

    def _drop_snapshot(self, path: str) -> None:
        """A sampler snapshot out of memory: a named one is read from disk again when asked for, an unnamed one is
        gone."""
        base_name, _, _ = self.snapshots.pop(path)
        self.samplers[base_name].forget(path)
        if "/sampler_weights/ephemeral-" in path:
            self.dropped.add(path)

    def load_weights(self, model_id: str, owner: str, path: str, *, optimizer: bool) -> None:
        """Resume run `model_id` from saved weights (`optimizer`: its Adam state too)."""
        run = self.run(model_id, owner)
        meta, tensors, extra = self._read(path, owner)
        if meta["base_model"] != run.base_name:
            raise RequestError(
                f"path={path!r}: saved from base {meta['base_model']!r}, this run's is {run.base_name!r}"
            )
        state = {"weights": tensors, **(extra or {})}
        run.training.load_state(state, with_optimizer=optimizer)

    def create_run_from(self, model_id: str, session: str, owner: str, path: str, *, optimizer: bool) -> None:
        """A new run shaped as the saved one at `path`, resumed from it."""
        meta, _, _ = self._read(path, owner, tensors=False)
        self.create_run(model_id, session, meta["base_model"], LoraShape(**meta["lora"]), owner)
        try:
            self.load_weights(model_id, owner, path, optimizer=optimizer)
        except Exception:
            self.close_run(model_id)
            raise

    def weights_info(self, path: str, owner: str) -> dict:
        meta, _, _ = self._read(path, owner, tensors=False)
        lora = meta["lora"]
        return {"base_model": meta["base_model"], "is_lora": True, "lora_rank": lora["rank"],
                "train_attn": lora["train_attn"], "train_mlp": lora["train_mlp"],
                "train_unembed": lora["train_unembed"]}  # fmt: skip

    def checkpoints(self, model_id: str, owner: str) -> list[dict]:
        """The run's saved weights (also those of a run of an earlier server)."""
        found = []
        for kind, label in (("weights", "training"), ("sampler_weights", "sampler")):
            for directory in sorted((self.state_dir / _on_disk(model_id) / kind).glob("*/meta.json")):
                name = directory.parent.name
                _same_owner(json.loads(directory.read_text())["owner"], owner, f"model_id={model_id!r}")
                found.append({"checkpoint_id": f"{kind}/{name}", "checkpoint_type": label,
                              "time": json.loads(directory.read_text())["time"],
                              "tinker_path": f"tinker://{model_id}/{kind}/{name}"})  # fmt: skip
        return found

    def _saved(self, model_id: str, kind: str, name: str) -> tuple[str, Path]:
        if not SAFE_NAME.match(name):
            raise RequestError(f"path={name!r}: expected a name of letters, digits, '.', '_' and '-'")
        return f"tinker://{model_id}/{kind}/{name}", self.state_dir / _on_disk(model_id) / kind / name

    def _write(self, directory: Path, run: Run, owner: str, tensors: dict, extra: dict | None) -> None:
        """A saved state, whole or absent: written beside, then renamed into place."""
        partial = directory.with_name(directory.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        training = run.training
        write_adapter(partial / "adapter", training.base.lora_config(training.shape), tensors)
        if extra is not None:
            torch.save(extra, partial / "optimizer.pt")
        meta = {"base_model": run.base_name, "lora": asdict(training.shape), "time": _now(), "owner": owner}
        (partial / "meta.json").write_text(json.dumps(meta))
        shutil.rmtree(directory, ignore_errors=True)
        partial.rename(directory)

    def _read(self, path: str, owner: str, *, tensors: bool = True) -> tuple[dict, dict, dict | None]:
        """Saved weights at `path`, if `owner`'s: `(meta, adapter tensors, optimizer state or None)`."""
        from safetensors.torch import load_file

        match = TINKER_PATH.match(path)
        if match is None:
            raise RequestError(
                f"path={path!r}: expected tinker://<model_id>/weights/<name> or .../sampler_weights/<name>"
            )
        directory = self.state_dir / _on_disk(match["run"]) / match["kind"] / match["name"]
        if not (directory / "meta.json").is_file():
            raise RequestError(f"path={path!r}: no such saved weights")
        meta = json.loads((directory / "meta.json").read_text())
        _same_owner(meta["owner"], owner, f"path={path!r}")
        if not tensors:
            return meta, {}, None
        weights = load_file(directory / "adapter" / "adapter_model.safetensors")
        extra = torch.load(directory / "optimizer.pt") if (directory / "optimizer.pt").is_file() else None
        return meta, weights, extra

    # -- sampling --
    def create_sampling_session(self, session_id: str, owner: str, base_model: str | None,
                                model_path: str | None) -> None:  # fmt: skip
        if model_path is not None:
            base_name, _ = self.snapshot(model_path, owner)
        elif base_model is not None:
            self.base(base_model)
            base_name = base_model
        else:
            raise RequestError("create_sampling_session: expected base_model or model_path")
        self.sampling_sessions[session_id] = SamplingSession(base_name, model_path, owner)

    def snapshot(self, path: str, owner: str) -> tuple[str, Snapshot]:
        """A sampler snapshot by path, if `owner`'s: in memory, or read from disk (named ones, also those of an
        earlier server)."""
        if path in self.dropped:
            raise RequestError(f"model_path={path!r}: these unnamed sampler weights were let go: the server keeps "
                               f"each run's newest {self.sampler_snapshots} in memory (--sampler-snapshots); "
                               "save_weights_for_sampler with a name keeps them on disk")  # fmt: skip
        if path not in self.snapshots:
            meta, tensors, _ = self._read(path, owner)
            self.base(meta["base_model"])
            snapshot = (meta["base_model"], Snapshot(LoraShape(**meta["lora"]), tensors), meta["owner"])
            self._hold(TINKER_PATH.match(path)["run"], path, snapshot)
        base_name, snapshot, saved_by = self.snapshots[path]
        _same_owner(saved_by, owner, f"model_path={path!r}")
        return base_name, snapshot

    def sampling_session(self, session_id: str, owner: str) -> SamplingSession:
        if session_id not in self.sampling_sessions:
            raise NotFound(f"sampling_session_id={session_id!r}: no such sampling session")
        session = self.sampling_sessions[session_id]
        _same_owner(session.owner, owner, f"sampling_session_id={session_id!r}")
        return session

    def _sampler_adapter(self, session: SamplingSession) -> str | None:
        if session.model_path is None:
            return None
        _, snapshot = self.snapshot(session.model_path, session.owner)
        return self.samplers[session.base_name].activate(session.model_path, snapshot)

    def sample_many(self, requests: list[tuple[str, str, SampleRequest]]) -> list[list[Sequence] | Exception]:
        """Each `(sampling session, owner, request)`'s sequences — or the error that request alone meets. Requests on
        one base are decoded together, whichever runs' weights they sample (`Sampler.sample_many`)."""
        answers: list = [None] * len(requests)
        by_base: dict[str, list[tuple[int, str | None, SampleRequest]]] = {}
        for i, (session_id, owner, request) in enumerate(requests):
            try:
                session = self.sampling_session(session_id, owner)
                self.samplers[session.base_name].check(request)
                by_base.setdefault(session.base_name, []).append((i, self._sampler_adapter(session), request))
            except (RequestError, NotFound, PermissionError) as error:
                answers[i] = error
        for base_name, batch in by_base.items():
            sequences = self.samplers[base_name].sample_many([(adapter, request) for _, adapter, request in batch])
            for (i, _, _), answer in zip(batch, sequences, strict=True):
                answers[i] = answer
        return answers

    def prompt_logprobs(self, session_id: str, owner: str, prompt: list[int]) -> list[float | None]:
        """Each prompt token's log-prob given those before it (None for the first), under the session's weights."""
        session = self.sampling_session(session_id, owner)
        return self.samplers[session.base_name].prompt_logprobs(self._sampler_adapter(session), prompt)


def _same_owner(found: str | None, owner: str, what: str) -> None:
    if found != owner:
        raise PermissionError(f"{what}: belongs to another API key")


def _on_disk(model_id: str) -> str:
    return model_id.replace(":", "_")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
