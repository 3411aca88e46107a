"""Word-level tokenizer of the testbed task (one word = one token), as a HF fast tokenizer."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from data_pipeline.testbed.task import BOS, EOS, PAD, UNK, VOCAB

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{{ '<bos> ' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}{{ ' <think> ' + message['content'] + ' <eos>' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ ' <think>' }}{%- endif -%}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The testbed tokenizer: WordLevel over :data:`VOCAB`, whitespace split, left padding.

    ``<think>``, ``</think>`` and ``;`` are ordinary tokens (kept by ``skip_special_tokens``);
    ``<pad>``, ``<unk>``, ``<bos>`` and ``<eos>`` are special.
    """
    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        model_max_length=8192,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
