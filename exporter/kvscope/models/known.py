"""KV-cache facts of a few well-known models, as their Hugging Face ``config.json`` states
them: what the twin needs to lay out their KV cache (no weights, nothing downloaded).

Each entry is the subset of config.json keys ``kv_layout.from_config`` reads; the comment
above it names the file the facts come from. A model not listed here: give its own
``config.json`` (``kvscope whatif --model PATH``).
"""

from __future__ import annotations

from typing import Any

KNOWN: dict[str, dict[str, Any]] = {
    # huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json
    "Llama-3-8B": {"num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "hidden_size": 4096,
                   "max_position_embeddings": 8192, "torch_dtype": "bfloat16"},
    # huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json
    "Llama-3.1-8B": {"num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "hidden_size": 4096,
                     "max_position_embeddings": 131072, "torch_dtype": "bfloat16"},
    # huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json (every layer slides)
    "Mistral-7B-v0.1": {"num_hidden_layers": 32, "num_attention_heads": 32,
                        "num_key_value_heads": 8, "hidden_size": 4096,
                        "sliding_window": 4096, "max_position_embeddings": 32768,
                        "torch_dtype": "bfloat16"},
    # huggingface.co/mistralai/Mistral-7B-Instruct-v0.3/blob/main/config.json
    "Mistral-7B-v0.3": {"num_hidden_layers": 32, "num_attention_heads": 32,
                        "num_key_value_heads": 8, "hidden_size": 4096, "head_dim": 128,
                        "sliding_window": None, "max_position_embeddings": 32768,
                        "torch_dtype": "bfloat16"},
    # huggingface.co/Qwen/Qwen2.5-7B-Instruct/blob/main/config.json (use_sliding_window
    # false: full attention in every layer)
    "Qwen2.5-7B": {"num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "hidden_size": 3584,
                   "use_sliding_window": False, "sliding_window": 131072,
                   "max_position_embeddings": 32768, "torch_dtype": "bfloat16"},
    # huggingface.co/google/gemma-3-12b-it/blob/main/config.json, its text_config:
    # 5 sliding-window layers to 1 full-attention layer
    "Gemma-3-12B": {"num_hidden_layers": 48, "num_attention_heads": 16,
                    "num_key_value_heads": 8, "head_dim": 256, "hidden_size": 3840,
                    "sliding_window": 1024, "sliding_window_pattern": 6,
                    "max_position_embeddings": 131072, "torch_dtype": "bfloat16"},
    # huggingface.co/google/gemma-3-27b-it/blob/main/config.json, its text_config
    "Gemma-3-27B": {"num_hidden_layers": 62, "num_attention_heads": 32,
                    "num_key_value_heads": 16, "head_dim": 128, "hidden_size": 5376,
                    "sliding_window": 1024, "sliding_window_pattern": 6,
                    "max_position_embeddings": 131072, "torch_dtype": "bfloat16"},
}
