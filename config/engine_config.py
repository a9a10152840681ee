"""Typed configuration for the engine: model geometry, KV cache, scheduler limits.

Every model is frozen with extra="forbid", so a typo or an out-of-range value fails at load
with a pydantic error naming the field. Sampling parameters live in `sampling_params.py`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


def check_token_counts(v: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """A list of prefill token buckets (both workers' prefill_graph_sizes); None: the default."""
    if v is not None and (not v or any(s < 1 for s in v)):
        raise ValueError("must be a non-empty list of token counts >= 1 (e.g. 16,64,256)")
    return v


SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
DType = Literal["float32", "bfloat16", "float16"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RopeScaling(_Frozen):
    """RoPE frequency scaling; the types the engine implements (others are refused at load)."""

    rope_type: Literal["default", "linear", "llama3"] = "default"
    factor: float = Field(1.0, gt=0)
    low_freq_factor: float | None = Field(None, gt=0)
    high_freq_factor: float | None = Field(None, gt=0)
    original_max_position_embeddings: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _llama3_fields(self) -> RopeScaling:
        if self.rope_type == "llama3":
            missing = [
                f
                for f in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                if getattr(self, f) is None
            ]
            if missing:
                raise ValueError(
                    f"rope_scaling type 'llama3' needs {', '.join(missing)} in config.json"
                )
        return self


class ModelConfig(_Frozen):
    """The geometry and math switches of a decoder-only checkpoint (read from config.json)."""

    architecture: Literal[SUPPORTED_ARCHITECTURES]  # type: ignore[valid-type]
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    rms_norm_eps: float = Field(gt=0)
    rope_theta: float = Field(gt=0)
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = Field(gt=0)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    dtype: DType = "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        return self

    def check_tensor_parallel(self, tp: int) -> None:
        """Raises ValueError (one line naming the field) when the model cannot split over `tp` ranks."""
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            if getattr(self, name) % tp:
                raise ValueError(
                    f"parallel.tensor_parallel_size {tp} does not divide the model's {name} "
                    f"({getattr(self, name)}); pick a tensor_parallel_size that divides it"
                )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


class CacheConfig(_Frozen):
    """Paged KV pool. block_size 16 (vLLM's default): fine-grained prefix reuse and little
    waste per sequence; kernels gather tokens by slot, so larger blocks buy them little."""

    block_size: int = Field(16, ge=1, le=1024)
    num_blocks: int | None = Field(
        None, ge=2, description="explicit pool size; None sizes from memory"
    )
    memory_fraction: float = Field(
        0.85, gt=0, le=0.98, description="share of free device memory for the pool"
    )
    cpu_num_blocks: int = Field(512, ge=2, description="pool size on CPU when num_blocks is None")

    @model_validator(mode="after")
    def _power_of_two(self) -> CacheConfig:
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        return self


class SchedulerConfig(_Frozen):
    max_model_len: int | None = Field(
        None, gt=0, description="None: the model's max_position_embeddings"
    )
    max_num_batched_tokens: int = Field(8192, gt=0, description="prefill token budget per step")
    max_batch_size: int = Field(256, gt=0, description="sequences decoded per step")
    max_queue_len: int = Field(1024, gt=0, description="waiting requests before RESOURCE_EXHAUSTED")


class ParallelConfig(_Frozen):
    """Tensor parallelism inside one worker: heads and MLP columns split over ranks (one process
    per rank, NCCL on CUDA, gloo on CPU). The model's num_attention_heads, num_key_value_heads and
    intermediate_size must divide by it (checked at load; KV heads are not replicated)."""

    tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="ranks (processes, one GPU each) per worker"
    )


class EngineConfig(_Frozen):
    model_path: str
    device: str = "auto"
    dtype: DType | Literal["auto"] = "auto"
    seed: int = 0
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    stall_timeout_s: float = Field(
        60.0,
        gt=0,
        description="health NOT_SERVING while work is queued and the engine "
        "has not finished a step for this long; SERVING again "
        "once it does (worker/stall_watch.py)",
    )
