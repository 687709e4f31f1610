"""Tiny targets and a tiny tokenizer, built locally from configs with seeded weights.

Tests and the ``tiny`` recipe use them: no download, seconds to build, and the same code paths
as the real models (Qwen3 dense / MoE, Llama 3, Qwen3.5 hybrid with GatedDeltaNet layers, and
the Qwen3.5 multimodal checkpoint whose text tower is the target; GLM 4.x MoE, Qwen3-Next,
DeepSeek-V3 and the Kimi K2.5 multimodal checkpoint, ``MOE_FAMILY_ARCHS``; gpt-oss and Gemma 4,
``FAMILY_ARCHS``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from transformers import (AutoConfig, AutoModelForCausalLM, Gemma4Config, Gemma4ForConditionalGeneration,
                          Gemma4TextConfig, GptOssConfig, Kimi_K25ForConditionalGeneration, LlamaConfig,
                          PreTrainedTokenizerFast, Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeTextConfig,
                          Qwen3_5TextConfig, Qwen3Config, Qwen3MoeConfig)

# Byte-level vocabulary: the 256 byte symbols, then the specials. Ids past the tokenizer's
# length are spare embedding rows (where the mask token goes).
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                  "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
TINY_VOCAB = 288  # 256 bytes + 9 specials + spare rows

# ChatML with Qwen3-style thinking: ``enable_thinking=False`` renders an empty think block
# after the generation prompt, assistant ``reasoning_content`` renders inside <think>.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message.role == 'assistant' %}"
    "<|im_start|>assistant\n"
    "{% if message.reasoning_content is defined and message.reasoning_content %}"
    "<think>\n{{ message.reasoning_content }}\n</think>\n\n"
    "{% endif %}"
    "{{ message.content }}<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)

LLAMA3_TEMPLATE = (
    "<|begin_of_text|>"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# --- gpt-oss and Gemma 4 (issue 46): tiny chat templates of their formats (ours, written from the formats'
# facts) and tiny configs with every layer kind the loops meet.
#
# Harmony-like (gpt-oss): a system turn with the current date (``strftime_now``, which draftsmith pins: see
# ``data.chat.render``) and the reasoning effort; reasoning in the message's ``thinking`` field, rendered as an
# analysis channel on the last assistant turn only; the last turn ends with <|return|>, earlier ones <|end|>.
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>You are a tiny model.\nCurrent date: {{ strftime_now('%Y-%m-%d') }}\n\n"
    "Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' %}"
    "{% if loop.last and message.thinking is defined and message.thinking %}"
    "<|start|>assistant<|channel|>analysis<|message|>{{ message.thinking }}<|end|>"
    "{% endif %}"
    "<|start|>assistant<|channel|>final<|message|>{{ message.content }}"
    "{% if loop.last and not add_generation_prompt %}<|return|>{% else %}<|end|>{% endif %}"
    "{% else %}"
    "<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
# Gemma-4-like: <|turn>role ... <turn|> turns, the model's role named "model", thoughts from ``thinking`` in a
# thought channel (earlier turns' dropped), and an empty thought channel in the prompt when thinking is off.
GEMMA_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message.role == 'assistant' %}<|turn>model\n"
    "{% if loop.last and message.thinking is defined and message.thinking %}"
    "<|channel>thought\n{{ message.thinking }}<channel|>{% endif %}"
    "{{ message.content }}<turn|>\n"
    "{% else %}<|turn>{{ message.role }}\n{{ message.content }}<turn|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n"
    "{% if enable_thinking is defined and not enable_thinking %}<|channel>thought\n<channel|>{% endif %}"
    "{% endif %}"
)
# template -> (its control tokens, its own mask token)
FAMILY_TEMPLATES = {
    "harmony": (["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>"], None),
    "gemma": (["<|turn>", "<turn|>", "<|channel>", "<channel|>"], "<mask>"),
}
TINY_TEMPLATES = ("chatml", "llama3", *FAMILY_TEMPLATES)
FAMILY_ARCHS = ("gpt_oss", "gemma4_text", "gemma4", "gemma4_e")


def default_template(arch: str) -> str:
    """The tiny chat template an architecture's folder is saved with."""
    return {"llama": "llama3", "gpt_oss": "harmony"}.get(arch, "gemma" if arch.startswith("gemma4") else "chatml")


def family_config(arch: str, vocab_size: int, num_layers: int):
    """Tiny gpt-oss / Gemma 4 configs: every layer kind of the real models, sliding windows of 8 tokens (real:
    128, 512 / 1024) so a 20-token prompt crosses them.

    ``gpt_oss``: alternating sliding / full layers, learned attention sinks, MoE in every layer, q/k/v/o biases,
    YaRN RoPE with ``truncate: false`` (gpt-oss-20b's block). ``gemma4_text``: the 31B layout (sliding : full
    2 : 1, last layer full; full layers with their own head size and K == V; proportional partial RoPE on full
    layers; logits soft-capped at 30; tied embeddings scaled by sqrt(hidden)). ``gemma4``: the multimodal
    checkpoint (a one-layer vision tower) whose text tower is the 26B-A4B layout (a MoE block beside the dense
    MLP in every layer). ``gemma4_e``: the E2B / E4B layout (per-layer input embeddings, the last two layers
    reading the K/V of earlier ones, double-wide MLP there).
    """
    common = dict(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, initializer_range=0.1, bos_token_id=256, eos_token_id=258,
                  pad_token_id=256)
    if arch == "gpt_oss":
        return GptOssConfig(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                            layer_types=["sliding_attention", "full_attention"] * (num_layers // 2)
                            + ["sliding_attention"] * (num_layers % 2), max_position_embeddings=131072,
                            tie_word_embeddings=False, rms_norm_eps=1e-5,
                            rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                             "truncate": False, "original_max_position_embeddings": 4096,
                                             "rope_theta": 150000.0}, **common)
    layer_types = ["full_attention" if (i + 1) % 3 == 0 or i == num_layers - 1 else "sliding_attention"
                   for i in range(num_layers)]
    text = dict(intermediate_size=128, layer_types=layer_types, sliding_window=8, final_logit_softcapping=30.0,
                tie_word_embeddings=True, max_position_embeddings=4096, global_head_dim=32,
                num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=0,
                vocab_size_per_layer_input=vocab_size, num_kv_shared_layers=0, **common,
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                    "rope_theta": 1000000.0}})
    if arch == "gemma4_text":
        return Gemma4TextConfig(**text)
    if arch == "gemma4_e":
        return Gemma4TextConfig(**{**text, "attention_k_eq_v": False, "num_global_key_value_heads": None,
                                   "hidden_size_per_layer_input": 8, "num_kv_shared_layers": 2,
                                   "use_double_wide_mlp": True})
    moe = Gemma4TextConfig(**text, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2, position_embedding_size=64)
    v = vocab_size
    return Gemma4Config(text_config=moe.to_dict(), vision_config=vision, audio_config=None, tie_word_embeddings=True,
                        image_token_id=v - 1, video_token_id=v - 2, boi_token_id=v - 3, eoi_token_id=v - 4,
                        boa_token_id=v - 5, eoa_token_id=v - 6, eoa_token_index=v - 6, audio_token_id=v - 7)


def tiny_tokenizer(template: str = "chatml", reserved: int = 0, mask_token: str | None = None):
    """A byte-level tokenizer (one token per byte) with ChatML (default), Llama 3, harmony-like (gpt-oss) or
    Gemma-4-like chat template (``TINY_TEMPLATES``; the last two add their control tokens after the fixed ones,
    and the Gemma one its own ``<mask>`` token, as Gemma 4's tokenizer has).

    ``reserved``: that many ``<|reserved_special_token_i|>`` specials after the fixed ones (Llama 3
    style; ``reserved=TINY_VOCAB - 265`` leaves no spare embedding row). ``mask_token``: an extra
    special token set as the tokenizer's mask token (e.g. ``"<|mask|>"``).
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)  # ids 256.. in list order
    if template in FAMILY_TEMPLATES:
        controls, family_mask = FAMILY_TEMPLATES[template]
        mask_token = mask_token or family_mask
    else:
        controls = []
    extra = (controls + [f"<|reserved_special_token_{i}|>" for i in range(reserved)]
             + ([mask_token] if mask_token else []))
    if extra:
        tok.add_special_tokens(extra)  # ids 265.. after the fixed specials
    if template == "chatml":
        eos, chat_template = "<|im_end|>", CHATML_TEMPLATE
    elif template == "llama3":
        eos, chat_template = "<|eot_id|>", LLAMA3_TEMPLATE
    elif template == "harmony":
        eos, chat_template = "<|return|>", HARMONY_TEMPLATE
    elif template == "gemma":
        eos, chat_template = "<turn|>", GEMMA_TEMPLATE
    else:
        raise ValueError(f"unknown tiny template {template!r}: use one of {', '.join(TINY_TEMPLATES)}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token="<|endoftext|>",
                                   **({"mask_token": mask_token} if mask_token else {}))
    assert [fast.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(256, 256 + len(SPECIAL_TOKENS))), \
        "tiny tokenizer special ids moved"
    fast.chat_template = chat_template
    return fast


def tiny_config(arch: str, vocab_size: int, num_layers: int):
    """The transformers config of a tiny target (no weights): what the builders below and the dry-run plan use."""
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.1,
                  bos_token_id=256, eos_token_id=258, pad_token_id=256)
    if arch == "qwen3":
        return Qwen3Config(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **common)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                              decoder_sparse_step=1, norm_topk_prob=True,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **common)
    if arch == "llama":
        return LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, **common)
    if arch in ("qwen3_5", "qwen3_5_vl", "qwen3_5_moe"):
        layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]
        hybrid = dict(layer_types=layer_types, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_value_head_dim=16,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
        if arch == "qwen3_5_moe":
            return Qwen3_5MoeTextConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                        shared_expert_intermediate_size=48, **hybrid, **common)
        text = Qwen3_5TextConfig(**hybrid, **common)
        if arch == "qwen3_5":
            return text
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      patch_size=4, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
        return Qwen3_5Config(text_config=text.to_dict(), vision_config=vision, tie_word_embeddings=False,
                             image_token_id=TINY_VOCAB - 1, video_token_id=TINY_VOCAB - 2)
    if arch in MOE_FAMILY_ARCHS:
        return moe_family_config(arch, common)
    if arch in FAMILY_ARCHS:  # gpt-oss / Gemma 4
        return family_config(arch, vocab_size, num_layers)
    raise ValueError(f"unknown tiny architecture {arch!r}: use one of {TINY_ARCHS}")


# ----------------------------------------------------------------------------- GLM 4.x MoE, Qwen3-Next, DeepSeek-V3 /
# Kimi K2.5 (issue 46). Each exercises what is new in its family: GLM's shared expert, q/k/v biases, qk-norm and
# partial rotary (0.5); Qwen3-Next's fused GatedDeltaNet projections (3 linear : 1 full layers, as mlx_lm's
# full_attention_interval 4 assumes) and sparse MoE with a gated shared expert in every layer; DeepSeek-V3's latent
# attention (MLA: q/kv low-rank, a 16-wide latent cache), grouped routing (2 groups) and YaRN RoPE; Kimi K2.5 is
# the multimodal checkpoint whose text tower is that DeepSeek-V3 model.
MOE_FAMILY_ARCHS = ("glm4_moe", "qwen3_next", "deepseek_v3", "kimi_k25")


def moe_family_config(arch: str, common: dict):
    """The transformers config of a tiny GLM 4.x MoE / Qwen3-Next / DeepSeek-V3 / Kimi K2.5 target."""
    n = common["num_hidden_layers"]
    moe = dict(moe_intermediate_size=32, num_experts_per_tok=2, norm_topk_prob=True)
    if arch == "glm4_moe":
        return AutoConfig.for_model("glm4_moe", **common, **moe, attention_bias=True, use_qk_norm=True,
                                    n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                                    topk_group=1, routed_scaling_factor=1.0,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                                     "partial_rotary_factor": 0.5})
    if arch == "qwen3_next":
        layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
        return AutoConfig.for_model("qwen3_next", **common, **moe, layer_types=layer_types, linear_conv_kernel_dim=4,
                                    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                                    linear_num_value_heads=4, num_experts=4, shared_expert_intermediate_size=32,
                                    decoder_sparse_step=1, mlp_only_layers=[],
                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                     "partial_rotary_factor": 0.25})
    mla = {**common, **moe, "num_key_value_heads": common["num_attention_heads"], "max_position_embeddings": 163840}
    del mla["head_dim"]  # DeepSeek-V3's config sets it to the rope width itself
    text = AutoConfig.for_model("deepseek_v3", **mla, n_shared_experts=1, n_routed_experts=8, n_group=2, topk_group=1,
                                first_k_dense_replace=1, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24,
                                qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, rope_interleave=True,
                                rope_parameters={"rope_type": "yarn", "factor": 40.0, "rope_theta": 10000.0,
                                                 "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    if arch == "deepseek_v3":
        return text
    vision = dict(patch_size=4, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2, num_attention_heads=2,
                  num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    return AutoConfig.for_model("kimi_k25", text_config=text.to_dict(), vision_config=vision, projection_hidden_size=32,
                                image_token_id=TINY_VOCAB - 1, video_token_id=TINY_VOCAB - 2,
                                vision_start_token_id=TINY_VOCAB - 3, vision_end_token_id=TINY_VOCAB - 4,
                                tie_word_embeddings=False)


def kimi_checkpoint_layout(directory: Path) -> None:
    """Rename a Kimi K2.5 folder written by transformers' ``save_pretrained`` to the layout Moonshot ships (and
    mlx_lm reads): transformers 5.24 writes the text layers as ``language_model.model.blocks.N`` and the projector
    under ``model.mm_projector``; the published checkpoint has ``language_model.model.layers.N`` and
    ``mm_projector``."""
    from safetensors.torch import load_file, save_file

    for shard in sorted(Path(directory).glob("*.safetensors")):
        weights = load_file(str(shard))
        renamed = {k.replace("language_model.model.blocks.", "language_model.model.layers.")
                   .replace("model.mm_projector.", "mm_projector."): v for k, v in weights.items()}
        save_file(renamed, str(shard), metadata={"format": "pt"})
    index = Path(directory) / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {k.replace("language_model.model.blocks.", "language_model.model.layers.")
                              .replace("model.mm_projector.", "mm_projector."): v
                              for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=2))


TINY_ARCHS = ("qwen3", "qwen3_moe", "llama", "qwen3_5", "qwen3_5_moe", "qwen3_5_vl", *MOE_FAMILY_ARCHS,
              *FAMILY_ARCHS)
HYBRID_ARCHS = ("qwen3_5", "qwen3_5_moe", "qwen3_5_vl", "qwen3_next")  # GatedDeltaNet + attention layers


def tiny_target(arch: str = "qwen3", seed: int = 0, num_layers: int = 8, vocab_size: int = TINY_VOCAB,
                dtype: torch.dtype = torch.float32):
    """A tiny causal LM of the given architecture with seeded random weights (fp32, eval mode)."""
    config = tiny_config(arch, vocab_size, num_layers)
    torch.manual_seed(seed)
    if arch in ("qwen3_5_vl", "kimi_k25"):  # multimodal checkpoints: AutoModelForCausalLM builds no vision tower
        cls = Qwen3_5ForConditionalGeneration if arch == "qwen3_5_vl" else Kimi_K25ForConditionalGeneration
        model = cls._from_config(config, dtype=dtype)
    elif arch == "gemma4":
        model = Gemma4ForConditionalGeneration._from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def save_tiny_target(directory: str | Path, arch: str = "qwen3", seed: int = 0, num_layers: int = 8,
                     template: str | None = None, max_shard_size: str | None = None) -> Path:
    """Write a tiny target as a folder laid out like a Hub repo (config, safetensors, tokenizer);
    ``max_shard_size`` (e.g. "200KB") shards it with an index, as large Hub checkpoints are."""
    directory = Path(directory)
    model = tiny_target(arch, seed=seed, num_layers=num_layers)
    model.save_pretrained(directory, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if arch == "kimi_k25":
        kimi_checkpoint_layout(directory)
    tok = tiny_tokenizer(template or default_template(arch))
    tok.save_pretrained(directory)
    gen = {"eos_token_id": tok.eos_token_id, "bos_token_id": 256, "do_sample": False}
    (directory / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return directory
