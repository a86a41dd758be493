"""Training on fine-tuning data (data.source: jsonl) with real process groups: a bad file stops every rank
with 78 before any collective, an interrupted run resumes bit for bit, and `tetrad run` of two processes
trains with a loss over the learned tokens alone, checked against a computation by hand."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tetrad_trainer.data import build_source
from tetrad_trainer.model import Transformer, init_weights

from tests.trainer.harness import free_port_block, job, rewind, run_ranks, run_trainer
from tests.trainer.sft_data import EOS, copy_task, mixed_lines, sft_data
from tetrad.api import parse
from tetrad.api.contract import EXIT_CONFIG_ERROR
from tetrad.launch import run_local

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MODEL = {"seqLen": 64}


def jsonl_job(tmp: Path, lines: list[Any], parallelism: dict[str, Any], nproc: int, training: dict[str, Any],
              **data: Any) -> Any:
    path, tokenizer = sft_data(tmp, lines)
    return job(parallelism, nproc=nproc, model=MODEL, training=training,
               data={"source": "jsonl", "path": str(path), "tokenizer": str(tokenizer), **data})


def test_a_bad_line_stops_every_rank_with_78_before_any_collective(tmp_path: Path) -> None:
    lines: list[Any] = [*mixed_lines(6), {"prompt": "a"}]
    cfg = jsonl_job(tmp_path, lines, {"dpShard": 2}, 2, {"globalBatch": 2})
    run = run_trainer(cfg, tmp_path / "run", timeout=120)
    assert run.codes == [EXIT_CONFIG_ERROR] * 2, run.logs()
    said = f'config error: spec.data.path: {tmp_path / "train.jsonl"} line 7: "completion" is missing'
    assert all(said in run.log(r) for r in range(2)), run.logs()
    # Alone, rank 1 of a world of 2 would wait for rank 0 in the rendezvous: it stops at once, before joining.
    alone = run_ranks("tetrad_trainer.train:main", ["--config", str(tmp_path / "run" / "config.json")], 1, 1,
                      tmp_path / "alone", timeout=60, env={"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert alone.codes == [EXIT_CONFIG_ERROR] and alone.seconds < 30, alone.logs()


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_an_interrupted_run_resumes_bit_for_bit(tmp_path: Path, packing: bool) -> None:
    """globalBatch 4, checkpoints every 2 steps, 8 rows or between 9 and 19: the resumed steps 3-5 (rows
    8-19) start or cross the second epoch's order. The run resumed from step 2 logs the very losses of the
    run that went straight through, and ends with the same parameters."""
    path, tokenizer = sft_data(tmp_path, mixed_lines(8 if not packing else 24))
    ckpt = tmp_path / "ckpt"
    cfg = job({"dpShard": 2}, nproc=2, model=MODEL,
              training={"steps": 5, "globalBatch": 4, "precision": "fp32", "lr": 1e-3, "warmupSteps": 1,
                        "seed": 2},
              data={"source": "jsonl", "path": str(path), "tokenizer": str(tokenizer), "packing": packing},
              checkpoint={"enabled": True, "path": str(ckpt), "interval": 2})
    rows = build_source(cfg).rows
    assert rows == 8 if not packing else 8 < rows < 20
    straight = run_trainer(cfg, tmp_path / "straight",
                           args=("--save-full-parameters", str(tmp_path / "straight.pt")))
    assert straight.codes == [0, 0], straight.logs()
    rewind(ckpt, 2)
    resumed = run_trainer(cfg, tmp_path / "resumed",
                          args=("--save-full-parameters", str(tmp_path / "resumed.pt")))
    assert resumed.codes == [0, 0], resumed.logs()
    assert "resumed step 2" in resumed.log(0)
    assert [r["step"] for r in resumed.records] == [3, 4, 5]
    assert [r["loss"] for r in resumed.records] == [r["loss"] for r in straight.records[2:]]
    want, got = torch.load(tmp_path / "straight.pt"), torch.load(tmp_path / "resumed.pt")
    assert all(torch.equal(want[k], got[k]) for k in want)


def hand_labelled(lines: list[dict[str, Any]], tokenizer: Path) -> list[tuple[list[int], list[bool]]]:
    """Each line's tokens and which of them the loss learns, by transformers: the completion and eos after
    tokenizer(prompt), or the assistant mask of apply_chat_template."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tokenizer))
    out = []
    for line in lines:
        if "messages" in line:
            r = hf.apply_chat_template(line["messages"], tokenize=True, return_dict=True,
                                       return_assistant_tokens_mask=True)
            out.append((r["input_ids"], [bool(m) for m in r["assistant_masks"]]))
        else:
            prompt = hf(line["prompt"])["input_ids"]
            completion = [*hf(line["completion"], add_special_tokens=False)["input_ids"],
                          hf.convert_tokens_to_ids(EOS)]
            out.append(([*prompt, *completion], [False] * len(prompt) + [True] * len(completion)))
    return out


def losses_by_hand(cfg: Any, labelled: list[tuple[list[int], list[bool]]]) -> tuple[float, float]:
    """The seed's model on every sample once: (mean loss over the learned tokens, mean over every token)."""
    with torch.device("meta"):
        model = Transformer(cfg.model)
    init_weights(model, torch.device("cpu"), seed=cfg.training.seed)
    learned_sum, learned_n, all_sum, all_n = 0.0, 0, 0.0, 0
    with torch.no_grad():
        for ids, learned in labelled:
            x = torch.tensor([ids[:-1] + [0] * (cfg.model.seq_len - len(ids) + 1)])
            per_token = F.cross_entropy(model(x)[0, :len(ids) - 1], torch.tensor(ids[1:]), reduction="none")
            mask = torch.tensor(learned[1:])
            learned_sum, learned_n = learned_sum + per_token[mask].sum().item(), learned_n + int(mask.sum())
            all_sum, all_n = all_sum + per_token.sum().item(), all_n + len(per_token)
    return learned_sum / learned_n, all_sum / all_n


def test_tetrad_run_trains_two_processes_on_jsonl_and_counts_only_the_learned_tokens(tmp_path: Path) -> None:
    """globalBatch is the whole file, so step 1's loss is the seed's model's mean over every learned token
    of the file, whatever order the rows come in; the run's first loss equals the one computed here with
    transformers' own tokenization, not the mean over every token, and the loss falls."""
    rng = random.Random(1)
    lines: list[dict[str, Any]] = mixed_lines(6, seed=1)
    lines += [{"prompt": p, "completion": c} for p, c in (copy_task(rng, 3), copy_task(rng, 5))]
    path, tokenizer = sft_data(tmp_path, lines)
    doc = {"apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob", "metadata": {"name": "sft"},
           "spec": {"nodes": 2, "nprocPerNode": 1, "parallelism": {"dpShard": 2},
                    "model": {"preset": "debug", **MODEL},
                    "training": {"steps": 8, "globalBatch": 8, "precision": "fp32", "lr": 3e-3,
                                 "warmupSteps": 0, "lrSchedule": "constant", "seed": 3},
                    "data": {"source": "jsonl", "path": str(path), "tokenizer": str(tokenizer)},
                    "metrics": {"port": free_port_block(2)}}}
    parsed, problems = parse(doc)
    assert parsed is not None, problems
    jsonl = tmp_path / "metrics.jsonl"
    code = run_local(parsed, jsonl=jsonl, workdir=tmp_path / "work")
    assert code == 0, (tmp_path / "work" / "node-0.log").read_text()[-3000:]
    losses = [json.loads(line)["loss"] for line in jsonl.read_text().splitlines()]
    assert len(losses) == 8

    learned, every = losses_by_hand(job({}, nproc=1, model=MODEL, training=doc["spec"]["training"]),
                                    hand_labelled(lines, tokenizer))
    assert losses[0] == pytest.approx(learned, rel=1e-5)
    # the seed's model is near-uniform over the vocab, so the two means differ by a few percent only: still
    # a hundred times the tolerance above
    assert abs(every - learned) > 1e-3 * learned, "the prompt's tokens would have changed the loss"
    assert losses[-1] < 0.7 * losses[0], losses
    logs = [(tmp_path / "work" / f"node-{n}.log").read_text() for n in range(2)]
    assert f"jsonl data {path}: 8 samples (5 prompt/completion, 3 chat)" in logs[0]
    assert "jsonl data" not in logs[1]  # rank 0 alone logs it
