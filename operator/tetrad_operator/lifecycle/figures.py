"""What rank 0 left in its termination message when it finished or stopped on SIGTERM: its last
figures (the gauges the scraper reads, as exposition text), read into status.training,
status.checkpoint and status.trainerTime as a scrape would read them. A job that ends between two
scrapes still shows its last step and loss, and its goodput counts its last steps and save."""

from __future__ import annotations

from tetrad.api import contract
from tetrad.api.spec import ParallelTrainingJob, TrainerTimeStatus
from tetrad_operator import scrape, status
from tetrad_operator.lifecycle.machine import JobPass
from tetrad_operator.observed import PodState, format_time


def record_left(m: JobPass, job: ParallelTrainingJob, rank0: PodState | None) -> None:
    """Rank 0's last figures into status.training, status.checkpoint and status.trainerTime, once."""
    if rank0 is None or (text := rank0.said.figures) is None:
        return
    try:
        training, saved, account = scrape.parse_each(text, contract.SCRAPED, contract.SCRAPED_CHECKPOINT,
                                                     contract.SCRAPED_TRAINER_TIME)
    except ValueError:  # not an exposition: a message cut short, say
        return
    if account:  # over a scrape of the same incarnation, whose preflight time it keeps
        kept = m.trainer_time
        if kept is None or kept.restart != rank0.restart:
            kept = TrainerTimeStatus(restart=rank0.restart)
        m.trainer_time = status.merged(kept, account)
    if training and any(status.wire(m.training).get(k) != v for k, v in training.items()):
        m.training = status.merged(m.training, training)
        m.training.updated = format_time(m.now)
    if saved:
        m.checkpoint = status.merged(m.checkpoint,
                                     scrape.checkpoint(saved, job.spec.checkpoint.path, rank0.restart))
