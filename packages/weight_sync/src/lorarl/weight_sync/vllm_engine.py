"""lorarl's weight transfer as a vLLM weight-transfer engine (worker side; imports vLLM).

Registered with vLLM's `WeightTransferEngineFactory` as "lorarl" by `lorarl.weight_sync.vllm.register` (a vLLM general
plugin, so every vLLM process has it) and selected with `weight_transfer_config={"backend": "lorarl"}`. vLLM's RL API
drives it: `init_weight_transfer_engine` opens its end of the trainer's channel (`weight_sync.channels`, by name),
`update_weights` receives one version (an `Update` of the form the update info names),
`start_weight_update` / `finish_weight_update` frame it.

**A version is applied whole or not at all.** `update_weights` first receives the complete version — every bucket's
checksum verified, the version number the one announced, every tensor of the manifest present — into a staging copy
(host memory by default), and only then loads it through vLLM's layerwise reload (fused QKV/gate-up, repacked or
quantized layouts are vLLM's own loaders' business). So a transfer that fails (the sender dies or stalls, a bucket is
corrupt or missing) leaves the model untouched: the previous version keeps serving. Staging costs one copy of the
weights for the length of an update. A failure while applying a complete version — a name or shape this model does not
have, which is a configuration error, not a transient one — leaves the model *incomplete*: the error says so
(`INCOMPLETE`), and lorarl's drivers refuse to generate until a later version is applied whole.

A factor set (form "factors", `weight_sync.factors`: named tensors, over any channel) is staged the same way,
checked against the base weights the workers keep (the first set brings them: the adapted weights and their siblings,
which vLLM fuses with them), merged with lorarl's kernel and loaded through the same layerwise reload: only the layers
it names are reloaded.

Mixtures of experts: vLLM takes transformers 5's fused expert tensors (`mlp.experts.gate_up_proj` [E, 2I, H]) under
their own names; its CPU kernel's prepacked expert layout is made again for each reloaded layer
(`prepack_reloaded_experts`). A layer's experts reload whole: an update names all of its expert tensors or none.

Tied embeddings need nothing more: vLLM's layerwise reload processes the tied LM head too (on vLLM's CPU backend the
head keeps a prepacked GEMM of its own), which the tests check by generating after versions that change the embedding.
"""

import contextlib
import logging
import sys
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from lorarl.weight_sync.adapter_dir import save_adapter
from lorarl.weight_sync.channels import CHANNELS, Channel, Link, open_channel
from lorarl.weight_sync.factors import FactorMerger, read_factor_set
from lorarl.weight_sync.gc_pause import gc_paused
from lorarl.weight_sync.update import FORMS, Update
from lorarl.weight_sync.vllm import INCOMPLETE, adapter_path


@dataclass
class LorarlInitInfo(WeightTransferInitInfo):
    """How the workers reach the trainer: `channel` names a mechanism of `weight_sync.channels` (gloo, nccl, ipc,
    local) whose sender, rank 0, is the trainer and whose receivers, ranks `rank_offset`.., are the workers."""

    channel: str
    host: str = "127.0.0.1"
    port: int = 0
    world_size: int = 2
    rank_offset: int = 1
    timeout: float = 300.0
    staging: str = "cpu"  # where a version waits until it is complete: "cpu" (host memory) or "device"

    def __post_init__(self):
        if self.channel not in CHANNELS:
            raise ValueError(f"channel must be one of {tuple(CHANNELS)}, got {self.channel!r}")
        if self.staging not in ("cpu", "device"):
            raise ValueError(f"staging must be 'cpu' or 'device', got {self.staging!r}")


@dataclass
class LorarlUpdateInfo(WeightTransferUpdateInfo):
    """One version and its form (`weight_sync.update`): "weights" (applied to the model), "factors" (merged into
    it) or "adapter" (written as a peft directory under `adapter_dir`, for a `LoRARequest`)."""

    version: int
    form: str = "weights"
    adapter_dir: str | None = None

    def __post_init__(self):
        if self.form not in FORMS:
            raise ValueError(f"form must be one of {FORMS}, got {self.form!r}")
        if self.form == "adapter" and not self.adapter_dir:
            raise ValueError("an adapter update needs adapter_dir (where the workers write it)")


class LorarlWeightTransferEngine(WeightTransferEngine[LorarlInitInfo, LorarlUpdateInfo]):
    init_info_cls = LorarlInitInfo
    update_info_cls = LorarlUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.info: LorarlInitInfo | None = None
        self.channel: Channel | None = None
        self.factors = FactorMerger(self.model_config.dtype)  # the factor sync's pristine base weights
        self.said: set[str] = set()  # notes logged once

    # --- vLLM's RL API ---------------------------------------------------------------------------------------------

    def init_transfer_engine(self, init_info: LorarlInitInfo) -> None:
        self.shutdown()
        self.info = init_info
        link = Link(init_info.host, init_info.port, init_info.world_size - 1, init_info.timeout)
        self.channel = open_channel(init_info.channel, link, init_info.rank_offset + worker_rank(), device=self.device)

    def start_weight_update(self) -> None:
        """Nothing to prepare: `update_weights` receives a whole version before it touches the model."""

    def finish_weight_update(self) -> None:
        """Nothing to finish: `update_weights` applied the version whole (or raised, changing nothing)."""

    def update_weights(self, update_info: dict) -> None:
        """Receive one version and apply it (vLLM's default also synchronizes an accelerator, which a CPU lacks)."""
        info = self.parse_update_info(update_info)
        self.receive_weights(info)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: LorarlUpdateInfo) -> None:
        if self.channel is None:
            raise RuntimeError("the lorarl weight transfer is not initialized: call init_weight_transfer_engine first")
        update = self.channel.receive(update_info.form, update_info.version)
        if update.form == "adapter":
            if worker_rank() == 0:
                save_adapter(update.tensors, update.config, adapter_path(update_info.adapter_dir, update.version))
            return
        staged = self._stage(update)
        if update.form == "factors":
            self._merge_factors(staged, update.version)
        elif self.channel.received_coverage(update) == "subset":
            self._say_once("a version that covers some layers (a merged update after the first: the adapted modules "
                           "alone) leaves vLLM's other layers as they are; its 'Failed to load weights' warnings for "
                           "them are expected, and not shown")  # fmt: skip
            with _quiet(LAYERWISE):
                self._apply(staged, update.version)
        else:
            self._apply(staged, update.version)

    def shutdown(self) -> None:
        """Leave the trainer's channel."""
        if self.channel is not None:
            self.channel.close()
        self.channel = self.info = None

    # --- lorarl's side ----------------------------------------------------------------------------------------------

    @gc_paused()
    def _stage(self, update: Update) -> list[tuple[str, torch.Tensor]]:
        """The whole version, received and verified, in tensors of its own; raises (changing nothing) if any of it
        is missing, corrupt or of another version."""
        staging = torch.device("cpu") if self.info.staging == "cpu" else self.device
        return [(name, _staged(tensor, staging)) for name, tensor in update.named()]

    def _apply(self, staged, version: int) -> None:
        """Load a complete version (named tensors) through vLLM's layerwise reload (each layer processed as its
        weights complete)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        prepack_reloaded_experts(self.model)
        initialize_layerwise_reload(self.model)
        try:
            self.model.load_weights(iter(staged))
        except Exception as error:
            raise RuntimeError(f"{INCOMPLETE}: version {version} failed while it was applied "
                               f"({type(error).__name__}: {error})") from error  # fmt: skip
        finally:
            finalize_layerwise_reload(self.model, self.model_config)

    def _merge_factors(self, staged: list[tuple[str, torch.Tensor]], version: int) -> None:
        """A staged factor set, checked whole against the base weights kept (changing nothing if it does not fit),
        merged and loaded. Layers it does not name keep their weights: vLLM's reload puts them back, quietly."""
        factors, base = read_factor_set(dict(staged))
        self.factors.store(base, share=self.channel.hands_over)  # in the trainer's process: its own tensors
        merging = self.factors.merged(factors)  # checked here, before the model is touched; merged as it loads
        with _quiet(LAYERWISE):  # "Failed to load weights" for each layer the set leaves alone
            self._apply(merging, version)

    def _say_once(self, text: str) -> None:
        if text not in self.said and worker_rank() == 0:
            print(f"lorarl: {text}", file=sys.stderr, flush=True)
        self.said.add(text)


def prepack_reloaded_experts(model: torch.nn.Module) -> None:
    """vLLM's CPU fused-MoE kernel reads expert weights prepacked into its own tiled layout, made once after the first
    load. On a reload its method sees the kernel already built (`moe_kernel` set: a weight update, in vLLM's terms)
    and copies the new weights in as they come, unpacked: the experts then compute with scrambled weights, and nothing
    says so (vLLM 0.32). Each such layer's method is made to prepack a reload too (padding as at the first load), so
    the reload copies the packed weights into the kernel's tensors; a layer no update touches is never processed.
    Idempotent; other backends (GPUs') are left alone."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM without the CPU experts
        return
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        if kernel is None or getattr(method, "lorarl_prepacks_reloads", False):
            continue
        if not isinstance(kernel.fused_experts, CPUUnquantizedExperts):
            continue
        process = method.process_weights_after_loading

        def process_and_prepack(layer, process=process, method=method):
            reloading = method.moe_kernel is not None
            process(layer)
            if reloading:
                method.moe_kernel.fused_experts.process_weights_after_loading(layer)

        method.process_weights_after_loading = process_and_prepack
        method.lorarl_prepacks_reloads = True


def worker_rank() -> int:
    """This worker's rank among its engine's workers."""
    from vllm.distributed.parallel_state import get_world_group

    return get_world_group().rank


LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"  # vLLM's reload, which warns of layers not loaded


@contextlib.contextmanager
def _quiet(logger: str):
    """`logger`'s warnings silenced for the duration (errors still shown)."""
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _staged(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor.to(device)  # a copy only when it arrived elsewhere (received tensors are already their own)
