"""Fine-tuning data (data.source: jsonl) in one process: rendering and tokenization against transformers,
masking, padding and packing, layout independence and resume, and every bad input with its message."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tetrad_trainer.config import ConfigError, check_runnable
from tetrad_trainer.cp import shard_sequence
from tetrad_trainer.data import BatchLoader, build_source
from tetrad_trainer.loss import IGNORE_INDEX
from tetrad_trainer.sft import JsonlSource, Tokenized, next_fit, read_jsonl
from tetrad_trainer.tokenizer import load_tokenizer

from tests.trainer.harness import job
from tests.trainer.sft_data import CHAT_TEMPLATE, EOS, WORDS, mixed_lines, write_jsonl, write_tokenizer

SEQ = 64
PAIR = {"prompt": "Repeat: cat dog", "completion": "cat dog"}
CHAT = {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": "Repeat: sun moon"},
                     {"role": "assistant", "content": "sun moon"},
                     {"role": "user", "content": "Repeat: rain"}, {"role": "assistant", "content": "rain"}]}


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def hf(tokdir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tokdir))


def cfg_of(path: Path, tokenizer: Path, *, seq_len: int = SEQ, vocab: int | None = None, nproc: int = 1,
           parallelism: dict[str, Any] | None = None, **data: Any) -> Any:
    model = {"seqLen": seq_len, **({"vocab": vocab} if vocab else {})}
    return job(parallelism or {}, nproc=nproc, model=model, training={"globalBatch": 4, "seed": 3},
               data={"source": "jsonl", "path": str(path), "tokenizer": str(tokenizer), **data})


def source_of(tmp: Path, tokenizer: Path, lines: list[Any], notes: list[str] | None = None,
              **kw: Any) -> JsonlSource:
    source = build_source(cfg_of(write_jsonl(tmp / "train.jsonl", lines), tokenizer, **kw),
                          note=(notes.append if notes is not None else lambda _: None))
    assert isinstance(source, JsonlSource)
    return source


def samples(tmp: Path, tokenizer: Path, lines: list[Any], row: int = SEQ + 1, vocab: int = 2048,
            truncate: bool = False) -> Tokenized:
    data, _ = read_jsonl(write_jsonl(tmp / "train.jsonl", lines), load_tokenizer(str(tokenizer)), row, vocab,
                         truncate)
    return data


def sample_tokens(data: Tokenized, i: int) -> tuple[list[int], list[bool]]:
    part = slice(data.starts[i], data.starts[i + 1])
    return data.tokens[part].tolist(), data.trains[part].tolist()


# -- what a sample is, checked against transformers ------------------------------------------------

def test_a_pair_is_the_prompt_then_the_learned_completion_and_eos(tmp_path: Path, tokdir: Path,
                                                                  hf: Any) -> None:
    tokens, trains = sample_tokens(samples(tmp_path, tokdir, [PAIR]), 0)
    prompt = hf(PAIR["prompt"])["input_ids"]  # bos from the post-processor, as tokenizer(text) gives it
    completion = hf(PAIR["completion"], add_special_tokens=False)["input_ids"]
    assert prompt[0] == hf.bos_token_id
    assert tokens == [*prompt, *completion, hf.convert_tokens_to_ids(EOS)]
    assert trains == [False] * len(prompt) + [True] * (len(completion) + 1)


@pytest.mark.parametrize("messages", [
    CHAT["messages"],
    CHAT["messages"][1:3],
    [{"role": "user", "content": "Hello! How are you?"}, {"role": "assistant", "content": "The sky is blue."},
     {"role": "user", "content": "ok"}],  # a trailing turn that is not learned
    [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name three animals."},
     {"role": "assistant", "content": "A cat, a dog and a bird."}],
], ids=["system-two-turns", "one-turn", "trailing-user", "assistant-first"])
def test_a_chat_is_the_rendered_conversation_with_transformers_assistant_mask(
        tmp_path: Path, tokdir: Path, hf: Any, messages: list[dict[str, str]]) -> None:
    """transformers' apply_chat_template on the template's {% generation %} markers gives the ids and the
    assistant mask; ours come from rendering turn by turn, without the markers."""
    tokens, trains = sample_tokens(samples(tmp_path, tokdir, [{"messages": messages}]), 0)
    want = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    assert tokens == want["input_ids"]
    assert trains == [bool(m) for m in want["assistant_masks"]]
    assert sum(trains) > 0


def test_without_generation_markers_the_mask_is_the_same(tmp_path: Path, hf: Any) -> None:
    plain = write_tokenizer(tmp_path / "plain", config={"chat_template": re.sub(
        r"\{% (end)?generation %\}", "", CHAT_TEMPLATE)})
    marked = write_tokenizer(tmp_path / "marked")
    assert (sample_tokens(samples(tmp_path, plain, [CHAT]), 0)
            == sample_tokens(samples(tmp_path, marked, [CHAT]), 0))


TEMPLATES = [
    CHAT_TEMPLATE,
    # tojson keeps non-ASCII text, loop controls, a namespace, and a special token other than bos
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}{{ ns.n }}:{{ m | tojson }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}>{% endif %}",
    "{%- for m in messages -%}\n  [{{ m['role'] | upper }}] {{ m['content'] | trim }}\n{%- endfor -%}",
]


@pytest.mark.parametrize("template", TEMPLATES, ids=["chatml", "tojson-loop-controls", "whitespace-control"])
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_the_template_renders_as_transformers_renders_it(tmp_path: Path, template: str,
                                                         generation_prompt: bool) -> None:
    transformers = pytest.importorskip("transformers")
    directory = write_tokenizer(tmp_path / "t", config={"chat_template": template})
    messages = [{"role": "user", "content": "Grüße, ça va?"}, {"role": "skip", "content": "x"},
                {"role": "assistant", "content": "  fine  "}]
    ours = load_tokenizer(str(directory)).render_chat(messages, add_generation_prompt=generation_prompt)
    theirs = transformers.AutoTokenizer.from_pretrained(str(directory)).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt)
    assert ours == theirs


def test_chat_template_jinja_wins_and_a_list_of_templates_gives_its_default(tmp_path: Path) -> None:
    d = write_tokenizer(tmp_path / "a", config={"chat_template": [{"name": "tool_use", "template": "T"},
                                                                   {"name": "default",
                                                                    "template": "D{{ messages | length }}"}]})
    assert load_tokenizer(str(d)).render_chat([{"role": "user", "content": "x"}],
                                              add_generation_prompt=False) == "D1"
    (d / "chat_template.jinja").write_text("J")
    assert load_tokenizer(str(d / "tokenizer.json")).render_chat([], add_generation_prompt=False) == "J"


@pytest.mark.parametrize(("post_processor_bos", "add_bos_token", "starts_with_bos"), [
    (True, None, True), (False, None, False), (True, False, False), (False, True, True)])
def test_add_bos_token_decides_else_the_post_processor(tmp_path: Path, post_processor_bos: bool,
                                                       add_bos_token: bool | None,
                                                       starts_with_bos: bool) -> None:
    d = write_tokenizer(tmp_path / "t", post_processor_bos=post_processor_bos,
                        config={"add_bos_token": add_bos_token})
    tokens, _ = sample_tokens(samples(tmp_path, d, [PAIR]), 0)
    assert (tokens[0] == load_tokenizer(str(d)).special["bos_token"].id) == starts_with_bos


def test_the_first_token_of_a_sample_is_never_learned(tmp_path: Path) -> None:
    d = write_tokenizer(tmp_path / "t", post_processor_bos=False)
    tokens, trains = sample_tokens(samples(tmp_path, d, [{"prompt": "", "completion": "cat dog"}]), 0)
    assert trains[0] is False and all(trains[1:])


# -- rows: padding and packing ------------------------------------------------------------------------

def test_padding_puts_one_sample_in_a_row_learning_only_its_answers(tmp_path: Path, tokdir: Path) -> None:
    source = source_of(tmp_path, tokdir, [PAIR])
    tokens, trains = sample_tokens(source.data, 0)
    inputs, labels = source.sample(0)
    pad = load_tokenizer(str(tokdir)).special["pad_token"].id
    n = len(tokens)
    assert inputs.tolist() == tokens + [pad] * (SEQ - n)
    assert labels.tolist() == ([t if learned else IGNORE_INDEX
                                for t, learned in zip(tokens[1:], trains[1:], strict=True)]
                               + [IGNORE_INDEX] * (SEQ - n + 1))
    # the completion and eos, nothing of the prompt or padding
    assert (labels != IGNORE_INDEX).sum() == sum(trains)


def test_a_sample_of_exactly_seq_len_plus_one_tokens_fills_a_row(tmp_path: Path, tokdir: Path) -> None:
    pair = next(p for k in range(1, 4) if len(sample_tokens(samples(tmp_path, tokdir, [
        p := {"prompt": "Repeat: cat", "completion": " dog" * k}]), 0)[0]) % 2)  # seqLen even
    n = len(sample_tokens(samples(tmp_path, tokdir, [pair]), 0)[0])
    source = source_of(tmp_path, tokdir, [pair], seq_len=n - 1)
    inputs, labels = source.sample(0)
    tokens, _ = sample_tokens(source.data, 0)
    assert inputs.tolist() == tokens[:-1] and labels[-1] == tokens[-1]


def test_packing_fills_rows_with_whole_samples_and_hides_the_next_samples_start(tmp_path: Path,
                                                                                tokdir: Path) -> None:
    lines, seq = mixed_lines(40, max_words=5), 128
    padded, packed = (source_of(tmp_path, tokdir, lines, seq_len=seq),
                      source_of(tmp_path, tokdir, lines, seq_len=seq, packing=True))
    assert padded.rows == 40 and packed.rows < 15
    assert packed.fill() > 2.5 * padded.fill()
    seen: list[int] = []
    for index in range(packed.rows):
        members = packed.row(index).tolist()
        seen += members
        inputs, labels = packed.sample(index)
        lengths = [int(packed.data.lengths[s]) for s in members]
        assert sum(lengths) <= seq + 1
        tokens = np.concatenate([sample_tokens(packed.data, s)[0] for s in members])
        assert inputs[:min(len(tokens), seq)].tolist() == tokens[:seq].tolist()
        for end in np.cumsum(lengths)[:-1]:  # the last token of a sample does not learn the next one's first
            assert labels[end - 1] == IGNORE_INDEX
        # what a packed row learns is what each sample learns on its own
        assert (labels != IGNORE_INDEX).sum() == sum(
            int(packed.data.trains[packed.data.starts[s] + 1:packed.data.starts[s + 1]].sum())
            for s in members)
    assert sorted(seen) == list(range(40))  # every sample once per epoch


def test_next_fit() -> None:
    assert next_fit(np.array([3, 4, 2, 5, 1]), 7).tolist() == [0, 2, 4, 5]
    assert next_fit(np.array([7, 7]), 7).tolist() == [0, 1, 2]


def test_each_epoch_visits_every_row_once_in_an_order_drawn_from_the_seed(tmp_path: Path,
                                                                          tokdir: Path) -> None:
    lines = mixed_lines(12, max_words=4)
    source = source_of(tmp_path, tokdir, lines)
    epochs = [[int(source.row(e * 12 + i)[0]) for i in range(12)] for e in range(3)]
    assert all(sorted(e) == list(range(12)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    again = source_of(tmp_path, tokdir, lines)
    assert [int(again.row(i)[0]) for i in range(36)] == sum(epochs, [])
    other = build_source(cfg_of(tmp_path / "train.jsonl", tokdir).model_copy(
        update={"training": cfg_of(tmp_path / "train.jsonl", tokdir).training.model_copy(
            update={"seed": 4})}))
    assert [int(other.row(i)[0]) for i in range(12)] != epochs[0]  # type: ignore[attr-defined]


# -- the same global batch for every layout, and exact resume --------------------------------------

def global_batch(source: JsonlSource, dp: int, steps: int,
                 cp: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loaders = [BatchLoader(source, 8, dp_rank=r, dp_size=dp) for r in range(dp)]
    out = []
    for _ in range(steps):
        parts = [loader.next_batch() for loader in loaders]
        inputs, labels = torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])
        if cp > 1:  # what the cp ranks hold is the whole batch, each position once
            shards = [shard_sequence(labels, 1, cp, r) for r in range(cp)]
            assert sum(int((s != IGNORE_INDEX).sum()) for s in shards) == int((labels != IGNORE_INDEX).sum())
        out.append((inputs, labels))
    return out


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize(("dp", "cp"), [(2, 1), (4, 1), (8, 1), (2, 2)])
def test_the_global_batch_is_the_same_for_every_layout(tmp_path: Path, tokdir: Path, packing: bool, dp: int,
                                                       cp: int) -> None:
    source = source_of(tmp_path, tokdir, mixed_lines(30), packing=packing)
    single, split = global_batch(source, 1, 5), global_batch(source, dp, 5, cp)
    for (x1, y1), (x2, y2) in zip(single, split, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(single[0][0], single[1][0])


def test_the_loader_resumes_exactly_under_another_dp_across_an_epoch(tmp_path: Path, tokdir: Path) -> None:
    source = source_of(tmp_path, tokdir, mixed_lines(10), packing=False)  # 10 rows: step 2 crosses the epoch
    straight = global_batch(source, 1, 4)
    before = [BatchLoader(source, 8, dp_rank=r, dp_size=2) for r in range(2)]
    for loader in before:
        loader.next_batch()
        loader.next_batch()
    state = before[0].state_dict()
    fresh = build_source(cfg_of(tmp_path / "train.jsonl", tokdir))  # a new process: nothing cached
    after = [BatchLoader(fresh, 8, dp_rank=r, dp_size=4) for r in range(4)]
    for loader in after:
        loader.load_state_dict(state)
    for step in (2, 3):
        parts = [loader.next_batch() for loader in after]
        assert torch.equal(torch.cat([x for x, _ in parts]), straight[step][0])
        assert torch.equal(torch.cat([y for _, y in parts]), straight[step][1])


# -- bad input: an error naming the file, the line and the field, or a counted decision ------------

BAD_LINES = [
    ('{"prompt": "a", "completion": ', "is not valid JSON (Expecting value at column 31)"),
    ('["prompt", "completion"]', "is a JSON array, not an object"),
    ('{"prompt": "a", "completion": "b", "messages": []}', 'has both "messages" and "prompt"/"completion"'),
    ('{"text": "a"}', 'has neither "prompt"/"completion" nor "messages" (its keys: text)'),
    ('{"prompt": "a"}', '"completion" is missing'),
    ('{"completion": "a"}', '"prompt" is missing'),
    ('{"prompt": [{"role": "user", "content": "a"}], "completion": "b"}',
     '"prompt" is a JSON array, not a string (a conversation goes in "messages")'),
    ('{"prompt": "a", "completion": 4}', '"completion" is a JSON number, not a string'),
    ('{"prompt": "a", "completion": ""}', '"completion" is empty'),
    ('{"messages": []}', '"messages" must be a non-empty array'),
    ('{"messages": "hi"}', '"messages" must be a non-empty array'),
    ('{"messages": [{"role": "user", "content": "a"}, "b"]}', "messages[1] is a JSON string, not an object"),
    ('{"messages": [{"content": "a"}]}', "messages[0].role is missing"),
    ('{"messages": [{"role": "user", "content": null}]}', "messages[0].content is a JSON null, not a string"),
    ('{"messages": [{"role": "user", "content": "a"}]}', "messages has no assistant message"),
    ('{"messages": [{"role": "assistant", "content": "a"}], "tools": {}}',
     '"tools" is a JSON object, not an array'),
    ('{"prompt": "a", "completion": "b\\ud800"}', "completion holds an unpaired surrogate (\\ud800)"),
    ('{"messages": [{"role": "user", "content": "\\udc00"}, {"role": "assistant", "content": "b"}]}',
     "messages[0] holds an unpaired surrogate (\\udc00)"),
]


def problem_of(tmp_path: Path, tokenizer: Path, lines: list[Any], **kw: Any) -> str:
    with pytest.raises(ConfigError) as err:
        source_of(tmp_path, tokenizer, lines, **kw)
    return str(err.value)


@pytest.mark.parametrize(("line", "expected"), BAD_LINES, ids=[e.split(" (")[0][:40] for _, e in BAD_LINES])
def test_a_bad_line_is_an_error_naming_the_file_the_line_and_the_field(tmp_path: Path, tokdir: Path,
                                                                       line: str, expected: str) -> None:
    message = problem_of(tmp_path, tokdir, [PAIR, CHAT, line, PAIR])
    assert message.startswith(f"spec.data.path: {tmp_path / 'train.jsonl'} line 3: {expected}"), message
    assert "more line" not in message


def test_text_that_is_not_utf8(tmp_path: Path, tokdir: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_bytes(json.dumps(PAIR).encode() + b'\n{"prompt": "\xff", "completion": "b"}\n')
    with pytest.raises(ConfigError, match=r"line 2: is not UTF-8 text \(byte 13\)"):
        build_source(cfg_of(path, tokdir))


def test_a_template_that_fails_or_does_not_render_turn_by_turn(tmp_path: Path) -> None:
    raising = write_tokenizer(tmp_path / "r", config={"chat_template": (
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
        "{{ m.content }}{% endfor %}")})
    tool = {"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]}
    assert ("line 2: the chat template fails on it: TemplateError: no tools here"
            in problem_of(tmp_path, raising, [CHAT, tool]))
    # the last assistant turn rendered apart from the earlier ones (as Qwen3's reasoning is dropped from
    # earlier turns)
    reordering = write_tokenizer(tmp_path / "o", config={"chat_template": (
        "{% for m in messages %}{% if loop.last %}LAST:{% endif %}{{ m.role }}:{{ m.content }};"
        "{% endfor %}")})
    message = problem_of(tmp_path, reordering, [CHAT])
    assert ("line 1: the chat template does not render this conversation turn by turn (rendered up to "
            "messages[2]" in message)


def test_a_token_outside_the_vocab_names_the_field(tmp_path: Path, tokdir: Path) -> None:
    tok = load_tokenizer(str(tokdir))
    # a model vocab that holds the special tokens and single bytes but not the tokenizer's merges
    top = max(tok.tokenizer.encode("Repeat: cat dog").ids)
    message = problem_of(tmp_path, tokdir, [PAIR], vocab=top)
    assert message.startswith(f"spec.data.path: {tmp_path / 'train.jsonl'} line 1: prompt holds token id "
                              f"{top} (")
    assert message.endswith(f"outside the model's vocab of {top}; use a model whose vocab covers the "
                            f"tokenizer's {tok.vocab_size} tokens (spec.model.vocab)")


def test_a_sample_longer_than_a_row_is_an_error_unless_truncated(tmp_path: Path, tokdir: Path) -> None:
    long = {"prompt": "Repeat: " + " ".join(WORDS * 5), "completion": "dog"}
    longer = {"messages": [{"role": "user", "content": " ".join(WORDS * 5)},
                           {"role": "assistant", "content": "moon"}]}
    message = problem_of(tmp_path, tokdir, [PAIR, long, longer])
    assert re.fullmatch(r"spec.data.path: \S+ line 2: has 9\d tokens \(prompt 9\d, completion 1\), more than "
                        r"a row holds \(seqLen\+1 = 65\); line 3: has 1\d\d tokens \(messages\[0\] 1\d\d, "
                        r"messages\[1\] 3\), more than a row holds \(seqLen\+1 = 65\); raise .*",
                        message), message
    assert message.endswith("raise spec.model.seqLen, shorten or remove the lines longer than a row, or set"
                            " spec.data.truncate: true to keep their first 65 tokens")
    notes: list[str] = []
    source = source_of(tmp_path, tokdir, [PAIR, long, longer], notes, truncate=True)
    # line 2 keeps part of its prompt and nothing to learn: left out; line 3's prompt alone is longer too
    assert source.data.lines.tolist() == [1]
    assert notes[0].startswith(f"jsonl data {tmp_path / 'train.jsonl'}: 1 sample (1 prompt/completion, 0 "
                               "chat)")
    assert any(n.startswith("spec.data.truncate: cut 2 samples longer than 65 tokens to their first 65 "
                            "(lines 2, 3), dropping ") for n in notes), notes
    assert "spec.data.truncate: left out 2 samples with nothing left to learn once cut (lines 2, 3)" in notes


def test_truncation_keeps_the_first_tokens_of_a_sample_that_still_learns(tmp_path: Path,
                                                                         tokdir: Path) -> None:
    long = {"prompt": "Repeat: cat", "completion": " ".join(WORDS * 5)}
    full, _ = sample_tokens(samples(tmp_path, tokdir, [long], row=1000), 0)
    notes: list[str] = []
    source = source_of(tmp_path, tokdir, [long], notes, truncate=True)
    tokens, trains = sample_tokens(source.data, 0)
    assert tokens == full[:SEQ + 1] and all(trains[-10:])
    assert f"dropping {len(full) - SEQ - 1} tokens, {len(full) - SEQ - 1} of them learned" in notes[-1]


def test_empty_lines_are_skipped_and_counted(tmp_path: Path, tokdir: Path) -> None:
    notes: list[str] = []
    source = source_of(tmp_path, tokdir, ["", PAIR, "  ", CHAT, ""], notes)
    assert source.data.lines.tolist() == [2, 4]
    assert notes[0].startswith(f"jsonl data {tmp_path / 'train.jsonl'}: 2 samples (1 prompt/completion, 1 "
                               "chat)")
    assert notes[1] == "skipped 3 empty lines: 1, 3, 5"
    assert "holds no sample (2 empty lines)" in problem_of(tmp_path, tokdir, ["", " "])


def test_many_bad_lines_show_the_first_and_count_the_rest(tmp_path: Path, tokdir: Path) -> None:
    message = problem_of(tmp_path, tokdir, [PAIR] + ["[]"] * 9)
    assert message.count("is a JSON array") == 5 and "line 6:" in message and "line 7:" not in message
    assert message.endswith("; and 4 more lines with problems")


# (how to make the tokenizer under tmp, the model's vocab, what the message says)
TOKENIZER_PROBLEMS = [
    (lambda d: d / "missing", None,
     "is neither 'byte', a tokenizer.json nor a Hugging Face tokenizer directory"),
    (lambda d: (d / "empty").mkdir() or d / "empty", None, "has no tokenizer.json"),
    (lambda d: (d / "t" / "tokenizer.json").write_text("{}") and d / "t", None,
     "is not a tokenizer.json the tokenizers library loads"),
    (lambda d: (d / "t" / "tokenizer_config.json").write_text("{") and d / "t", None, "cannot read"),
    (lambda d: (d / "t" / "tokenizer_config.json").write_text("[]") and d / "t", None,
     "holds a JSON list, not an object"),
    (lambda d: write_tokenizer(d / "u", config={"eos_token": "<|nope|>"}), None,
     "names eos_token '<|nope|>', which"),
    (lambda d: write_tokenizer(d / "u", config={"eos_token": None}), None,
     "names no eos_token in tokenizer_config.json"),
    (lambda d: write_tokenizer(d / "u", config={"eos_token": {"content": "<|endoftext|>", "special": True}}),
     4, "eos_token '<|endoftext|>' is token id 4, outside the model's vocab of 4"),
    (lambda d: write_tokenizer(d / "u", config={"add_bos_token": True, "bos_token": None}), None,
     "sets add_bos_token but names no bos_token"),
    (lambda d: write_tokenizer(d / "u", config={"chat_template": None}), None, "has no chat template"),
    (lambda d: write_tokenizer(d / "u", config={"chat_template": "{% for %}"}), None, "does not parse"),
    (lambda d: write_tokenizer(d / "u", config={"chat_template": [{"name": "tool_use", "template": "x"}]}),
     None, "lists templates ['tool_use'] but none named 'default'"),
]


@pytest.mark.parametrize(("make", "vocab", "expected"), TOKENIZER_PROBLEMS,
                         ids=[e[:30] for _, _, e in TOKENIZER_PROBLEMS])
def test_a_tokenizer_problem_names_spec_data_tokenizer(tmp_path: Path, tokdir: Path, make: Any,
                                                       vocab: int | None, expected: str) -> None:
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "tokenizer.json").write_text((tokdir / "tokenizer.json").read_text())
    path = write_jsonl(tmp_path / "train.jsonl", [PAIR, CHAT])
    with pytest.raises(ConfigError) as err:
        build_source(cfg_of(path, make(tmp_path), vocab=vocab))
    assert str(err.value).startswith("spec.data.tokenizer: ") and expected in str(err.value), str(err.value)


def test_pair_lines_need_no_chat_template(tmp_path: Path) -> None:
    d = write_tokenizer(tmp_path / "u", config={"chat_template": None})
    assert source_of(tmp_path, d, [PAIR]).rows == 1


def test_the_byte_tokenizer_and_a_missing_file(tmp_path: Path, tokdir: Path) -> None:
    cfg = cfg_of(tmp_path / "train.jsonl", tokdir)
    byte = cfg.model_copy(update={"data": cfg.data.model_copy(update={"tokenizer": "byte"})})
    with pytest.raises(ConfigError,
                       match="^spec.data.tokenizer: data.source=jsonl needs a Hugging Face tokenizer"):
        check_runnable(byte)
    with pytest.raises(ConfigError,
                       match="^spec.data.tokenizer: data.source=jsonl needs a Hugging Face tokenizer"):
        build_source(byte)
    with pytest.raises(ConfigError, match=f"^spec.data.path: '{tmp_path / 'train.jsonl'}' is not a file"):
        build_source(cfg)


def test_the_text_source_takes_a_tokenizer_directory(tmp_path: Path, tokdir: Path) -> None:
    (tmp_path / "corpus.txt").write_text("the cat sat on the mat. " * 20)
    cfg = job({}, nproc=1, model={"seqLen": 16}, data={"source": "text", "path": str(tmp_path / "corpus.txt"),
                                                       "tokenizer": str(tokdir)})
    assert build_source(cfg).sample(0).tolist() == \
        load_tokenizer(str(tokdir)).tokenizer.encode("the cat sat on the mat. " * 20).ids[:17]


def test_the_examples_data_and_tokenizer_fit_its_job() -> None:
    """examples/sft-jsonl.yaml reads examples/sft-jsonl/ from a volume at /data: every line passes the
    checks with the job's model, and packing fills its rows."""
    import yaml

    from tetrad.api import parse
    from tetrad.resolve import resolve

    root = Path(__file__).resolve().parents[2] / "examples"
    doc = yaml.safe_load((root / "sft-jsonl.yaml").read_text())
    data = doc["spec"]["data"]
    assert (data["path"], data["tokenizer"]) == ("/data/train.jsonl", "/data/tokenizer")
    data.update(path=str(root / "sft-jsonl" / "train.jsonl"), tokenizer=str(root / "sft-jsonl" / "tokenizer"))
    parsed, problems = parse(doc)
    assert parsed is not None, problems
    notes: list[str] = []
    source = build_source(resolve(parsed), note=notes.append)
    assert isinstance(source, JsonlSource) and source.data.count == 48 and source.rows == 8
    assert notes == [notes[0]] and "24 prompt/completion, 24 chat" in notes[0]  # nothing skipped or cut
