"""The whole config: one typed object built from one YAML file."""

from pydantic import Field, model_validator

from hone.config.adapter import AdapterConfig
from hone.config.base import Section
from hone.config.data import DataConfig
from hone.config.distributed import DistributedConfig
from hone.config.logging import LoggingConfig
from hone.config.memory import MemoryConfig
from hone.config.model import ModelConfig
from hone.config.optimizer import OptimizerConfig
from hone.config.performance import PerformanceConfig
from hone.config.training import TrainingConfig


class HoneConfig(Section):
    """A fine-tuning run. Sections mirror the package layout: one module per concern."""

    model: ModelConfig
    data: DataConfig
    adapter: AdapterConfig = Field(default_factory=AdapterConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    performance: PerformanceConfig = Field(default_factory=PerformanceConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)

    @model_validator(mode="after")
    def _eval_needs_data(self) -> "HoneConfig":
        for key in ("eval_steps", "evals_per_epoch"):
            if getattr(self.training, key) is not None and not self.data.has_eval:
                raise ValueError(
                    f"training.{key} is set but there is no eval data: set data.val_set_size "
                    f"or data.test_datasets, or remove training.{key}"
                )
        return self

    @property
    def packs_documents(self) -> bool:
        """Whether micro-batches hold several documents in a row (``data.sample_packing``, a packed
        eval split, or a preference objective, which packs each micro-batch's pairs into one row)."""
        return self.data.sample_packing or self.data.packs_eval or self.training.is_preference

    @model_validator(mode="after")
    def _packing_needs_isolating_attention(self) -> "HoneConfig":
        if self.training.is_preference and not self.model.attention_isolates_packed_documents:
            from hone.config.attention import BACKENDS

            usable = ", ".join(n for n, b in BACKENDS.items() if b.isolates_packed_documents and b.installed)
            raise ValueError(
                f"training.objective: {self.training.objective} packs each micro-batch's chosen and rejected sequences "
                f"into one row, which needs an attention backend that keeps them apart, but model.attn_implementation "
                f"'{self.model.attn_implementation}' does not: use one of: {usable}"
            )
        packs = self.data.sample_packing or self.data.packs_eval
        if packs and not self.model.attention_isolates_packed_documents:
            from hone.config.attention import BACKENDS

            usable = ", ".join(n for n, b in BACKENDS.items() if b.isolates_packed_documents and b.installed)
            raise ValueError(
                f"data.sample_packing needs an attention backend that keeps packed documents apart, but "
                f"model.attn_implementation '{self.model.attn_implementation}' does not: use one of: {usable}, "
                "or set data.sample_packing: false"
            )
        return self

    @model_validator(mode="after")
    def _varlen_needs_packing(self) -> "HoneConfig":
        if self.model.sdpa_varlen is True and not self.packs_documents:
            raise ValueError(
                "model.sdpa_varlen: true only changes packed rows, but data.sample_packing is off (and the objective "
                "is sft): set data.sample_packing: true, or remove sdpa_varlen"
            )
        return self

    @model_validator(mode="after")
    def _fused_lora_needs_lora(self) -> "HoneConfig":
        if self.performance.lora_linear == "fused" and not self.adapter.is_lora:
            raise ValueError(
                "performance.lora_linear: fused chooses how LoRA layers compute, but adapter.type is not lora "
                "(a full fine-tune has none): remove it, or set adapter.type: lora"
            )
        return self

    @model_validator(mode="after")
    def _fp8_needs_bf16(self) -> "HoneConfig":
        """Float8 matmuls write bf16 (rowwise scaling has no float32 output on CUDA) and the
        frozen-base layers keep a bf16 weight beside its float8 copies."""
        perf = self.performance
        if perf.fp8 == "off":
            return self
        if self.model.dtype != "bfloat16":
            raise ValueError(
                f"performance.fp8: {perf.fp8} needs model.dtype: bfloat16 (got {self.model.dtype}); "
                "set model.dtype: bfloat16, or fp8: off"
            )
        if perf.fp8_base_linears == "all" and not self.adapter.is_lora:
            raise ValueError(
                f"performance.fp8_base_linears: {perf.fp8_base_linears} chooses frozen linears of a LoRA base, "
                "but adapter.type is not lora (a full fine-tune converts every linear but the head): remove it"
            )
        return self

    @model_validator(mode="after")
    def _tiled_layers_need_causal_rows(self) -> "HoneConfig":
        """Tiled layers' chunks attend through hone's causal sdpa, to every earlier position of
        the row: no document mask (packing), no other backend. FSDP2 around them is untested."""
        chunks = self.memory.tiled_layers_chunks
        if not chunks:
            return self
        key = f"memory.tiled_layers: {chunks}"
        if self.training.is_preference:
            raise ValueError(
                f"{key} computes causal rows without a mask, but training.objective: {self.training.objective} packs "
                "each micro-batch's pairs into one row with a document mask: set memory.tiled_layers: off"
            )
        if self.data.sample_packing or self.data.packs_eval:
            raise ValueError(
                f"{key} computes causal rows without a mask, but data.sample_packing (or eval_sample_packing) is on: "
                "packed rows carry a document mask. Set data.sample_packing: false, or memory.tiled_layers: off"
            )
        if self.model.attn_implementation != "sdpa":
            raise ValueError(
                f"{key} attends through hone's tiled sdpa, but model.attn_implementation is "
                f"'{self.model.attn_implementation}': allowed: sdpa, or memory.tiled_layers: off"
            )
        if self.distributed.strategy == "fsdp":
            raise ValueError(
                f"{key} is untested under distributed.strategy: fsdp (FSDP2 around a layer computed in chunks): use "
                "distributed.strategy: ddp, or memory.tiled_layers: off"
            )
        return self

    @model_validator(mode="after")
    def _quantized_base_needs_lora(self) -> "HoneConfig":
        """A 4-bit base cannot be trained: its weights are codes, not parameters. FSDP2 would have
        to shard and all-gather the packed codes and scales, which hone does not do yet. An MXFP4
        checkpoint (known only once its config.json is read) gets the same refusals at plan time
        (:mod:`hone.transforms.quantize`)."""
        quantize = self.model.quantize
        if quantize == "none":
            return self
        what = "the experts' weights" if quantize == "mxfp4" else "the base weights"
        if not self.adapter.is_lora:
            raise ValueError(
                f"model.quantize: '{quantize}' stores {what} in 4 bits, which cannot "
                "be trained, but adapter.type is 'none' (full fine-tune): set adapter.type: lora (QLoRA), "
                "or model.quantize: none"
            )
        if self.distributed.strategy == "fsdp":
            held = "the model with 4-bit experts" if quantize == "mxfp4" else "the 4-bit model, about a quarter of its bf16 size"
            raise ValueError(
                f"model.quantize: '{quantize}' does not work with distributed.strategy: fsdp "
                f"(FSDP2 would shard the packed 4-bit weights): use distributed.strategy: ddp (each GPU holds {held}), "
                "or model.quantize: none"
            )
        if self.performance.fp8 != "off":
            raise ValueError(
                f"model.quantize: '{quantize}' and performance.fp8: {self.performance.fp8} both replace "
                f"how the base computes ({what} are dequantized from 4 bits to bf16 for their matmuls, a float8 base "
                "keeps float8 copies): choose one, model.quantize: none or performance.fp8: off"
            )
        return self

    @model_validator(mode="after")
    def _expert_parallel_needs_hone_experts(self) -> "HoneConfig":
        """The expert-parallel exchange lives in hone's experts forward (bf16 or MXFP4 experts)."""
        ep = self.distributed.expert_parallel
        if ep == 1 or ep == "auto":  # auto resolves to 1 where these refuse it
            return self
        if self.model.experts_implementation in ("eager", "grouped_mm"):
            raise ValueError(
                f"distributed.expert_parallel: {ep} runs in hone's experts forward, but model.experts_implementation "
                f"is '{self.model.experts_implementation}': allowed with expert_parallel: auto, hone"
            )
        return self

    @model_validator(mode="after")
    def _context_parallel_composes(self) -> "HoneConfig":
        """What context parallelism cannot run with yet, known from the config alone (the model's
        heads and the launch are checked before the model loads: :mod:`hone.transforms.context_parallel`)."""
        cp = self.distributed.context_parallel
        if cp == 1:
            return self
        key = f"distributed.context_parallel: {cp}"
        if self.data.sample_packing and self.data.sequence_len % cp:
            raise ValueError(
                f"{key} splits every packed row of data.sequence_len: {self.data.sequence_len} tokens into {cp} equal "
                f"shards: use a data.sequence_len that is a multiple of {cp}"
            )
        if self.memory.tiled_layers not in ("auto", "off"):
            raise ValueError(
                f"{key} does not run with memory.tiled_layers: {self.memory.tiled_layers} yet (a chunk of a rank's shard "
                "is not a contiguous piece of the sequence): set memory.tiled_layers: off"
            )
        return self

    @model_validator(mode="after")
    def _preference_composes(self) -> "HoneConfig":
        """What a preference objective (DPO, IPO, ORPO) does not run with yet, each naming its key."""
        t = self.training
        if not t.is_preference:
            return self
        key = f"training.objective: {t.objective}"
        if self.data.explicitly_set("sample_packing") and self.data.sample_packing:
            raise ValueError(
                f"data.sample_packing: true does not apply to {key}: each micro-batch packs its own micro_batch_size "
                "pairs (chosen and rejected sequences) into one row, never pairs of different steps: remove it"
            )
        if self.data.explicitly_set("eval_sample_packing") and self.data.eval_sample_packing:
            raise ValueError(
                f"data.eval_sample_packing: true does not apply to {key}: eval micro-batches pack their pairs as "
                "training ones do: remove it"
            )
        if self.data.pad_to_sequence_len:
            raise ValueError(
                f"data.pad_to_sequence_len: true does not apply to {key}: each micro-batch packs its pairs into one "
                "row as wide as they are (performance.cuda_graphs: true gives every pair row one layout): remove it"
            )
        refusals = (
            (self.distributed.context_parallel != 1, f"distributed.context_parallel: {self.distributed.context_parallel}"),
            (
                self.distributed.expert_parallel not in (1, "auto"),
                f"distributed.expert_parallel: {self.distributed.expert_parallel}",
            ),
            (self.model.dtype == "float16", "model.dtype: float16 (use bfloat16)"),
        )
        for refused, what in refusals:
            if refused:
                raise ValueError(f"{what} does not run with {key} yet: remove it, or train sft")
        if t.preference.reference == "adapter_disabled" and not self.adapter.is_lora:
            raise ValueError(
                "training.preference.reference: adapter_disabled needs an adapter to switch off, but adapter.type is "
                f"'{self.adapter.type}' (full fine-tune): set adapter.type: lora, or reference: auto (precomputed)"
            )
        return self

    @property
    def sequences_per_micro_batch(self) -> int:
        """Sequences of ``data.sequence_len`` at most in one micro-batch: ``micro_batch_size`` rows,
        or for a preference objective its pairs' chosen and rejected sequences (twice as many, in
        one packed row): what the memory model counts a micro-batch's tokens by."""
        return self.training.micro_batch_size * (2 if self.training.is_preference else 1)

    def micro_batch_tokens_per_rank(self, sequence_len: int | None = None) -> int:
        """Tokens one rank computes outside attention in a micro-batch of rows ``sequence_len``
        wide (default ``data.sequence_len``): under ``distributed.context_parallel: N`` its shard
        of each row, ``ceil(sequence_len / N)`` (inside attention it holds the whole sequence for
        ``1/N`` of the heads: the same bytes)."""
        shard = -(-(sequence_len or self.data.sequence_len) // self.distributed.context_parallel)
        return shard * self.sequences_per_micro_batch

    @property
    def preference_reference(self) -> str | None:
        """Where DPO's and IPO's reference log-probs come from: ``adapter_disabled`` or
        ``precomputed`` (``training.preference.reference``); None without a reference (sft, orpo).

        ``auto``: a full fine-tune precomputes (nothing else avoids a second copy of the weights).
        Under LoRA the two give the same numbers (the adapter starts at zero, so the model with it
        switched off is the initial model) and each costs one reference forward per pair and
        pass, in the step or all before the first step (each rank a share of it). A run of one
        pass pays the same either way, and the step's reference starts training at once; a run
        of several passes (``num_epochs`` above 1) computes it once instead of every pass, so it
        precomputes. With ``max_steps`` the passes are not known before the data is: the step's
        reference stays."""
        t = self.training
        if t.objective in ("sft", "orpo"):
            return None
        if t.preference.reference != "auto":
            return t.preference.reference
        if not self.adapter.is_lora:
            return "precomputed"
        return "precomputed" if t.num_epochs is not None and t.num_epochs > 1 else "adapter_disabled"

    @property
    def tokens_per_step(self) -> int:
        """Upper bound on tokens in one optimizer step (all micro-batches, full length)."""
        return self.training.samples_per_step * self.data.sequence_len
