"""Model shape presets for `make-model` (kept free of torch so the CLI parser loads fast)."""

from __future__ import annotations

from typing import Any

TOKENIZER_VOCAB = 512

_TINY = dict(
    hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=TOKENIZER_VOCAB, max_position_embeddings=1024,
    rms_norm_eps=1e-6, rope_theta=10000.0, torch_dtype="float32",
)
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {**_TINY, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
             "tie_word_embeddings": False,
             "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 256}},
    "tiny-qwen2": {**_TINY, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                   "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": None},
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    },
    "llama-3.1-8b": {  # the larger shape of the tensor-parallel benchmark (8.0B parameters)
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    },
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "use_sliding_window": False, "sliding_window": None,
    },
}
