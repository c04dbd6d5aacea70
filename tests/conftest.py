"""Shared test fixtures: a tiny random-weight Llama with an offline-trained tokenizer and a head.

Everything is built in a temporary folder, without downloads. Add fixtures here; don't remove
any (several test files share this module).
"""
from __future__ import annotations

import os

import pytest

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens with a small head and verifies them with the target model.",
    "def add(a, b):\n    return a + b\n",
    "Write a short poem about the sea. The sea is blue and deep and wide.",
    "Hello! How are you today? I am fine, thank you.",
    "1 2 3 4 5 6 7 8 9 10, counting numbers is easy.",
]


def build_tiny_tokenizer(folder: str, vocab_size: int = 320):
    """A byte-level BPE tokenizer trained in-process on a few sentences, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TINY_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = TINY_CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def build_tiny_model(folder: str, max_position_embeddings: int = 256, seed: int = 0):
    """Save a 2-layer random Llama (hidden 64) plus tokenizer to `folder`; returns the config."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    os.makedirs(folder, exist_ok=True)
    tok = build_tiny_tokenizer(folder)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(folder)
    return cfg


def build_tiny_head(folder: str, target_config, seed: int = 1) -> None:
    import torch

    from eagle2_core.head import DraftHead, HeadSpec

    torch.manual_seed(seed)
    DraftHead(HeadSpec.for_target(target_config)).save(folder)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """Folder with a tiny random Llama and its tokenizer (chat template included)."""
    folder = str(tmp_path_factory.mktemp("tiny") / "model")
    build_tiny_model(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_head_dir(tiny_model_dir, tmp_path_factory) -> str:
    """Folder with a random EAGLE head shaped for `tiny_model_dir`."""
    from transformers import AutoConfig

    folder = str(tmp_path_factory.mktemp("tiny_head") / "head")
    build_tiny_head(folder, AutoConfig.from_pretrained(tiny_model_dir))
    return folder


@pytest.fixture(scope="session")
def tiny_target(tiny_model_dir):
    """The tiny model loaded through `load_target` (float32, CPU); shared, don't mutate."""
    from eagle2_core.loading import load_target

    return load_target(tiny_model_dir, dtype="float32", device="cpu")
