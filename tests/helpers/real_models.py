"""The real models the suite builds: tiny configs in code (no downloads),
seeded, so every test that uses one builds the same weights.

Each builder skips its test when its framework (the ``models`` extra) is not
installed.  Shared by tests/models/test_models.py, tests/models/test_trust_models.py,
tests/models/test_artifacts_models.py and the trust sweep (tests/models/test_trust_sweep.py).
"""

from __future__ import annotations

import textwrap
from typing import Any

import pytest
import torch
from torch import nn

VOCAB = 128


def _transformers() -> Any:
    return pytest.importorskip("transformers")


def _diffusers() -> Any:
    return pytest.importorskip("diffusers")


# -- transformers ---------------------------------------------------------------------

def llama() -> nn.Module:
    transformers = _transformers()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval()


def mistral() -> nn.Module:
    transformers = _transformers()
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        sliding_window=None)
    return transformers.MistralForCausalLM(config).eval()


def gpt2() -> nn.Module:
    transformers = _transformers()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2,
                                     n_head=4, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def fresh_head(arch: str, low: int) -> str:
    """The head of a fresh-process script: the tiny decoder ``arch``
    (``"Qwen2"``, ``"Llama"``: ``qwen2()``'s and ``llama()``'s config, seed 0)
    and a 5-token prompt of ids from ``low``, built as the tests build them."""
    return textwrap.dedent(f"""
        import json, sys, warnings
        warnings.filterwarnings("ignore")
        import torch, transformers, ctxreplay
        config = transformers.{arch}Config(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        torch.manual_seed(0)
        model = transformers.{arch}ForCausalLM(config).eval()
        prompt = torch.randint({low}, 128, (1, 5), generator=torch.Generator().manual_seed(1))
    """)


#: the tiny Qwen2 of the generate() tests and their prompt
QWEN2_FRESH = fresh_head("Qwen2", 0)


def qwen2() -> nn.Module:
    transformers = _transformers()
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.Qwen2ForCausalLM(config).eval()


def qwen3() -> tuple[nn.Module, Any]:
    """The model and its config (a cache is built from the config)."""
    transformers = _transformers()
    if not hasattr(transformers, "Qwen3ForCausalLM"):
        pytest.skip("this transformers has no Qwen3")
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(config).eval(), config


def t5() -> nn.Module:
    transformers = _transformers()
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu", decoder_start_token_id=0)
    return transformers.T5Model(config).eval()


def whisper() -> nn.Module:
    transformers = _transformers()
    config = transformers.WhisperConfig(
        vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16, max_target_positions=32,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    torch.manual_seed(0)
    return transformers.WhisperForConditionalGeneration(config).eval()


# -- diffusers ------------------------------------------------------------------------

def unet2d_condition() -> nn.Module:
    diffusers = _diffusers()
    torch.manual_seed(0)
    return diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
        attention_head_dim=8, norm_num_groups=8).eval()


def flux() -> nn.Module:
    diffusers = _diffusers()
    torch.manual_seed(0)
    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=16,
        guidance_embeds=False, axes_dims_rope=(2, 2, 4)).eval()


def dit() -> nn.Module:
    diffusers = _diffusers()
    torch.manual_seed(0)
    return diffusers.DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=2,
        sample_size=8, patch_size=2, num_embeds_ada_norm=10, norm_num_groups=2).eval()


def wan(num_layers: int = 3) -> nn.Module:
    diffusers = _diffusers()
    torch.manual_seed(0)
    return diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=num_layers,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32).eval()


def cogvideox() -> nn.Module:
    diffusers = _diffusers()
    torch.manual_seed(0)
    return diffusers.CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        time_embed_dim=8, text_embed_dim=16, num_layers=2, sample_width=8, sample_height=8,
        sample_frames=5, patch_size=2, temporal_compression_ratio=4,
        max_text_seq_length=4).eval()
