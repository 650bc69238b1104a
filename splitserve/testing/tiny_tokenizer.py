"""A tiny byte-level BPE tokenizer built locally, for test checkpoints that must never hit a hub.

The tokenizer is trained from an embedded corpus so that it looks like a real BPE (multi-byte
merges, varied token lengths) while staying deterministic and small (~512 tokens). Byte-level
pre-tokenisation and decoding mean every unicode string round-trips exactly.

One wrinkle: transformers 5 loads any checkpoint whose model_type is "qwen2" with its own
``Qwen2Tokenizer``, which keeps our vocab and merges but imposes Qwen2's NFC normaliser and split
regex. ``build_tokenizer(qwen2_pipeline=True)`` writes that same pipeline into tokenizer.json, so
the raw file and ``AutoTokenizer`` agree (as they do for real Qwen2 checkpoints); the price is
that such a tokenizer round-trips NFC-normalised text only.
"""

from __future__ import annotations

import json
import os
import pathlib

from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# Trainer order fixes the ids: bos=0, eos=1, pad=2, im_start=3, im_end=4.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
TARGET_VOCAB_SIZE = 512
# Verbatim from transformers' Qwen2Tokenizer (and real Qwen2 tokenizer.json files).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# ChatML that renders tools the way Qwen2.5's template does (Hermes `<tool_call>` tags): the
# tools in the system message, an assistant's calls as tags, tool results as `tool` turns.
HERMES_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Function signatures are within "
    "<tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each call, return a JSON object with the function name and "
    "arguments within <tool_call></tool_call> tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for call in message.tool_calls %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' }}"
    "{{- (fn.arguments if fn.arguments is string else fn.arguments | tojson)"
    " + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A serving engine reads a prompt, splits it into
tokens, and runs the model one step at a time until it sees the end of the sequence. Each step
produces a distribution over the vocabulary, and greedy decoding simply takes the most likely
token. When many requests arrive together, the scheduler batches them so that the accelerator
stays busy; prefill processes the whole prompt at once, while decode adds a single token per
request per step. The key and value tensors of earlier positions are kept in a paged cache, so
memory can be shared, reused, and freed without copying large contiguous buffers around.

It was a bright cold day in April, and the clocks were striking thirteen. She walked along the
river, past the old mill and the bakery on the corner, where the smell of fresh bread drifted
into the street. "Good morning!" said the baker. "Would you like a croissant, or a coffee?"
She smiled, paid three euros and forty cents, and sat down at the small table by the window.
In the café, a naïve tourist asked for a crème brûlée at nine o'clock in the morning; the
waiter shrugged and brought it anyway. Über-fast trains connect the cities; the façade of the
station is being restored. 日本語のテキストも少し含めます。東京は大きな都市です。
Emoji appear in chat logs too: 🙂 👍 🚀 ❤️ ✨ — and so do arrows → ← and symbols like ± × ÷ ≤ ≥.

Numbers matter: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 512 1024 2048 4096 65536, pi is about
3.14159, e is about 2.71828, and the year 2024 had 366 days. Version 1.2.3 was released on
2023-11-05 at 14:30:00 UTC; the build took 17.5 seconds and used 8 GiB of memory (about 60%).
Call +1-555-0100 or write to support@example.com; see https://example.org/docs?page=2&lang=en.

def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    result = [0, 1]
    while len(result) < n:
        result.append(result[-1] + result[-2])
    return result[:n]


class Cache:
    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        self.free = list(range(num_blocks))
        self.block_size = block_size

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free):
            raise MemoryError(f"need {count} blocks, have {len(self.free)}")
        blocks, self.free = self.free[:count], self.free[count:]
        return blocks


for i in range(10):
    if i % 2 == 0:
        print(f"{i} is even")
    else:
        print(f"{i} is odd")

int main(void) {
    int total = 0;
    for (int i = 0; i < 100; ++i) { total += i * i; }
    printf("%d\\n", total);
    return 0;
}

const add = (a, b) => a + b; // returns the sum
let items = {"name": "tiny", "size": 64, "tags": ["test", "model"], "ok": true, "x": null};
SELECT id, name FROM users WHERE age >= 18 ORDER BY name LIMIT 10;
$ pip install -e . && python -m pytest -q tests/unit

Questions and answers. What is the capital of France? The capital of France is Paris. How many
legs does a spider have? A spider has eight legs. Why is the sky blue? Sunlight is scattered by
the air, and blue light is scattered more than red light. Can you write a poem? Roses are red,
violets are blue, tokens are cheap, and so is the queue. Thank you! You're welcome; have a nice
day. Please summarise the following text in one sentence, then list three key points.
<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
Hello! Can you help me with my code?<|im_end|>
<|im_start|>assistant
Of course. Please share the code and describe what it should do.<|im_end|>
"""


def build_tokenizer(*, qwen2_pipeline: bool = False, add_bos: bool = False) -> Tokenizer:
    """Train the tiny byte-level BPE on the embedded corpus and return it.

    Training is deterministic: the trainer breaks count ties by token id, and the initial
    alphabet (all 256 byte symbols) is fixed, so every call yields identical merges. With
    ``qwen2_pipeline`` the trained vocab and merges are kept but the normaliser and pre-tokeniser
    are swapped for the ones transformers forces on Qwen2 checkpoints (see the module docstring).
    With ``add_bos`` encoding adds BOS in front, as Llama and Mistral tokenizer.json files do.
    """
    tokenizer = Tokenizer(models.BPE())
    # No normaliser: any normalisation (NFC, lower-casing) would break exact round-tripping.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    if add_bos:
        tokenizer.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{BOS_TOKEN} $A",
                    pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
                    special_tokens=[(BOS_TOKEN, tokenizer.token_to_id(BOS_TOKEN))],
                ),
            ]
        )
    if qwen2_pipeline:
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return tokenizer


def _write_json(path: pathlib.Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def write_tokenizer_files(
    out_dir: str | os.PathLike,
    tokenizer: Tokenizer,
    *,
    model_max_length: int,
    add_bos: bool = False,
    chat_template: str | None = CHATML_TEMPLATE,
) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into out_dir.

    The files load with ``transformers.AutoTokenizer`` as a ``PreTrainedTokenizerFast`` that adds
    BOS only with ``add_bos`` (a tokenizer built with it) and carries ``chat_template`` (ChatML
    unless told otherwise; None writes none).
    """
    out = pathlib.Path(out_dir)
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n")
    extra = [IM_START_TOKEN, IM_END_TOKEN]
    added_tokens_decoder = {
        str(tokenizer.token_to_id(tok)): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for tok in SPECIAL_TOKENS
    }
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            # Explicitly none: otherwise Qwen2Tokenizer adds a default "<|endoftext|>" unk token
            # and len(tokenizer) would exceed the model's vocab_size.
            "unk_token": None,
            "additional_special_tokens": extra,
            "added_tokens_decoder": added_tokens_decoder,
            "add_bos_token": add_bos,
            "add_eos_token": False,
            # Cleaning spaces (" ." -> ".") would break decode(encode(text)) == text.
            "clean_up_tokenization_spaces": False,
            "model_max_length": model_max_length,
            **({"chat_template": chat_template} if chat_template is not None else {}),
        },
    )
    _write_json(
        out / "special_tokens_map.json",
        {
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "additional_special_tokens": extra,
        },
    )
