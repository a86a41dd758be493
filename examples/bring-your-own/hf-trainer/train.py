"""A Hugging Face `Trainer` script under Tetrad: the two lines marked `Tetrad` are all it adds (live
figures in the job's status, stall detection, save and exit 75 on SIGTERM). It trains a small Llama built
from a config (no download) on synthetic tokens, and resumes from its own last checkpoint.

    python -m torch.distributed.run --nproc-per-node 2 train.py --max-steps 20       # anywhere, or under Tetrad
"""

import argparse
import os

import torch
from tetrad_trainer.hf_callback import TetradCallback  # Tetrad
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

SEQ = 64


class Tokens(torch.utils.data.Dataset):
    """Deterministic synthetic sequences."""

    def __init__(self, n: int, vocab: int):
        self.data = torch.randint(0, vocab, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--output-dir", default=os.environ.get("TETRAD_CHECKPOINT_DIR", "checkpoints"))
    args = p.parse_args()

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    training = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=4, learning_rate=1e-3,
        logging_steps=1, save_strategy="steps", save_steps=10, save_total_limit=2, report_to=[],
        include_num_input_tokens_seen=True, use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0)
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(4096, config.vocab_size),
                      callbacks=[TetradCallback()])  # Tetrad
    last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    trainer.train(resume_from_checkpoint=last)


if __name__ == "__main__":
    main()
