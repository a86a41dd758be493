"""The loss in one process: ignore index, global normalization over microbatches, the chunked loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tetrad_trainer.data import PAD_INPUT, BatchLoader
from tetrad_trainer.loss import IGNORE_INDEX, TokenLoss, chunked_cross_entropy_sum, cross_entropy_sum

torch.manual_seed(0)


def padded_labels(batch: int, seq: int, vocab: int, valid: list[int]) -> torch.Tensor:
    labels = torch.randint(0, vocab, (batch, seq))
    for row, n in enumerate(valid):
        labels[row, n:] = IGNORE_INDEX
    return labels


def test_padding_adds_nothing_and_the_mean_is_over_all_valid_tokens_of_the_batch() -> None:
    batch, seq, vocab = 4, 16, 11
    logits = torch.randn(batch, seq, vocab, requires_grad=True)
    labels = padded_labels(batch, seq, vocab, [16, 3, 9, 1])
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                           ignore_index=IGNORE_INDEX)  # mean over 29 tokens
    (want_grad,) = torch.autograd.grad(want, logits)

    loss = TokenLoss()
    assert loss.set_scale(labels, None, 1).item() == 29
    # Two microbatches of very different valid counts: each scaled by the global count, summed.
    got = sum(loss(x, y) for x, y in zip(logits.chunk(2), labels.chunk(2), strict=True))
    (got_grad,) = torch.autograd.grad(got, logits)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    assert torch.allclose(got_grad, want_grad, rtol=1e-6, atol=1e-8)
    assert not got_grad[3, 1:].any()  # padded positions get no gradient
    per_microbatch_mean = sum(F.cross_entropy(x.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)
                              for x, y in zip(logits.chunk(2), labels.chunk(2), strict=True)) / 2
    assert abs(per_microbatch_mean.item() - want.item()) > 1e-3  # the case the global count exists for


def test_all_padding_gives_zero_loss_not_nan() -> None:
    labels = torch.full((2, 8), IGNORE_INDEX)
    loss = TokenLoss()
    loss.set_scale(labels, None, 1)
    assert loss(torch.randn(2, 8, 5), labels).item() == 0.0


@pytest.mark.parametrize("chunks", [2, 3, 7, 64])
def test_chunked_loss_equals_the_plain_loss_in_fp32(chunks: int) -> None:
    batch, seq, dim, vocab = 3, 40, 24, 97
    g = torch.Generator().manual_seed(chunks)
    hidden = torch.randn(batch, seq, dim, generator=g, requires_grad=True)
    output = torch.nn.Linear(dim, vocab, bias=False)
    labels = padded_labels(batch, seq, vocab, [40, 17, 5])

    plain = cross_entropy_sum(output(hidden), labels)
    plain_grads = torch.autograd.grad(plain, (hidden, output.weight))
    chunked = chunked_cross_entropy_sum(hidden, labels, output, chunks)
    chunked_grads = torch.autograd.grad(chunked, (hidden, output.weight))
    assert chunked.item() == pytest.approx(plain.item(), rel=1e-6)
    for a, b in zip(chunked_grads, plain_grads, strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_loss_equals_the_eager_one(dtype: torch.dtype) -> None:
    """compile: true compiles the loss too (TokenLoss(compiled=True)); padding and the fp32 math stay."""
    batch, seq, vocab = 3, 24, 257
    logits = torch.randn(batch, seq, vocab,
                         generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()
    labels = padded_labels(batch, seq, vocab, [24, 9, 0])
    eager, compiled = TokenLoss(), TokenLoss(compiled=True)
    want, got = eager.token_sum(logits, labels), compiled.token_sum(logits, labels)
    (want_grad,), (got_grad,) = torch.autograd.grad(want, logits), torch.autograd.grad(got, logits)
    assert got.dtype == want.dtype == torch.float32
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    # the gradient in the logits' dtype; padding gets none
    assert got_grad.dtype == dtype and not got_grad[2].any()
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the gradient either way
    assert torch.allclose(got_grad.float(), want_grad.float(), rtol=tolerance, atol=tolerance * 1e-2)


def test_chunked_loss_keeps_one_slice_of_logits_alive() -> None:
    """The saved tensors of the chunked loss hold no batch x seq x vocab logits (nor a slice's)."""
    batch, seq, dim, vocab = 2, 64, 16, 1000
    hidden = torch.randn(batch, seq, dim, requires_grad=True)
    output = torch.nn.Linear(dim, vocab, bias=False)
    labels = torch.randint(0, vocab, (batch, seq))
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_cross_entropy_sum(hidden, labels, output, chunks=8)
    assert max(saved) < batch * seq * vocab / 8
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        cross_entropy_sum(output(hidden), labels)
    assert max(saved) >= batch * seq * vocab  # the plain loss saves the whole logits


def test_the_loader_feeds_padding_as_the_pad_token_and_keeps_it_out_of_the_labels() -> None:
    class Padded:
        def sample(self, index: int):
            import numpy as np

            return np.array([5, 6, 7, IGNORE_INDEX, IGNORE_INDEX])

    inputs, labels = BatchLoader(Padded(), 2, dp_rank=0, dp_size=1).next_batch()
    assert inputs.tolist() == [[5, 6, 7, PAD_INPUT]] * 2
    assert labels.tolist() == [[6, 7, IGNORE_INDEX, IGNORE_INDEX]] * 2
