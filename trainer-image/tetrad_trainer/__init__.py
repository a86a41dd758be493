"""Tetrad's trainer: a Llama-style model trained with pipeline, data (DDP/FSDP2/HSDP), context and tensor
parallelism."""
