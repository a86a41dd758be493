"""Tetrad's runtime library for a Hugging Face `Trainer` script, in two added lines:

    from tetrad_trainer.hf_callback import TetradCallback
    trainer = Trainer(..., callbacks=[TetradCallback()])

Every step reports to the job (STEP, TOKENS/S with `include_num_input_tokens_seen=True`, MFU, LOSS in
its status, and the heartbeat of stall detection) and polls it: a checkpoint-now request saves at the
end of the step, SIGTERM saves, stops the training and exits 75, so the operator restarts the gang
without spending maxRestarts. The script resumes from its own checkpoint as any Trainer script does
(`trainer.train(resume_from_checkpoint=get_last_checkpoint(output_dir))`).
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from tetrad_trainer import runtime


class TetradCallback(TrainerCallback):  # type: ignore[misc]
    def __init__(self, flops_per_token: float | None = None):
        """`flops_per_token`: for MFU; default 6 x the model's parameters (its matmuls, forward and
        backward)."""
        self.flops_per_token = flops_per_token
        self.run: runtime.Run | None = None
        self.loss: float | None = None
        self.tokens_seen = 0
        self.stopping = False

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: Any = None, **kwargs: Any) -> None:
        self.run = runtime.init()  # the Trainer's process group exists already: it is kept
        if self.flops_per_token is None and model is not None:
            self.flops_per_token = 6.0 * sum(p.numel() for p in model.parameters())
        self.tokens_seen = state.num_input_tokens_seen

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.loss = logs["loss"]

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        assert self.run is not None
        seen = state.num_input_tokens_seen  # every process's, summed: 0 unless include_num_input_tokens_seen
        tokens, self.tokens_seen = (seen - self.tokens_seen) or None, seen
        self.run.report(state.global_step, loss=self.loss, tokens=tokens,
                        flops_per_token=self.flops_per_token)
        action = self.run.poll()
        control.should_save = control.should_save or action.save
        if action.stop:
            control.should_training_stop = self.stopping = True

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        assert self.run is not None
        self.run.saved(state.global_step)
        if self.stopping:
            self.run.exit_preempted()

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self.run is not None:
            self.run.close()
