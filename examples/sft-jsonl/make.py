"""Write the tiny fine-tuning set of examples/sft-jsonl.yaml: train.jsonl and tokenizer/.

    python examples/sft-jsonl/make.py        # needs the tokenizers package (the trainer image has it)

train.jsonl: 48 lines, half prompt/completion pairs, half chats (a system prompt, one or two user and
assistant turns), teaching two small skills, adding two numbers and reversing a word. tokenizer/: a
byte-level BPE of 512 tokens trained on those lines, with the special tokens and ChatML template of
a Hugging Face chat model (tokenizer.json, tokenizer_config.json), as save_pretrained writes them. With
your own model, point spec.data.tokenizer at its Hugging Face directory instead.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HERE = Path(__file__).resolve().parent
WORDS = ["cat", "dog", "tree", "moon", "river", "stone", "cloud", "apple", "house", "train", "paper", "light"]
SPECIAL = ["<|begin_of_text|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def task(rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.5:
        a, b = rng.randint(1, 49), rng.randint(1, 49)
        return f"What is {a} + {b}?", f"{a} + {b} = {a + b}."
    word = rng.choice(WORDS)
    return f"Reverse the word '{word}'.", f"'{word}' reversed is '{word[::-1]}'."


def lines(n: int = 48, seed: int = 0) -> list[dict[str, object]]:
    rng = random.Random(seed)
    out: list[dict[str, object]] = []
    for i in range(n):
        prompt, answer = task(rng)
        if i % 2 == 0:
            out.append({"prompt": f"Question: {prompt}\nAnswer: ", "completion": answer})
            continue
        messages = [{"role": "system", "content": "You are a careful assistant."},
                    {"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        if i % 4 == 3:
            prompt, answer = task(rng)
            messages += [{"role": "user", "content": f"And: {prompt}"}, {"role": "assistant", "content": answer}]
        out.append({"messages": messages})
    return out


def main() -> None:
    data = lines()
    (HERE / "train.jsonl").write_text("".join(json.dumps(line) + "\n" for line in data))
    texts = [json.dumps(line) for line in data]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIAL,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos = SPECIAL[0]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, tok.token_to_id(bos))])
    out = HERE / "tokenizer"
    out.mkdir(exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"bos_token": bos, "eos_token": "<|im_end|>", "pad_token": "<|pad|>", "add_bos_token": True,
              "chat_template": CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 256}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    main()
