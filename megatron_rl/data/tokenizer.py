"""A character-level tokenizer for the tiny CPU model, saved in HF form (tokenizer.json) next to a checkpoint
so that the trainer, the generators and `transformers` all load the same one."""

from __future__ import annotations

import string

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
DEFAULT_CHARS = string.digits + "+-*/=().,^ " + string.ascii_letters + "\\{}#:$"


def build_char_tokenizer(chars: str = DEFAULT_CHARS):
    """A `transformers.PreTrainedTokenizerFast` with one token per character (ids 0-3 are special)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    if len(set(chars)) != len(chars):
        raise ValueError("chars must not repeat")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({c: len(SPECIAL_TOKENS) + i for i, c in enumerate(chars)})
    # BPE without merges over a character vocabulary is exactly character-level tokenization.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)
