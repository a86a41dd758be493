"""Fine-tuning data for the tests, built here: a small byte-level BPE tokenizer directory with special
tokens and a ChatML chat template (as Hugging Face saves one), and JSONL files of prompt/completion
and chat lines. Nothing is downloaded."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

BOS, EOS, PAD = "<|bos|>", "<|im_end|>", "<|pad|>"
SPECIAL = [BOS, EOS, PAD, "<|im_start|>", "<|endoftext|>"]
# ChatML, with transformers' {% generation %} markers around what the assistant says (for its assistant mask).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
WORDS = ["cat", "dog", "bird", "fish", "tree", "rock", "sun", "moon", "star", "cloud", "rain", "snow", "wind",
         "fire", "lake", "hill", "road", "door"]
SENTENCES = [
    "Repeat after me: the cat sat on the mat.", "What is the colour of the sky?", "The sky is blue.",
    "Name three animals.", "A cat, a dog and a bird.", "You are a helpful assistant.", "Hello! How are you?",
    *(f"{a} {b} {c}" for a, b, c in zip(WORDS, WORDS[3:], WORDS[7:], strict=False)),
]


def write_tokenizer(directory: Path, *, vocab_size: int = 400, config: dict[str, Any] | None = None,
                    post_processor_bos: bool = True) -> Path:
    """A tokenizer directory: tokenizer.json (byte-level BPE trained on SENTENCES and WORDS) and
    tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([*SENTENCES, " ".join(WORDS)] * 4, trainer)
    if post_processor_bos:  # as Llama 3's: tokenizer(text) starts with bos
        tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                           special_tokens=[(BOS, tok.token_to_id(BOS))])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    settings = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "chat_template": CHAT_TEMPLATE,
                "tokenizer_class": "PreTrainedTokenizerFast", **(config or {})}
    (directory / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in settings.items()
                                                                 if v is not None}))
    return directory


def write_jsonl(path: Path, lines: list[Any]) -> Path:
    """One line per item: a str as it is, anything else as JSON."""
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def copy_task(rng: random.Random, words: int) -> tuple[str, str]:
    """A learnable pair: repeat the words."""
    said = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"Repeat: {said}", said


def mixed_lines(n: int, seed: int = 0, max_words: int = 6) -> list[dict[str, Any]]:
    """n lines, alternately prompt/completion and chats of one or two assistant turns, of varied lengths."""
    rng = random.Random(seed)
    lines: list[dict[str, Any]] = []
    for i in range(n):
        prompt, completion = copy_task(rng, rng.randint(1, max_words))
        if i % 2 == 0:
            lines.append({"prompt": prompt, "completion": completion})
            continue
        messages = [{"role": "system", "content": "You are a helpful assistant."}] if i % 3 == 0 else []
        messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        if i % 4 == 1:
            again, answer = copy_task(rng, rng.randint(1, max_words))
            messages += [{"role": "user", "content": again}, {"role": "assistant", "content": answer}]
        lines.append({"messages": messages})
    return lines


def sft_data(directory: Path, lines: list[Any]) -> tuple[Path, Path]:
    """(the JSONL file, the tokenizer directory) under directory."""
    return write_jsonl(directory / "train.jsonl", lines), write_tokenizer(directory / "tokenizer")
