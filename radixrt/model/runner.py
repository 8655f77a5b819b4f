"""Loads the model, owns the KV pool and the attention backend, runs forwards.

This is the one place for device, dtype and torch.compile (later CUDA graphs);
the scheduler only calls ``forward``.
"""

from __future__ import annotations

import functools
import logging

import torch

from radixrt.attention.base import AttentionBackend, ForwardBatch, ForwardMode
from radixrt.cache.kv_pool import KVPool
from radixrt.cache.swa_pool import SWAKVPool
from radixrt.config import EngineConfig
from radixrt.memory import (
    HeapCollapser,
    anonymous_regions,
    collapse_anonymous_memory,
    keep_freed_memory,
)
from radixrt.model import exactness
from radixrt.model.decode_chain import decode_chain_for
from radixrt.model.hf_config import ModelConfig
from radixrt.model.kernel_set import Kernels, NotExact, choose_kernels
from radixrt.model.llama import LlamaForCausalLM
from radixrt.model.weights import cache_dir, iter_weights, weights_file_bytes
from radixrt.quant.gguf_model import exact_in, is_gguf_folder, iter_gguf_weights
from radixrt.quant.quant_linear import describe_weights
from radixrt.quant.rtn import quantized_weights
from radixrt_kernels.cpu import library as cpu_library

logger = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_BUDGET_BYTES = 1 << 30
MAX_AUTO_SLOTS = 1 << 17
HUGE_PAGE_MIN_WEIGHT_BYTES = 64 << 20


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, model_cfg: ModelConfig) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.bfloat16
    return _DTYPES.get(str(model_cfg.torch_dtype).replace("torch.", ""), torch.bfloat16)


def make_attention_backend(
    name: str, pool: KVPool, num_heads: int | None = None, exact: bool = False
) -> AttentionBackend:
    """The backend ``name`` ("cpu", "triton", "torch"), or for "auto": Triton on CUDA, the C
    kernel on the CPU where it takes the pool, else the reference backend ("torch").
    ``num_heads``: the model's query heads (the C kernel measures its path for them);
    ``exact``: the C kernel's exact mode, the Triton kernels' deterministic one."""
    if name == "auto":
        from radixrt.attention.cpu_backend import unavailable_reason

        name = (
            "triton"
            if pool.device.type == "cuda"
            else "cpu"
            if unavailable_reason(pool) is None
            else "torch"
        )
    if name == "cpu":
        from radixrt.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend(pool, num_heads, exact=exact)
    if name == "torch":
        from radixrt.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(pool)
    if name == "triton":
        from radixrt.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(pool, deterministic=exact)
    raise ValueError(f"unknown attention_backend {name!r}")


def hybrid_swa_refused(config: EngineConfig, model_cfg: ModelConfig, device) -> str | None:
    """Why a model's sliding-window layers cannot keep only their window's KV here (None: they
    can): the model has none, or a setting keeps every token's."""
    if model_cfg.sliding_window is None:
        return "the model has no sliding-window layer"
    if config.disable_hybrid_swa_memory:
        return "disable_hybrid_swa_memory"
    if config.page_size != 1:
        return f"page_size {config.page_size} (the window's KV is released token by token)"
    if device.type != "cpu" or config.attention_backend not in ("auto", "cpu", "torch"):
        return f"the {config.attention_backend} attention backend on {device.type}"
    if config.enable_hierarchical_cache:
        return "enable_hierarchical_cache (the host and storage tiers hold every layer's KV)"
    return None


def served_context(model_cfg: ModelConfig) -> int:
    """The longest sequence served: the model's ``max_context``, logged with its reason where
    that is below max_position_embeddings."""
    if model_cfg.context_bound is not None:
        logger.info(
            "context: %d tokens, not max_position_embeddings %d (%s)",
            model_cfg.max_context,
            model_cfg.max_position_embeddings,
            model_cfg.context_bound,
        )
    return model_cfg.max_context


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str, model_cfg: ModelConfig) -> None:
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, model_cfg)
        self.quantization = config.quantization
        self.malloc_tuned = self.device.type == "cpu" and keep_freed_memory()
        host_memory = anonymous_regions(heap=False)  # not ours to collapse (see below)
        self.model_cfg = model_cfg
        self.max_context = served_context(model_cfg)
        wanted = exactness.refuse_conflicts(config, self.device.type)
        not_exact: list[str] = []
        lib = cpu_library.load(cache_dir()) if self.device.type == "cpu" else None
        self.kernels = self._kernels(config, lib, wanted, not_exact)
        self.kernels.defer = is_gguf_folder(model_path) or config.quantization is not None
        self.model = self._load_model(model_path, self.kernels)
        logger.info("kernels: %s", self.kernels.describe())
        self.weights_info = self._describe_weights(config, model_path, lib)
        self.pool = self._make_pool(config)
        self.attn_backend = make_attention_backend(
            config.attention_backend, self.pool, model_cfg.num_heads, exact=wanted
        )
        logger.info("attention: %s", self.attn_backend.describe())
        if self.attn_backend.name == "torch":
            from radixrt.attention.cpu_backend import unavailable_reason

            not_exact.append(f"attention runs on PyTorch ({unavailable_reason(self.pool)})")
        self.exactness = exactness.settle(config, wanted, not_exact, self.device.type)
        logger.info("outputs: %s", self.exactness.describe())
        self.decode_chain, self.decode_chain_info = None, "off: disable_decode_chain"
        if not config.disable_decode_chain:
            self.decode_chain, self.decode_chain_info = decode_chain_for(
                self.model, self.attn_backend, lib
            )
        logger.info("decode chain: %s", self.decode_chain_info)
        # Huge pages for the weights, the KV pool and the heap the activations reuse, where the
        # weights outgrow the caches (a test-sized model would only pay the collapse).
        self.huge_pages = (
            self.device.type == "cpu" and self._weight_bytes() >= HUGE_PAGE_MIN_WEIGHT_BYTES
        )
        self.huge_page_bytes = (
            collapse_anonymous_memory(since=host_memory) if self.huge_pages else 0
        )
        self.heap = HeapCollapser() if self.huge_pages else None
        if config.enable_torch_compile:
            self.model.enable_torch_compile()
            self._compile_graphs()

    def _kernels(self, config: EngineConfig, lib, exact: bool, not_exact: list[str]) -> Kernels:
        """The model's kernels: row-invariant where ``exact`` and this device has them (else
        the reason goes to ``not_exact`` and the fastest per batch size run)."""
        choose = functools.partial(
            choose_kernels,
            self.device,
            self.dtype,
            lib,
            compiled=config.enable_torch_compile,
            linear=config.linear_kernel,
            cache_dir=cache_dir(),
        )
        if exact and self.device.type != "cpu":
            return choose()  # cuBLAS's linears: reported by exactness.settle, not refused
        if exact:
            try:
                return choose(exact=True)
            except NotExact as e:
                not_exact.append(str(e))
        return choose()

    def _describe_weights(self, config: EngineConfig, model_path: str, lib) -> dict:
        """The weights' quantization, each role's types and kernels, their bytes (logged)."""
        info = {
            "quantization": config.quantization or ("gguf" if is_gguf_folder(model_path) else None),
            **describe_weights(self.model, lib),
            "weight_file_bytes": weights_file_bytes(model_path),
        }
        logger.info(
            "weights: %s, %.1f MiB held (files %.1f MiB): %s",
            info["quantization"] or str(self.dtype).removeprefix("torch."),
            info["weight_bytes"] / 2**20,
            info["weight_file_bytes"] / 2**20,
            info["weights"],
        )
        return info

    def _load_model(self, path: str, kernels: Kernels) -> LlamaForCausalLM:
        default = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = LlamaForCausalLM(self.model_cfg, kernels)
        finally:
            torch.set_default_dtype(default)
        if is_gguf_folder(path):
            weights = exact_in(iter_gguf_weights(path), self.dtype)
        else:
            weights = iter_weights(path)
        if self.quantization not in (None, "gguf"):
            weights = quantized_weights(weights, self.quantization)
        model.load_weights(weights)  # each linear's weight laid out for its method
        return model.eval()

    def _make_pool(self, config: EngineConfig) -> KVPool | SWAKVPool:
        """The KV pool: an ``SWAKVPool`` where some layers slide a window (their KV kept for
        the window only) unless ``hybrid_swa_refused`` says why not, else one ``KVPool``."""
        cfg = self.model_cfg
        shape = (cfg.num_kv_heads, cfg.head_dim, self.dtype, config.running_limit)
        rows = self.max_context + config.page_size
        why = hybrid_swa_refused(config, cfg, self.device)
        if why is not None:
            if cfg.sliding_window is not None:
                logger.info("sliding-window layers keep every token's KV: %s", why)
            return KVPool(self._num_slots(config), cfg.num_layers, *shape, rows, self.device)
        sliding = [w is not None for w in cfg.layer_windows]
        full, swa = self._swa_slots(config, sum(sliding))
        logger.info(
            "KV: %d full slots (%d layers), %d slots for the %d sliding-window layers (window %d)",
            full,
            len(sliding) - sum(sliding),
            swa,
            sum(sliding),
            cfg.sliding_window,
        )
        return SWAKVPool(full, swa, sliding, *shape, rows, self.device, window=cfg.sliding_window)

    def _swa_slots(self, config: EngineConfig, n_swa: int) -> tuple[int, int]:
        """(full slots, SWA slots): the SWA pool ``swa_full_tokens_ratio`` of the full one,
        the two sized together from ``max_total_tokens`` (the full pool) or the KV budget."""
        cfg, ratio = self.model_cfg, config.swa_full_tokens_ratio
        if config.max_total_tokens is not None:
            full = config.max_total_tokens
        else:
            per = KVPool.bytes_per_slot(1, cfg.num_kv_heads, cfg.head_dim, self.dtype)
            per_full_slot = per * ((cfg.num_layers - n_swa) + ratio * n_swa)
            full = min(int(CPU_KV_BUDGET_BYTES // per_full_slot), MAX_AUTO_SLOTS)
        return full + 1, max(int(full * ratio), 4) + 1  # + slot 0 of each (padding)

    def _num_slots(self, config: EngineConfig) -> int:
        """KV slots including the reserved first page, a multiple of page_size."""
        p = config.page_size
        if config.max_total_tokens is not None:
            usable = config.max_total_tokens
        else:
            per_slot = KVPool.bytes_per_slot(
                self.model_cfg.num_layers,
                self.model_cfg.num_kv_heads,
                self.model_cfg.head_dim,
                self.dtype,
            )
            budget = CPU_KV_BUDGET_BYTES
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * 0.8)
            usable = min(budget // per_slot, MAX_AUTO_SLOTS)
        return (-(-usable // p) + 1) * p

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """float32 logits [B, vocab] for each request's last token."""
        self._prepare(batch)
        chain = self.decode_chain
        if chain is not None and chain.takes(batch):
            logits = chain.logits(batch)
        else:
            logits = self.model(batch)
        self._settle()
        return logits

    @torch.inference_mode()
    def forward_hidden(
        self, batch: ForwardBatch, hidden_indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``'s logits, and the final hidden state (after the final norm: what the LM
        head reads) of the tokens at ``hidden_indices`` (int64 [N], into the batch's tokens),
        float32 [N, hidden]. The same model arithmetic as ``forward`` (eager where the model is
        compiled), so each row has the bits ``forward``'s LM head reads there."""
        self._prepare(batch)
        chain, model = self.decode_chain, self.model
        if chain is not None and chain.takes(batch):
            h, residual = chain.body(batch)
        else:
            h, residual = model.body(model.embed(batch.input_ids), batch.positions, batch)
        hidden = model.final_hidden(h, residual, hidden_indices.to(h.device)).float()
        idx = batch.logits_indices
        logits = model.head(h, residual, idx if idx is not None else batch.last_token_indices())
        self._settle()
        return logits, hidden

    def _prepare(self, batch: ForwardBatch) -> None:
        """The step's attention metadata, before its forward."""
        batch.attn_backend = self.attn_backend
        self.attn_backend.init_forward_metadata(batch)

    def _settle(self) -> None:
        """After a forward: new activation memory goes into huge pages too, once."""
        if self.heap is not None:
            self.heap.maybe_collapse()

    def _compile_graphs(self) -> None:
        """Compile before serving, not in a request's forward. Dynamo gives token and logit
        counts of 1 graphs of their own, so three shapes cover every later batch: several
        requests (extend or decode), one request's extend, one request's decode."""
        for mode, lens in (
            (ForwardMode.EXTEND, [3, 2]),
            (ForwardMode.EXTEND, [4]),
            (ForwardMode.DECODE, [1]),
        ):
            self._padding_forward(mode, lens)

    def probe_forward(self, n: int) -> None:
        """One request's extend of n tokens, finished on the device before returning: a
        forward to time (``radixrt.scheduler.step_cost``)."""
        self._padding_forward(ForwardMode.EXTEND, [n])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _padding_forward(self, mode: ForwardMode, lens: list[int]) -> None:
        """A forward of requests of ``lens`` tokens whose K/V go to slot 0, the reserved
        padding slot, which is zeroed again afterwards."""
        t = sum(lens)
        self.forward(
            ForwardBatch(
                mode=mode,
                input_ids=torch.zeros(t, dtype=torch.int64, device=self.device),
                positions=torch.cat([torch.arange(n) for n in lens]).to(self.device),
                out_cache_loc=torch.zeros(t, dtype=torch.int64, device=self.device),
                req_rows=torch.zeros(len(lens), dtype=torch.int64, device=self.device),
                seq_lens=list(lens),
                extend_lens=list(lens),
            )
        )
        for buf in (*self.pool.k_buffers, *self.pool.v_buffers):
            buf[0].zero_()

    def _weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())
